"""TRL's own weight push for :class:`~.vllm_generation.BAPOVLLMGeneration` (server mode on CUDA: NCCL; colocate: the
engine in each process), made safe for several processes: TRL walks the weights on every process (each gather a
collective under ZeRO-3) while the main process streams them, so a push that fails on one process must still walk
every weight there before the error is raised everywhere. A mixin of the backend: it wraps TRL's ``sync_weights`` and
``_iter_named_params``.
"""

from __future__ import annotations

import contextlib

from trl.generation.vllm_generation import is_peft_model

from .gather import CpuCopies, exact_unmerge
from .processes import raise_if_any


class TRLPushMixin:
    """TRL's push with failures raised on every process, and its merged LoRA walk bit-exact (module doc)."""

    _walks: list | None = None  # TRL's weight walks of the push in progress (:meth:`_sync_through_trl`)

    def _sync_through_trl(self) -> None:
        """TRL's push (server mode on CUDA: NCCL; colocate: the engine in this process). An error on a process (on the
        main one, a server gone or restarted: the client's requests fail) is raised on every process, after that
        process has made every walk over the weights the others make (the rest of those begun, then any not begun):
        they gather each weight with it (a collective under ZeRO-3) and would otherwise wait in a gather, or in the
        next collective, until the process group's timeout. A gather that fails itself is out of reach (the others
        wait inside it). The server then holds a mix of old and new weights; the trainer stops, as with any failed
        push. Every walk is closed before this returns or raises (with one process at once, Ctrl-C too: a merged LoRA
        walk leaves the adapter unmerged, not whenever the traceback that holds the walk is freed)."""
        processes = self.accelerator.num_processes
        walks_due = 1 + (self.mode == "server" and self._weight_metadata is None)  # TRL walks for its metadata first
        error = None
        self._walks = []
        try:
            try:
                super().sync_weights()
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                if processes == 1:
                    raise
                error = exc
                self._finish_walks(walks_due)
        finally:
            walks, self._walks = self._walks, None
            for walk in walks:
                walk.close()  # a walk that ended: nothing; one left part-way: its gather and merge undone
        raise_if_any(error, processes, "pushing the weights")

    def _finish_walks(self, due: int) -> None:
        """After a failed push: the rest of every walk begun, then walks until ``due`` were made (a failure before
        TRL's walk: colocate's wake-up). A failure while walking is dropped: the push's own error is raised."""
        try:
            for walk in list(self._walks):
                for _ in walk:
                    pass
            while len(self._walks) < due:
                for _ in self._iter_named_params():
                    pass
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    def _walk_copies(self, keep: bool) -> tuple[dict, BaseException | None]:
        """TRL's walk made whole, each weight copied to the CPU where ``keep``: ``(copies, error)``. A copy that fails
        (host memory) stops the copies, not the walk: the other processes gather every weight with this one (ZeRO-3),
        and the caller raises the error on every process once all have walked. Ctrl-C closes the walk at once."""
        copies, copy = {}, CpuCopies(keep)
        with contextlib.closing(self._iter_named_params()) as walk:
            for name, param in walk:
                copy(copies, name, param)
        return copies, copy.error

    def _iter_named_params(self):
        """TRL's walk over the weights to push (:meth:`_walk_named_params`); inside :meth:`_sync_through_trl` each walk
        is kept until the push is over, so that a push that failed part-way can finish the walk's gathers."""
        walk = self._walk_named_params()
        if self._walks is not None:
            self._walks.append(walk)
        return walk

    def _walk_named_params(self):
        """TRL's walk; with a peft model the merged walk leaves the base weights bit-exact
        (:func:`~.gather.exact_unmerge`: in bfloat16 TRL's merge and unmerge moved them), and inside TRL's push
        yields copies of the merged weights: vLLM's packed NCCL transfer (``pack_tensors``) keeps views of what the
        walk yields and concatenates its last chunk only once the walk has ended, after TRL's walk has unmerged in
        place, so that chunk (the whole model under 1 GB) reached the server unmerged: the adapter was never sampled
        (TRL's own merged walk does the same). Only that walk copies (a copy costs memory and time on the weights'
        device): TRL's metadata walk reads shapes, another process's walk only gathers, and colocate's engine loads
        each weight as it comes."""
        if not is_peft_model(self.model):
            yield from super()._iter_named_params()
            return
        copies = (self._walks is not None and self.mode == "server" and self.accelerator.is_main_process
                  and self._weight_metadata is not None)  # TRL walks for its metadata before it sets it
        with exact_unmerge(self.model):
            for name, tensor in super()._iter_named_params():
                yield name, tensor.detach().clone() if copies else tensor
