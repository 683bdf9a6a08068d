"""TRL's ``AsyncGRPOTrainer`` weight sync through the disk: a ``WeightTransferProtocol`` (TRL's
``trl.experimental.async_grpo``) for a machine without NCCL or CUDA, as the disk push of this package serves
``BAPOTrainer``.

Why: TRL's async trainer streams its weights into vLLM over NCCL (``WeightTransferClient``), which needs CUDA on both
sides. Pass ``weight_transfer=DiskWeightTransfer(url)`` instead: each sync pauses the server with its requests held
(``/pause?mode=keep``, TRL's own pause), writes the weights TRL streams (base-checkpoint names) to a directory, has
the server reload them (``/collective_rpc reload_weights``, vLLM's dev mode, as ``bapo serve`` starts it), resets the
prefix cache once, and resumes. vLLM 0.32's keep-mode pause already clears its caches (``clear_cache``, on by
default): the held requests give up their blocks and recompute them under the new weights once resumed, as on TRL's
NCCL path, which pauses the same way (its samples carry the versions that produced them). Measured on the CPU server
with 32 requests held: the reset after the pause answered ``success: true``. The reset is checked, not retried: a
server whose pause kept blocks would answer ``false`` while its requests are held (the disk push's retry would wait
forever), and later requests would reuse prefixes computed by the old weights: the sync then fails, naming it. The
server must read the directory at the same path (``$BAPO_VLLM_WEIGHTS_DIR`` on a shared mount), which
:meth:`init_weight_transfer` checks once.

What it sends is what TRL streams: with a peft model on TRL's merged path, TRL's own in-place merge and unmerge
around the send (in bfloat16 ``W + BA - BA`` is not ``W``, huggingface/trl#6688) are TRL's, not this transfer's;
``BAPOTrainer``'s merged push puts the base back bit for bit (:func:`.gather.exact_unmerge`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .weight_sync import DiskWeightSync, WeightSyncError


class ResetOnceWhilePaused(DiskWeightSync):
    """The disk push under a pause that holds requests: one prefix-cache reset, checked (module doc), instead of
    retrying until no request holds a block."""

    def _reset_prefix_cache(self, base_url: str) -> None:
        if not self._reset_once(base_url):
            raise WeightSyncError(
                f"weight sync: the vLLM server at {base_url} kept KV blocks through its pause (/reset_prefix_cache "
                "answered success=false while requests were held): later requests would reuse prefixes computed by "
                "the old weights. vLLM 0.32's /pause?mode=keep clears them; use it, or a server that does.")


class DiskWeightTransfer:
    """``AsyncGRPOTrainer(..., weight_transfer=DiskWeightTransfer(url))``: TRL's ``WeightTransferProtocol`` over the
    disk (module doc). ``refresh_output_layers``: the model ties its embeddings and the server runs on vLLM's CPU
    backend (its LM head is re-packed after a reload; ``bapo serve`` loads the worker extension that does it)."""

    def __init__(self, base_url: str, timeout: float = 240.0, root: str | None = None,
                 refresh_output_layers: bool = False):
        self.sync = ResetOnceWhilePaused(base_url, timeout=timeout, root=root,
                                         refresh_output_layers=refresh_output_layers)
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        """Once, before the first sync: the server answers and reads this trainer's weight directory."""
        self.sync.check_shared_directory()

    def pause(self) -> None:
        self._on_every_server("/pause?mode=keep", "pause before a weight sync")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write every ``(name, tensor)`` TRL streams (CPU copies, base-checkpoint names) and have the server load
        them."""
        self.sync.push({name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator})
        self.syncs += 1

    def resume(self) -> None:
        self._on_every_server("/resume", "resume after a weight sync")

    def destroy(self) -> None:
        self.sync.close()

    def _on_every_server(self, path: str, what: str) -> None:
        self.sync._on_every_server(lambda url: self.sync._post(path, what, base_url=url))
