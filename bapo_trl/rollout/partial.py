"""Partial rollout as a rollout source: completions grow by a token budget per step, through TRL's own generation.

Each step the new prompts join the pool (topped up from the train set to two steps' worth of groups, so completions
can stay in flight), every unfinished completion grows by one budget, the oldest groups are finished if fewer than
a batch are done, and TRL scores and batches the finished groups through its own ``rollout_func`` hook. Each token
keeps the log-prob and version of the policy that produced it. Every rank makes the same generate calls and
forwards (ZeRO-3 gathers the weights collectively).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..metrics import partial_sums, partial_values
from .pool import PartialRolloutPool
from .serving import ReadyCompletions, right_pad

if TYPE_CHECKING:
    from ..trainer import BAPOTrainer


def stop_token_ids(trainer: BAPOTrainer) -> list[int]:
    """Every token id that ends a generation: TRL's EOS ids plus generation_kwargs' ``stop_token_ids`` (vLLM) and
    ``eos_token_id`` (transformers); the pool needs them to tell a stopped completion from a capped one."""
    ids = list(trainer.eos_token_ids)
    kwargs = trainer.args.generation_kwargs or {}
    for key in ("stop_token_ids", "eos_token_id"):
        extra = kwargs.get(key)
        ids += [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return sorted(set(ids))


class PartialRollout:
    """The partial-rollout source of one trainer process; ``pool`` is its checkpointed state."""

    def __init__(self, trainer: BAPOTrainer):
        args = trainer.args
        self.trainer = trainer
        self.pool = PartialRolloutPool(args.partial_rollout_budget, args.partial_rollout_max_resumes,
                                       args.max_completion_length, stop_token_ids(trainer))
        self.ready: list | None = None  # the finished completions TRL is scoring

    def state_dict(self) -> dict:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict(state)

    def next_batch(self, inputs: list[dict], score) -> dict[str, Any]:
        """One partial-rollout step (see module doc). ``score`` is TRL's ``_generate_and_score_completions``,
        called on the finished groups' rows through the trainer's :class:`~.serving.CompletionServer`."""
        trainer, pool, step = self.trainer, self.pool, self.trainer.state.global_step
        groups_needed = len(inputs) // trainer.num_generations
        self._add_to_pool(inputs)
        while len(pool) < 2 * groups_needed:  # in flight: this step's batch and the next one
            self._add_to_pool(self._extra_prompts(groups_needed))
        if pool.grow(self.continue_completions, self.segment_logps, step) == 0:
            self._join_empty_generation_round()
        short = max(0, groups_needed - pool.num_ready())
        if pool.finish(self.continue_completions, self.segment_logps, step, short) == 0:
            self._join_empty_generation_round()
        carried = pool.end_step()
        ready = pool.pop_ready(groups_needed)
        # Every rank must bring a full batch to TRL's gathers; checked on all ranks at once, so none waits forever.
        fewest = -trainer._max_over_processes(torch.tensor(-float(len(ready)), device=trainer.accelerator.device))
        if fewest < groups_needed:
            raise RuntimeError(f"partial rollout: a process has {int(fewest)} finished groups for a batch of "
                               f"{groups_needed} (this one: {len(ready)}); the finishing round left some unfinished.")
        completions = [c for g in ready for c in g.completions]
        self.ready = completions
        # The sampler's log-probs (vLLM's, for TRL's importance-sampling correction), else the policy's; the
        # behaviour log-probs are each segment's policy's, so TRL's correction sees only sampler mismatch.
        ready_completions = ReadyCompletions(
            prompt_ids=[c.prompt_ids for c in completions], completion_ids=[c.token_ids for c in completions],
            sampling_logps=[c.sampling_logps if len(c.sampling_logps) == len(c.token_ids) else c.logps
                            for c in completions],
            behaviour_logps=[c.logps for c in completions])
        try:
            output = trainer.completion_server.score(score, [row for g in ready for row in g.rows], ready_completions)
        finally:
            self.ready = None
        width, device = output["completion_ids"].size(1), output["completion_ids"].device
        versions = right_pad([c.versions for c in completions], width, step, torch.long, device)
        output["token_policy_version"] = versions
        output["policy_version"] = versions.min(dim=1).values
        self._log(completions, carried, step, device)
        return output

    def continue_completions(self, prefixes: list[list[int]], max_new_tokens: int):
        """TRL's own single-turn generation (transformers or vLLM), with the prefix = prompt + partial completion,
        capped at ``max_new_tokens``. Returns the new tokens and the sampler's log-probs (vLLM) or None."""
        trainer = self.trainer
        if not trainer.use_vllm:
            config = trainer.generation_config
            saved = config.max_new_tokens
            config.max_new_tokens = max_new_tokens
            try:
                return trainer._generate_single_turn(prefixes, None, {}, 1)[0], None
            finally:
                config.max_new_tokens = saved
        count, cap, backend = len(prefixes), max_new_tokens, trainer.vllm_generation
        if trainer.accelerator.num_processes > 1 and (backend.mode == "server" or backend.tensor_parallel_size > 1):
            # One vLLM call serves several ranks: the request's max_tokens is rank 0's, and TRL hands each rank an
            # equal slice of the answer. Agree on the largest cap (each rank cuts its answer back to its own) and
            # pad every rank's prefixes to the largest share.
            wanted = torch.tensor([[count, cap]], device=trainer.accelerator.device)
            largest_share, max_new_tokens = trainer.accelerator.gather(wanted).max(dim=0).values.tolist()
            prefixes = prefixes + [prefixes[0]] * (largest_share - count)
        saved = backend.max_completion_length  # vLLM's max_tokens for this call
        backend.max_completion_length = max_new_tokens
        try:
            completion_ids, logprobs = trainer._generate_single_turn(prefixes, None, {}, 1)
        finally:
            backend.max_completion_length = saved
        completion_ids = [list(ids[:cap]) for ids in completion_ids[:count]]
        return completion_ids, (None if logprobs is None else [list(lp[:cap]) for lp in logprobs[:count]])

    def segment_logps(self, prefixes: list[list[int]], segments: list[list[int]]) -> list[list[float]]:
        """Log-probs of the newly generated tokens under the current policy, as the trainer computes them."""
        if not any(segments):  # still one forward (on a stand-in token): ranks must make the same forwards
            empty = [[] for _ in segments]
            prefixes, segments = [prefixes[0][:-1] or prefixes[0]], [prefixes[0][-1:]]
            self.segment_logps(prefixes, segments)
            return empty
        trainer = self.trainer
        width = max(len(s) for s in segments)
        total = max(len(p) for p in prefixes) + width
        # prefixes left-padded, segments right-padded: the segment tokens then sit in the last `width` columns
        ids = torch.full((len(prefixes), total), trainer._tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prefixes), total), dtype=torch.long)
        start = total - width
        for i, (p, s) in enumerate(zip(prefixes, segments)):
            ids[i, start - len(p) : start + len(s)] = torch.tensor(p + s)
            attention[i, start - len(p) : start + len(s)] = 1
        device = trainer.accelerator.device
        # ONE forward however many prefixes this rank has (ranks differ; ZeRO-3 needs equal forward counts)
        logps = trainer._policy_logps(ids.to(device), attention.to(device), width, batch_size=len(prefixes))
        return [logps[i, : len(s)].tolist() for i, s in enumerate(segments)]

    def _join_empty_generation_round(self) -> None:
        """A rank with nothing to grow still makes the generate call and the scoring forward: under ZeRO-3 both
        gather the weights collectively, so every rank must make the same calls."""
        any_prompt = self.pool.groups[0].completions[0].prompt_ids
        self.continue_completions([any_prompt], 1)
        self.segment_logps([any_prompt], [[]])  # nothing to score: makes the stand-in forward

    def _add_to_pool(self, rows: list[dict]) -> None:
        prompt_ids, _, _ = self.trainer._tokenize_prompts([x["prompt"] for x in rows])
        self.pool.add_groups(rows, prompt_ids, self.trainer.num_generations)

    def _extra_prompts(self, num_groups: int) -> list[dict]:
        """Prompts beyond the dataloader's, to fill the pool: the train set in an order of this rank's own (seeded,
        rebuilt identically on resume); the position in it is pool state, saved with the checkpoint."""
        trainer = self.trainer
        if not hasattr(self, "_extra_prompt_order"):
            gen = torch.Generator().manual_seed(trainer.args.seed + 104729 * (1 + trainer.accelerator.process_index))
            self._extra_prompt_order = torch.randperm(len(trainer.train_dataset), generator=gen).tolist()
        pool, order, rows = self.pool, self._extra_prompt_order, []
        for _ in range(num_groups):
            index = order[pool.extra_prompts_used % len(order)]
            pool.extra_prompts_used += 1
            rows += [dict(trainer.train_dataset[index]) for _ in range(trainer.num_generations)]
        return rows

    def _log(self, completions, carried: int, step: int, device) -> None:
        trainer = self.trainer
        sums, oldest = partial_sums(completions, carried, step)  # this process's; reduced over all of them here
        sums = trainer._sum_over_processes(torch.tensor(sums, dtype=torch.float64, device=device)).tolist()
        oldest = float(trainer._max_over_processes(torch.tensor(oldest, dtype=torch.float64, device=device)))
        for name, value in partial_values(sums, oldest).items():
            trainer._metrics["train"][name].append(value)
