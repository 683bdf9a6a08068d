"""TRL's ``AsyncGRPOTrainer`` weight sync through the disk: a ``WeightTransferProtocol`` (TRL's
``trl.experimental.async_grpo``) for a machine without NCCL or CUDA, as the disk push of this package serves
``BAPOTrainer``.

Why: TRL's async trainer streams its weights into vLLM over NCCL (``WeightTransferClient``), which needs CUDA on both
sides. Pass ``weight_transfer=DiskWeightTransfer(url)`` instead: each sync pauses the server with its requests held
(``/pause?mode=keep``, TRL's own pause), writes the weights TRL streams (base-checkpoint names) to a directory, has
the server reload them (``/collective_rpc reload_weights``, vLLM's dev mode, as ``bapo serve`` starts it), drops the
prefix cache INCLUDING the held requests' blocks (computed by the old weights; without ``reset_running_requests`` the
reset waits for them forever while they are paused), and resumes. The server must read the directory at the same
path (``$BAPO_VLLM_WEIGHTS_DIR`` on a shared mount), which :meth:`init_weight_transfer` checks once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .weight_sync import DiskWeightSync


class RunningRequestsReset(DiskWeightSync):
    """The disk push, its prefix-cache reset also dropping the blocks of requests held by a pause."""

    def _reset_prefix_cache(self, base_url: str) -> None:
        self._post("/reset_prefix_cache?reset_running_requests=true", "weight sync (prefix cache reset) failed",
                   base_url=base_url)


class DiskWeightTransfer:
    """``AsyncGRPOTrainer(..., weight_transfer=DiskWeightTransfer(url))``: TRL's ``WeightTransferProtocol`` over the
    disk (module doc). ``refresh_output_layers``: the model ties its embeddings and the server runs on vLLM's CPU
    backend (its LM head is re-packed after a reload; ``bapo serve`` loads the worker extension that does it)."""

    def __init__(self, base_url: str, timeout: float = 240.0, root: str | None = None,
                 refresh_output_layers: bool = False):
        self.sync = RunningRequestsReset(base_url, timeout=timeout, root=root,
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
