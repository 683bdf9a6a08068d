"""Partial rollout as a rollout source: completions grow by a token budget per round (one round per generation batch),
through TRL's own generation, or the run's generation backend where it is the user's own.

Each step the new prompts join the pool (topped up from the train set to two steps' worth of groups, so completions
can stay in flight), every unfinished completion grows by one budget, the oldest groups are finished if fewer than
a batch are done, and TRL scores and batches the finished groups (the port's ``score_completions``). Each
token keeps the log-prob and version of the policy that produced it. Every rank makes the same generate calls and
forwards (ZeRO-3 gathers the weights collectively).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.metrics import partial_sums, partial_values
from .contract import (
    NothingInBackground,
    ReadyCompletions,
    ScoreFn,
    TrainerPort,
    continuation_logps,
    image_column,
    is_iterable_dataset,
    log_sampler_gap,
    stamp_token_versions,
)
from .pool import PartialRolloutPool


def source_argument_errors(args, kwargs: dict) -> list[str]:
    """GRPOTrainer arguments partial rollout cannot serve (checked before anything is loaded)."""
    problems = []
    if kwargs.get("rollout_func") is not None:
        problems.append("partial rollout (`partial_rollout_budget`) serves finished completions through TRL's "
                        "`rollout_func` hook and would replace yours: pass either `rollout_func` or "
                        "`partial_rollout_budget`, not both.")
    if kwargs.get("tools") or kwargs.get("environment_factory"):
        problems.append("partial rollout (`partial_rollout_budget`) grows single-turn completions and cannot continue "
                        "tool-calling or environment rollouts: switch one of them off.")
    dataset = kwargs.get("train_dataset")
    column = image_column(dataset)
    if column is not None:
        problems.append("partial rollout (`partial_rollout_budget`) continues completions from their tokens, "
                        f"without images: it cannot serve the train_dataset's `{column}` column. Switch partial "
                        "rollout off for a vision-language dataset.")
    if is_iterable_dataset(dataset):
        problems.append("partial rollout (`partial_rollout_budget`) tops up its pool by random access to the "
                        f"train_dataset, which a {type(dataset).__name__} does not allow: use a map-style Dataset.")
    return problems


class PartialRollout(NothingInBackground):
    """The partial-rollout source of one trainer process; ``pool`` is its checkpointed state."""

    state_name = "partial_rollout"
    argument_errors = staticmethod(source_argument_errors)

    def __init__(self, port: TrainerPort):
        settings = port.settings
        self.port = port
        self.pool = PartialRolloutPool(settings.partial_rollout_budget, settings.partial_rollout_max_resumes,
                                       settings.max_completion_length, port.stop_token_ids())
        self._extra_prompt_order: list[int] | None = None
        self.behaviour_from_sampler = port.samples_through_backend  # else each segment's policy, scored here

    def state_dict(self) -> dict:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict(state)

    def next_batch(self, inputs: list[dict], score: ScoreFn) -> dict[str, Any]:
        """One partial-rollout step (see module doc)."""
        port, pool, step = self.port, self.pool, self.port.global_step
        groups_needed = len(inputs) // port.num_generations
        self._add_to_pool(inputs)
        while len(pool) < 2 * groups_needed:  # in flight: this step's batch and the next one
            self._add_to_pool(self._extra_prompts(groups_needed))
        if pool.grow(port.continue_completions, self.segment_logps, step) == 0:
            self._join_empty_generation_round()
        short = max(0, groups_needed - pool.num_ready())
        if pool.finish(port.continue_completions, self.segment_logps, step, short) == 0:
            self._join_empty_generation_round()
        carried = pool.end_step()
        ready = pool.pop_ready(groups_needed)
        # Every rank must bring a full batch to TRL's gathers; checked on all ranks at once, so none waits forever.
        fewest = -port.max_over_processes(torch.tensor(-float(len(ready)), device=port.device))
        if fewest < groups_needed:
            raise RuntimeError(f"partial rollout: a process has {int(fewest)} finished groups for a batch of "
                               f"{groups_needed} (this one: {len(ready)}); the finishing round left some unfinished.")
        completions = [c for g in ready for c in g.completions]
        # The sampler's log-probs (vLLM's, for TRL's importance-sampling correction), else the policy's. The
        # behaviour log-probs: with TRL's generation each segment's policy's, so TRL's correction sees only sampler
        # mismatch; with a backend of the user's own (no TRL correction) the sampler's, so BAPO's ratio sees it.
        sampling = [c.sampling_logps if len(c.sampling_logps) == len(c.token_ids) else c.logps for c in completions]
        behaviour = [c.logps for c in completions]
        if port.samples_through_backend:
            log_sampler_gap(port, behaviour, sampling)
            behaviour = sampling
        ready_completions = ReadyCompletions(
            prompt_ids=[c.prompt_ids for c in completions], completion_ids=[c.token_ids for c in completions],
            sampling_logps=sampling, behaviour_logps=behaviour)
        output = port.score_completions(score, [row for g in ready for row in g.rows], ready_completions)
        output = stamp_token_versions(output, [c.versions for c in completions], step)
        sums, oldest = partial_sums(completions, carried, step)  # this process's, reduced over all of them here
        sums = port.sum_over_processes(torch.tensor(sums, dtype=torch.float64, device=port.device)).tolist()
        oldest = float(port.max_over_processes(torch.tensor(oldest, dtype=torch.float64, device=port.device)))
        port.log_metrics(partial_values(sums, oldest))
        return output

    def segment_logps(self, prefixes: list[list[int]], segments: list[list[int]]) -> list[list[float]]:
        """Log-probs of the newly generated tokens under the current policy, as the trainer computes them."""
        return continuation_logps(self.port, prefixes, segments)

    def _join_empty_generation_round(self) -> None:
        """A rank with nothing to grow still makes the generate call and the scoring forward: under ZeRO-3 both
        gather the weights collectively, so every rank must make the same calls."""
        any_prompt = self.pool.groups[0].completions[0].prompt_ids
        self.port.continue_completions([any_prompt], 1)
        self.segment_logps([any_prompt], [[]])  # nothing to score: makes the stand-in forward

    def _add_to_pool(self, rows: list[dict]) -> None:
        self.pool.add_groups(rows, self.port.tokenize_prompts([x["prompt"] for x in rows]), self.port.num_generations)

    def _extra_prompts(self, num_groups: int) -> list[dict]:
        """Prompts beyond the dataloader's, to fill the pool: the train set in an order of this rank's own (seeded,
        rebuilt identically on resume); the position in it is pool state, saved with the checkpoint."""
        port = self.port
        if self._extra_prompt_order is None:
            gen = torch.Generator().manual_seed(port.settings.seed + 104729 * (1 + port.process_index))
            self._extra_prompt_order = torch.randperm(len(port.train_dataset), generator=gen).tolist()
        pool, order, rows = self.pool, self._extra_prompt_order, []
        for _ in range(num_groups):
            index = order[pool.extra_prompts_used % len(order)]
            pool.extra_prompts_used += 1
            rows += [dict(port.train_dataset[index]) for _ in range(port.num_generations)]
        return rows
