"""The trainer's vLLM backend: TRL builds :class:`~bapo_trl.generation.vllm_generation.BAPOVLLMGeneration` in place
of its own ``VLLMGeneration`` while ``BAPOTrainer`` is constructed (server and colocate mode;
:func:`~bapo_trl.generation.trl_patches.building_generation`, the one swap of a TRL name here); that backend defers to
TRL's own code wherever TRL's path works (:mod:`bapo_trl.generation.vllm_generation` says why each piece exists)."""

from __future__ import annotations

import functools

from ..core.metrics import WEIGHT_SYNC
from ..generation.trl_patches import building_generation
from ..generation.vllm_generation import BAPOVLLMGeneration
from ..rollout.settings import sampler_logprobs_use


class VLLMGenerationMixin:
    """Put before ``GRPOTrainer`` in the bases: with vLLM (server or colocate mode, any device), TRL builds
    :class:`~bapo_trl.generation.vllm_generation.BAPOVLLMGeneration`, which defers to TRL's own backend wherever
    TRL's path works; the pushes it measures join the training logs."""

    def __init__(self, model, reward_funcs, args=None, **kwargs):
        if args is not None and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) in (
                "server", "colocate"):
            use = sampler_logprobs_use(args) if args.vllm_mode == "server" else None  # colocate: TRL sets the mode
            backend = functools.partial(BAPOVLLMGeneration, sampler_logprobs_use=use,
                                        lora_sync=args.vllm_lora_sync,
                                        seed_round=lambda: self.state.global_step)
            with building_generation(backend):
                super().__init__(model, reward_funcs, args=args, **kwargs)
        else:
            super().__init__(model, reward_funcs, args=args, **kwargs)

    def _close_weight_pushes(self) -> None:
        """The end of a run (an error's too): the next generation (a later ``train()``, an evaluation) pushes again,
        on every process (the push is collective under ZeRO-3); the disk push's client unloads its last adapter from
        every server and removes the weight directories it wrote."""
        self._last_loaded_step = -1  # every path of TRL's vLLM (its NCCL push, colocate, the disk push): a later
        # train() restarts at step 0 with this run's weights, which the sampler does not hold (a backend of the
        # user's own keeps a record of its own, reset by TRLPort.close_backend)
        backend = getattr(self, "vllm_generation", None)
        if not isinstance(backend, BAPOVLLMGeneration) or not backend.uses_disk_sync:
            return
        if backend.disk_sync is not None:  # the main process's
            backend.disk_sync.close()

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the weight pushes since the last log: ``weight_sync/pushed_bytes`` (bytes written for the servers to
        load, per push) and ``weight_sync/seconds`` (write and load, per push), averaged over the pushes (the disk
        paths: server mode without CUDA or with the adapter push, and colocate without CUDA; TRL's NCCL push is not
        measured)."""
        backend = getattr(self, "vllm_generation", None)
        pushes = backend.take_pushes() if isinstance(backend, BAPOVLLMGeneration) else []
        if pushes and "loss" in logs:  # a training log (an evaluation's keeps its own keys)
            pushed_bytes, seconds = WEIGHT_SYNC  # the registry's names
            logs[pushed_bytes] = sum(b for b, _ in pushes) / len(pushes)
            logs[seconds] = sum(s for _, s in pushes) / len(pushes)
        elif pushes:
            backend._pushes[:0] = pushes  # kept for the next training log
        super().log(logs, *args, **kwargs)

