"""The toy task: reverse a 3-digit string. Prompt ``"123>"``, right answer ``"321"`` then EOS (reward 1).

A variable-length variant (e.g. ``digits=(2, 5)``: 2 to 5 digits, the length drawn uniformly, then the digits) is
there for the studies where completions of different lengths matter; the default, ``digits=(3, 3)``, is the
published task and draws exactly the prompts it always drew.
"""

from __future__ import annotations

import random

EOS = "<eos>"
ALL_PROMPTS = [f"{i:03d}>" for i in range(1000)]
#: The published task's digit range: every prompt has 3 digits.
DIGITS = (3, 3)
_POOLS: dict = {}


def reverse_target(prompt: str) -> str:
    return prompt.rstrip(">")[::-1]


def _check(split: str, digits=DIGITS) -> tuple[int, int]:
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}.")
    low, high = (int(d) for d in digits)
    if not 1 <= low <= high:
        raise ValueError(f"`digits` must be (low, high) with 1 <= low <= high, got {digits!r}.")
    return low, high


def split_prompts(split: str = "train") -> list[str]:
    """Disjoint pools: every fifth number is held out for evaluation."""
    _check(split)
    return [p for i, p in enumerate(ALL_PROMPTS) if (i % 5 == 0) == (split == "test")]


def is_test_prompt(prompt: str) -> bool:
    """Held out in the variable-length variant: the digits sum to a multiple of 5 (a fifth of the strings of each
    length, with every digit at every position in both splits). The 3-digit task keeps its published split,
    :func:`split_prompts` (every fifth number: the held-out answers, and only they, start with 0 or 5)."""
    return sum(int(d) for d in prompt.rstrip(">")) % 5 == 0


def sample_prompt(rng: random.Random, split: str = "train", digits=DIGITS) -> str:
    """One prompt of ``split`` drawn with ``rng``. The default 3 digits: uniformly from :func:`split_prompts`'s pool
    (one ``rng.choice``, as the task always drew). Other ranges: the length uniformly in ``digits`` (inclusive),
    then each digit uniformly but the last, drawn uniformly from those that put the string in ``split``
    (:func:`is_test_prompt`): uniform over the split's strings of that length, train and test disjoint."""
    low, high = _check(split, digits)
    if (low, high) == DIGITS:
        if split not in _POOLS:
            _POOLS[split] = split_prompts(split)
        return rng.choice(_POOLS[split])
    head = "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high) - 1))
    total = sum(int(d) for d in head)
    last = [d for d in "0123456789" if ((total + int(d)) % 5 == 0) == (split == "test")]
    return head + rng.choice(last) + ">"


def make_reverse_dataset(num_prompts: int, seed: int = 0, split: str = "train", chat: bool = False,
                         digits=DIGITS):
    """A ``datasets.Dataset`` with ``prompt`` (text, or chat messages when ``chat``) and ``answer`` columns;
    ``digits``: the (shortest, longest) number of digits of a prompt (default 3 and 3, the published task)."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [sample_prompt(rng, split, digits) for _ in range(num_prompts)]
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
    Answers of any length (the variable-length variant) are scored alike.
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
