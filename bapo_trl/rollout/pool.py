"""Partial rollout: completions grow by at most a token budget per training step and carry over to later steps.

The paper's second off-policy scenario (its Fig. 12): long generations no longer stall a step. A completion that
hits the budget without finishing is kept, with the log-probs of the policy that produced each of its tokens and
that policy's version, and is continued in a later step by the then-current policy (continuation = prompt +
partial completion as the new prefix). A group is scored and trained only when all of its completions are
finished (EOS or ``max_completion_length``); its advantages are computed then. Each token's importance ratio
uses the log-prob of the policy that generated it, so segments from older policies are off-policy, as they are.

With vLLM the sampler's own log-probs are kept too, for TRL's sampler-mismatch correction.

This module holds the pool and its bookkeeping; the trainer supplies the two model calls (generate, score).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from transformers.utils import logging

logger = logging.get_logger(__name__)


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # behaviour log-prob of each token (the trainer's policy)
    sampling_logps: list[float] = field(default_factory=list)  # the sampler's own (vLLM); empty if it gives none
    versions: list[int] = field(default_factory=list)  # optimizer step of the policy that produced each token
    finished: bool = False
    resumes: int = 0  # steps this completion was carried over unfinished

    @property
    def segments(self) -> int:
        return len(set(self.versions)) if self.versions else 0


@dataclass
class Group:
    rows: list[dict]  # the dataset rows, one per completion (reward functions read their columns)
    completions: list[Completion]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


#: (prefixes, max_new_tokens) -> (new tokens per prefix, the sampler's log-prob of each new token or None)
GenerateFn = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]] | None]]
ScoreFn = Callable[[list[list[int]], list[list[int]]], list[list[float]]]


class PartialRolloutPool:
    """Groups in flight on one process.

    Args:
        budget: tokens a completion may grow per step.
        max_resumes: a completion carried over this many steps is generated to the end at its next round.
        max_completion_length: completions stop there (counted as finished, like TRL's truncation).
        eos_token_ids: tokens that end a completion.
    """

    def __init__(self, budget: int, max_resumes: int, max_completion_length: int, eos_token_ids: list[int]):
        self.budget, self.max_resumes, self.max_len = budget, max_resumes, max_completion_length
        self.eos = set(eos_token_ids)
        self.groups: list[Group] = []
        self.extra_prompts_used = 0  # position in the trainer's own prompt order for topping up the pool

    def add_groups(self, rows: list[dict], prompt_ids: list[list[int]], group_size: int) -> None:
        for i in range(0, len(rows), group_size):
            completions = [Completion(list(p)) for p in prompt_ids[i : i + group_size]]
            self.groups.append(Group(list(rows[i : i + group_size]), completions))

    def unfinished(self) -> list[Completion]:
        return [c for g in self.groups for c in g.completions if not c.finished]

    def num_ready(self) -> int:
        return sum(g.finished for g in self.groups)

    def grow(self, generate: GenerateFn, score: ScoreFn, step: int) -> int:
        """One budget round: every unfinished completion not yet due to finish grows by up to ``budget`` tokens,
        in ONE generate call (so every rank makes the same calls). Returns how many completions it touched."""
        todo = [c for c in self.unfinished() if c.resumes < self.max_resumes]
        self._extend(todo, generate, score, step, self.budget)
        return len(todo)

    def finish(self, generate: GenerateFn, score: ScoreFn, step: int, num_groups: int) -> int:
        """Generate to the end, in ONE call: completions carried ``max_resumes`` times, and every unfinished
        completion of the ``num_groups`` oldest unfinished groups (to fill a step's batch). Each of them ends
        finished: it stops by itself before its room runs out or fills it."""
        oldest = [g for g in self.groups if not g.finished][:num_groups]
        todo = {id(c): c for g in oldest for c in g.completions if not c.finished}
        todo.update({id(c): c for c in self.unfinished() if c.resumes >= self.max_resumes})
        self._extend(list(todo.values()), generate, score, step, self.max_len)
        return len(todo)

    def _extend(self, todo: list[Completion], generate: GenerateFn, score: ScoreFn, step: int, max_new: int):
        if not todo:
            return
        prefixes, caps = self.request(todo, max_new)
        new_tokens, sampled = generate(prefixes, max(caps))
        new_tokens = [t[:cap] for t, cap in zip(new_tokens, caps)]
        self.apply(todo, caps, new_tokens, score(prefixes, [self._cut_at_eos(t) for t in new_tokens]), sampled, step)

    def request(self, todo: list[Completion], max_new: int | list[int]) -> tuple[list[list[int]], list[int]]:
        """The prefixes (prompt + tokens so far) to continue, and each one's cap: ``max_new`` (one for all, or one
        each) bounded by the room left before ``max_completion_length``."""
        caps = [max_new] * len(todo) if isinstance(max_new, int) else list(max_new)
        caps = [min(cap, self.max_len - len(c.token_ids)) for c, cap in zip(todo, caps)]
        return [c.prompt_ids + c.token_ids for c in todo], caps

    def apply(self, todo: list[Completion], caps: list[int], new_tokens: list[list[int]],
              logps: list[list[float]], sampled: list[list[float]] | None, version: int) -> None:
        """Append one round's tokens (cut at EOS and at each cap), their behaviour log-probs, the sampler's and the
        policy version; a completion that got fewer tokens than its cap stopped by itself and is finished."""
        for i, (c, tokens) in enumerate(zip(todo, new_tokens)):
            tokens = self._cut_at_eos(tokens)[: caps[i]]
            c.token_ids += tokens
            c.logps += [float(x) for x in logps[i][: len(tokens)]]
            if sampled is not None:  # vLLM reports None for a token it could not score: kept as NaN, like TRL
                c.sampling_logps += [float("nan") if x is None else float(x) for x in sampled[i][: len(tokens)]]
            c.versions += [version] * len(tokens)
            # Fewer tokens than the cap: the generator stopped by itself (EOS, or a stop token of its own config)
            c.finished = len(tokens) < caps[i] or tokens[-1] in self.eos or len(c.token_ids) >= self.max_len

    def _cut_at_eos(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.eos:
                return list(tokens[: i + 1])
        return list(tokens)

    def __len__(self) -> int:
        return len(self.groups)

    def end_step(self) -> int:
        """Count a carry-over for every completion still unfinished; returns how many are carried."""
        carried = self.unfinished()
        for c in carried:
            c.resumes += 1
        return len(carried)

    def pop_ready(self, num_groups: int) -> list[Group]:
        """The oldest ``num_groups`` finished groups (fewer if not enough are ready)."""
        ready = [g for g in self.groups if g.finished][:num_groups]
        taken = {id(g) for g in ready}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return ready

    # -- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"groups": [{"rows": g.rows, "completions": [vars(c).copy() for c in g.completions]}
                           for g in self.groups],
                "extra_prompts_used": self.extra_prompts_used}

    def load_state_dict(self, state: dict) -> int:
        """Restore the pool; a completion at or past this run's ``max_completion_length`` (a resume with a shorter
        one) is cut there and finished, as TRL truncates, instead of trained longer than the cap (or, unfinished,
        asked for a negative number of tokens). Returns how many were cut."""
        self.groups = [Group(g["rows"], [Completion(**c) for c in g["completions"]]) for g in state["groups"]]
        self.extra_prompts_used = state.get("extra_prompts_used", 0)  # absent in checkpoints before it was saved
        cut = [c for g in self.groups for c in g.completions if len(c.token_ids) > self.max_len
               or (len(c.token_ids) == self.max_len and not c.finished)]
        for c in cut:
            c.token_ids, c.logps, c.versions = c.token_ids[: self.max_len], c.logps[: self.max_len], \
                c.versions[: self.max_len]
            c.sampling_logps, c.finished = c.sampling_logps[: self.max_len], True
        if cut:
            logger.warning(
                f"resume_from_checkpoint: {len(cut)} completion(s) of the partial-rollout pool reached this run's "
                f"max_completion_length ({self.max_len}), shorter than the checkpoint's run's: cut there and "
                "finished, as TRL truncates.")
        return len(cut)
