"""Completions generated outside TRL's generate call, scored and batched by TRL itself.

Partial rollout and async generation both produce finished completions on their own schedule. TRL should still
compute rewards, advantages, its metrics and its vLLM importance-sampling correction: this module hands the
completions to ``GRPOTrainer._generate_and_score_completions`` through TRL's ``rollout_func`` hook, and answers TRL's
old-log-prob forward (which would score the tokens with the CURRENT policy and hide their staleness) with the
stored behaviour log-probs of the policy that produced each token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..trainer import BAPOTrainer


def right_pad(rows: list[list], width: int, fill, dtype: torch.dtype, device) -> torch.Tensor:
    """Per-completion lists as one ``(len(rows), width)`` tensor, each row cut or filled with ``fill`` to ``width``."""
    return torch.tensor([(list(r) + [fill] * width)[:width] for r in rows], dtype=dtype, device=device)


@dataclass
class ReadyCompletions:
    """What a rollout source hands to TRL: one entry per completion, in the order of the dataset rows."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logps: list[list[float]]  # the sampler's own log-prob of each token (TRL's IS correction compares them)
    behaviour_logps: list[list[float]]  # the log-prob of the policy that produced each token (BAPO's ratio)


class CompletionServer:
    """One per trainer. :meth:`score` runs TRL's scoring on ready completions; the trainer's log-prob hook asks
    :meth:`take_stored_logps` first, so TRL's old-log-prob forward gets the stored behaviour log-probs."""

    def __init__(self, trainer: BAPOTrainer):
        self.trainer = trainer
        self.ready: ReadyCompletions | None = None  # being scored, served by `rollout`
        self.awaiting_old_logps: ReadyCompletions | None = None  # armed while TRL computes its old-logp forward

    def trl_scores_old_logps(self) -> bool:
        """TRL's own condition for computing ``old_per_token_logps`` with a forward in its scoring."""
        trainer, args = self.trainer, self.trainer.args
        generate_every = args.steps_per_generation * trainer.num_iterations
        return args.gradient_accumulation_steps % generate_every != 0 or (
            trainer.use_vllm and trainer.vllm_importance_sampling_correction)

    def score(self, score_fn, rows: list[dict], ready: ReadyCompletions) -> dict[str, Any]:
        """TRL's ``_generate_and_score_completions`` (``score_fn``) on ``rows`` with ``ready`` as the generation;
        ``old_per_token_logps`` of the result are the behaviour log-probs."""
        trainer = self.trainer
        self.ready = ready
        self.awaiting_old_logps = ready if self.trl_scores_old_logps() else None
        saved_rollout_func, trainer.rollout_func = trainer.rollout_func, self.rollout
        try:
            output = score_fn(rows)
            if self.awaiting_old_logps is not None:
                raise RuntimeError("TRL did not compute old_per_token_logps where bapo_trl expected it to: the "
                                   "installed TRL's _generate_and_score_completions changed; please report it.")
        finally:
            trainer.rollout_func, self.ready, self.awaiting_old_logps = saved_rollout_func, None, None
        width, device = output["completion_ids"].size(1), output["completion_ids"].device
        output["old_per_token_logps"] = right_pad(ready.behaviour_logps, width, 0.0, torch.float32, device)
        return output

    def rollout(self, prompts, trainer):
        """TRL's ``rollout_func`` contract, serving the ready completions (no generation)."""
        ready = self.ready
        return {"prompt_ids": ready.prompt_ids, "completion_ids": ready.completion_ids,
                "logprobs": ready.sampling_logps}

    def take_stored_logps(self, width: int, device) -> torch.Tensor | None:
        """The stored behaviour log-probs for TRL's old-logp forward, once (None when not armed)."""
        ready, self.awaiting_old_logps = self.awaiting_old_logps, None
        return None if ready is None else right_pad(ready.behaviour_logps, width, 0.0, torch.float32, device)
