"""The trainer's vLLM backend: TRL builds :class:`~bapo_trl.generation.cpu_server.CPUServerVLLMGeneration` in place of
its own ``VLLMGeneration`` while ``BAPOTrainer`` is constructed (server mode, and colocate mode without CUDA); that
backend defers to TRL's own code wherever TRL's path works (:mod:`bapo_trl.generation.cpu_server` says why each
piece exists)."""

from __future__ import annotations

import functools

import trl.trainer.grpo_trainer as _trl_grpo_trainer

from ..generation.cpu_server import CPUServerVLLMGeneration, patched
from ..rollout.settings import sampler_logprobs_use


class CPUServerSyncMixin:
    """Put before ``GRPOTrainer`` in the bases: with vLLM (server, or colocate without CUDA), TRL builds
    :class:`CPUServerVLLMGeneration`, which defers to TRL's own backend wherever TRL's path works."""

    def __init__(self, model, reward_funcs, args=None, **kwargs):
        if args is not None and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) in (
                "server", "colocate"):
            use = sampler_logprobs_use(args) if args.vllm_mode == "server" else None  # colocate: TRL sets the mode
            backend = functools.partial(CPUServerVLLMGeneration, sampler_logprobs_use=use)
            with patched(_trl_grpo_trainer, "VLLMGeneration", backend):
                super().__init__(model, reward_funcs, args=args, **kwargs)
        else:
            super().__init__(model, reward_funcs, args=args, **kwargs)
