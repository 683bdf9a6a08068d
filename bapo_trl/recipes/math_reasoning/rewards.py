r"""Math rewards for the reasoning recipe: boxed-answer correctness, a reasoning-format check, DAPO's length penalty.

What TRL already has is reused: correctness is decided by :func:`trl.rewards.accuracy_reward` (math-verify), the
length penalty is :func:`trl.rewards.get_soft_overlong_punishment`. What is added is only what the math datasets of
:mod:`bapo_trl.recipes.math_reasoning.data` need and TRL does not do:

* the reference is the ``answer`` column (TRL reads ``solution``), written as a plain number, a fraction or LaTeX,
  with or without ``\boxed{}`` or ``$...$``. A bare LaTeX reference such as ``3\sqrt{2}`` or ``2^{10}`` is parsed
  wrongly by math-verify unless it is delimited (measured: ``3`` and ``2``), so it is wrapped in ``\boxed{}`` first;
* the model's answer is the LAST ``\boxed{}`` after the reasoning (``</think>``): reasoning models box intermediate
  results, and an unfinished ``<think>`` has no answer yet. No box means no answer (reward 0), as the prompt asks
  for one;
* ``\frac12``-style shorthand, which math-verify 0.9 does not read, is expanded to ``\frac{1}{2}``;
* a reasoning-format reward that also fits chat templates which open ``<think>`` in the prompt (DeepSeek-R1
  distills do, so their completions start inside the reasoning and TRL's ``think_format_reward`` always gives 0).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Callable

#: Named soft overlong penalties (DAPO, Eq. 13): name -> (L_max, L_cache). L_max must equal the recipe's
#: ``max_completion_length``; completions longer than ``L_max - L_cache`` lose up to 1. DAPO used a 4k cache on a
#: 20k budget; these keep the cache at 1/8 to 1/4 of the budget. Another pair: ``get_soft_overlong_punishment``.
SOFT_OVERLONG = {
    "soft_overlong_8k": (8192, 1024),  # recipes/bapo_r1_distill_qwen_7b.yaml
    "soft_overlong_2k": (2048, 512),  # recipes/lora_qwen_1p5b_single_gpu.yaml
    "soft_overlong_tiny": (8, 6),  # recipes/cpu_smoke.yaml: the tiny model answers in 1-8 tokens, so it varies
}

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SHORT_FRAC = re.compile(r"\\([dt]?frac)\s*(\d)\s*(\d)")
_BOXED = ("\\boxed", "\\fbox")
_MATH_MODE = ("$", "\\(", "\\[")  # at the start only: "\$34" is an escaped dollar, not math mode


def completion_text(completion) -> str:
    """The text of a completion: a plain string, or the contents of chat messages."""
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return completion or ""


def final_part(text: str) -> str | None:
    """The part after the reasoning: after the last ``</think>``; ``None`` if a ``<think>`` was never closed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; ``None`` if there is none."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None  # only unclosed boxes (a truncated completion)


def normalize_latex(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}`` (single-digit shorthand, which math-verify does not parse)."""
    return _SHORT_FRAC.sub(r"\\\1{\2}{\3}", text)


def reference(answer) -> str:
    r"""A reference answer as math-verify reads it reliably: delimited LaTeX (wrapped in ``\boxed{}`` if bare)."""
    text = normalize_latex(str(answer).strip())
    delimited = text.startswith(_MATH_MODE) or any(box in text for box in _BOXED)
    return text if delimited else f"\\boxed{{{text}}}"


def boxed_accuracy(completions, answer, **kwargs) -> list[float | None]:
    r"""1.0 if the last ``\boxed{}`` after the reasoning equals ``answer`` under math-verify, else 0.0.

    ``None`` (TRL: "does not apply") when the reference itself cannot be parsed, so a broken row is skipped
    instead of teaching the model that every answer is wrong.
    """
    from trl.rewards import accuracy_reward

    boxes = []
    for completion in completions:
        final = final_part(completion_text(completion))
        box = last_boxed(final) if final is not None else None
        boxes.append([{"role": "assistant", "content": f"\\boxed{{{normalize_latex(box)}}}" if box else ""}])
    return accuracy_reward(boxes, [reference(a) for a in answer])


def boxed_format_reward(completions, **kwargs) -> list[float]:
    r"""1.0 for a finished reasoning followed by a boxed answer, else 0.0.

    Finished: either no think tags at all, or exactly one ``</think>`` with at most one ``<think>`` before it (the
    opening tag may sit in the prompt, as with DeepSeek-R1 distills). The boxed answer must come after it.
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        opens, closes = text.count("<think>"), text.count("</think>")
        if opens > 1 or closes > 1 or (opens and (not closes or text.index("<think>") > text.index("</think>"))):
            rewards.append(0.0)
            continue
        rewards.append(1.0 if last_boxed(final_part(text)) is not None else 0.0)
    return rewards


def soft_overlong(name: str):
    """The configured soft overlong penalty ``name`` of :data:`SOFT_OVERLONG` (TRL's implementation)."""
    from trl.rewards import get_soft_overlong_punishment

    max_len, cache = SOFT_OVERLONG[name]
    return get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)


def _loader(name: str, needs_math_verify: bool = False) -> Callable[[], Callable]:
    """Loader of one of these rewards; a missing math-verify is a setup error, not a crash mid-training."""

    def load():
        if needs_math_verify and importlib.util.find_spec("math_verify") is None:
            raise ValueError(f"reward {name!r} needs math-verify: pip install 'bapo_trl[math]'.")
        return soft_overlong(name) if name in SOFT_OVERLONG else globals()[name]

    return load


#: The recipe's rewards by name -> zero-argument loader; ``bapo train --reward_funcs`` and ``bapo evaluate
#: --reward`` accept these names next to the general ones of :data:`bapo_trl.recipes.reward_funcs.REWARD_FUNCS`.
REWARD_FUNCS: dict[str, Callable[[], Callable]] = {
    "boxed_accuracy": _loader("boxed_accuracy", needs_math_verify=True),
    "boxed_format_reward": _loader("boxed_format_reward"),
    **{name: _loader(name) for name in SOFT_OVERLONG},  # DAPO's soft overlong penalty, one per length budget
}
