"""The toy task: reverse a 3-digit string. Prompt ``"123>"``, right answer ``"321"`` then EOS (reward 1)."""

from __future__ import annotations

import random

EOS = "<eos>"
ALL_PROMPTS = [f"{i:03d}>" for i in range(1000)]


def reverse_target(prompt: str) -> str:
    return prompt.rstrip(">")[::-1]


def split_prompts(split: str = "train") -> list[str]:
    """Disjoint pools: every fifth number is held out for evaluation."""
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}.")
    return [p for i, p in enumerate(ALL_PROMPTS) if (i % 5 == 0) == (split == "test")]


def make_reverse_dataset(num_prompts: int, seed: int = 0, split: str = "train", chat: bool = False):
    """A ``datasets.Dataset`` with ``prompt`` (text, or chat messages when ``chat``) and ``answer`` columns."""
    from datasets import Dataset

    rng = random.Random(seed)
    pool = split_prompts(split)
    prompts = [rng.choice(pool) for _ in range(num_prompts)]
    answers = [reverse_target(p) for p in prompts]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _text(completion) -> str:
    if isinstance(completion, list):  # chat completion: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return completion


def reverse_reward(completions, answer, completion_ids=None, **kwargs) -> list[float]:
    """1.0 for exactly the reversed digits followed by EOS, else 0.0 (TRL reward-function signature).

    With ``completion_ids`` (TRL passes them) the EOS is checked on the ids: the answer must be the whole
    completion and the last id must be the toy tokenizer's EOS. Without ids, an exact string match counts.
    """
    from .tokenizer import SPECIAL

    eos_id = SPECIAL.index(EOS)
    scores = []
    for i, (completion, expected) in enumerate(zip(completions, answer)):
        text = _text(completion)
        ok = text.strip() == expected if completion_ids is None else text == expected
        if ok and completion_ids is not None:
            ids = list(completion_ids[i])
            ok = len(ids) == len(expected) + 1 and ids[-1] == eos_id
        scores.append(1.0 if ok else 0.0)
    return scores
