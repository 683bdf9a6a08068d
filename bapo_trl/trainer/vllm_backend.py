"""The trainer's vLLM backend: TRL builds :class:`~bapo_trl.generation.vllm_generation.CPUServerVLLMGeneration` in
place of its own ``VLLMGeneration`` while ``BAPOTrainer`` is constructed (server mode, and colocate mode without
CUDA); that backend defers to TRL's own code wherever TRL's path works (:mod:`bapo_trl.generation.vllm_generation`
says why each piece exists)."""

from __future__ import annotations

import functools

import trl.trainer.grpo_trainer as _trl_grpo_trainer

from ..generation.http_client import patched
from ..generation.vllm_generation import CPUServerVLLMGeneration
from ..rollout.settings import sampler_logprobs_use


class CPUServerSyncMixin:
    """Put before ``GRPOTrainer`` in the bases: with vLLM (server, or colocate without CUDA), TRL builds
    :class:`CPUServerVLLMGeneration`, which defers to TRL's own backend wherever TRL's path works."""

    def __init__(self, model, reward_funcs, args=None, **kwargs):
        if args is not None and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) in (
                "server", "colocate"):
            use = sampler_logprobs_use(args) if args.vllm_mode == "server" else None  # colocate: TRL sets the mode
            backend = functools.partial(CPUServerVLLMGeneration, sampler_logprobs_use=use,
                                        lora_sync=args.vllm_lora_sync,
                                        seed_round=lambda: self.state.global_step)
            with patched(_trl_grpo_trainer, "VLLMGeneration", backend):
                super().__init__(model, reward_funcs, args=args, **kwargs)
        else:
            super().__init__(model, reward_funcs, args=args, **kwargs)

    def _close_weight_pushes(self) -> None:
        """The end of a run (an error's too): the disk push's client unloads its last adapter from every server and
        removes the weight directories it wrote; the next generation (a later ``train()``, an evaluation) pushes
        again, on every process (the push is collective under ZeRO-3)."""
        backend = getattr(self, "vllm_generation", None)
        if not isinstance(backend, CPUServerVLLMGeneration) or not backend.uses_disk_sync:
            return
        if backend.disk_sync is not None:  # the main process's
            backend.disk_sync.close()
        self._last_loaded_step = -1

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the weight pushes since the last log: ``weight_sync/pushed_bytes`` (bytes written for the servers to
        load, per push) and ``weight_sync/seconds`` (write and load, per push), averaged over the pushes (the disk
        paths: server mode without CUDA or with the adapter push, and colocate without CUDA; TRL's NCCL push is not
        measured)."""
        backend = getattr(self, "vllm_generation", None)
        pushes = backend.take_pushes() if isinstance(backend, CPUServerVLLMGeneration) else []
        if pushes and "loss" in logs:  # a training log (an evaluation's keeps its own keys)
            logs["weight_sync/pushed_bytes"] = sum(b for b, _ in pushes) / len(pushes)
            logs["weight_sync/seconds"] = sum(s for _, s in pushes) / len(pushes)
        elif pushes:
            backend._pushes[:0] = pushes  # kept for the next training log
        super().log(logs, *args, **kwargs)
