"""TRL's own generation as a rollout source (the default): every completion is sampled by the current policy.

With a generation backend of the user's own (``generation_backend``, :mod:`bapo_trl.generation.contract`) the
backend samples the completions, brought to the current weights first, and TRL scores them through its
``rollout_func`` hook; their behaviour log-probs are the backend's own (the sampler is the behaviour policy: another
kernel, precision or a lagging push shows in BAPO's ratio, as TRL's importance-sampling correction shows it for its
vLLM, which it applies to no other sampler), and the gap between them and the trainer's forward is logged as TRL logs
it for vLLM (``sampling/sampling_logp_difference/*``).
"""

from __future__ import annotations

from typing import Any

from .contract import (
    NothingInBackground,
    ReadyCompletions,
    ScoreFn,
    TrainerPort,
    continuation_logps,
    image_column,
    log_sampler_gap,
    stamp_policy_version,
)


def source_argument_errors(args, kwargs: dict) -> list[str]:
    """GRPOTrainer arguments the default source cannot serve when a backend of the user's own generates (checked
    before anything is loaded); none with TRL's own generation."""
    from ..generation.contract import samples_for_every_source

    if not samples_for_every_source(args.generation_backend):
        return []
    name, problems = f"`generation_backend={args.generation_backend!r}`", []
    if kwargs.get("rollout_func") is not None:
        problems.append(f"{name} samples every completion and hands them to TRL through its `rollout_func` hook, "
                        "which would replace yours: pass either `rollout_func` or a generation backend, not both.")
    if kwargs.get("tools") or kwargs.get("environment_factory"):
        problems.append(f"{name} samples single-turn completions from token ids and cannot run tool-calling or "
                        "environment rollouts: use TRL's generation (generation_backend='vllm') for them.")
    column = image_column(kwargs.get("train_dataset"))
    if column is not None:
        problems.append(f"{name} samples from the prompts' token ids, without images: it cannot serve the "
                        f"train_dataset's `{column}` column.")
    return problems


class TRLGeneration(NothingInBackground):
    """``GRPOTrainer``'s generation and scoring, unchanged (or the user's backend's sampling, see the module doc);
    the batch is stamped with the current policy version."""

    argument_errors = staticmethod(source_argument_errors)

    def __init__(self, port: TrainerPort):
        self.port = port
        self.behaviour_from_sampler = port.samples_through_backend  # else TRL's own old-logp forward

    def next_batch(self, inputs: list[dict], score: ScoreFn) -> dict[str, Any]:
        port = self.port
        if not port.samples_through_backend:
            return stamp_policy_version(score(inputs), port.global_step)
        prompt_ids, sampled = port.sample_rows([row["prompt"] for row in inputs])
        completion_ids = [list(ids) for ids in sampled["completion_ids"]]
        sampler = [list(lp) for lp in sampled["logps"]]
        log_sampler_gap(port, continuation_logps(port, prompt_ids, completion_ids), sampler)
        ready = ReadyCompletions(prompt_ids, completion_ids, sampling_logps=sampler, behaviour_logps=sampler)
        return stamp_policy_version(port.score_completions(score, inputs, ready), port.global_step)
