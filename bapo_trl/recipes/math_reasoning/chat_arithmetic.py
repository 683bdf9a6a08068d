r"""A small conversational arithmetic task on which SmolLM2-135M-Instruct has signal (right sometimes, not always).

Every prompt is a chat: a system instruction and two worked turns (few-shot) showing the answer format, then the
question, e.g.::

    system:    Answer with the calculation in \boxed{}.
    user:      What is 2 + 3?          assistant: \boxed{2 + 3 = 5}
    user:      What is 9 - 6?          assistant: \boxed{9 - 6 = 3}
    user:      What is 7 + 8?

``answer`` is the result as text (``"15"``). The reward is the math recipe's ``boxed_accuracy`` (math-verify, through
TRL's ``accuracy_reward``): the content of the last ``\boxed{}`` must equal the answer. math-verify judges an
equation by its right-hand side and evaluates expressions, so ``\boxed{7 + 8 = 15}`` and ``\boxed{15}`` are right,
``\boxed{7 + 8 = 16}`` is wrong, and so is a box cut off by the length limit; an unevaluated ``\boxed{7 + 8}`` also
counts as right (math-verify's semantics, kept: the box holds a correct value).

Why this shape (measured with the base model, temperature 1.0, 16 tokens): asked plainly, the model explains at
length and boxes nothing; with few-shot turns that box only the number it copies numbers from the examples (about 10%
right); with the calculation inside the box it is right about 40-50% of the time on one- and two-digit operands,
and most groups of 8 samples have reward spread: GRPO has something to learn from. An answer takes about 10 tokens.

The shipped files (``tests/data/chat_arithmetic_{train,test}.jsonl``) are written by ``python -m
bapo_trl.recipes.math_reasoning.chat_arithmetic`` (deterministic; a test checks the files equal this module's output).
"""

from __future__ import annotations

import json
import os
import random
import sys

INSTRUCTION = "Answer with the calculation in \\boxed{}."
EXAMPLES = [((2, "+", 3), 5), ((9, "-", 6), 3)]
MAX_OPERAND = 12
TEST_SIZE = 48


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def worked_answer(a: int, op: str, b: int, result: int) -> str:
    return f"\\boxed{{{a} {op} {b} = {result}}}"


def make_prompt(a: int, op: str, b: int) -> list[dict]:
    messages = [{"role": "system", "content": INSTRUCTION}]
    for (x, o, y), result in EXAMPLES:
        messages += [{"role": "user", "content": question(x, o, y)},
                     {"role": "assistant", "content": worked_answer(x, o, y, result)}]
    return messages + [{"role": "user", "content": question(a, op, b)}]


def all_problems() -> list[dict]:
    """Every ``a + b`` and ``a - b`` (``a >= b``) with operands 1..MAX_OPERAND, except the worked examples."""
    shown = {example for example, _ in EXAMPLES}
    problems = []
    for a in range(1, MAX_OPERAND + 1):
        for b in range(1, MAX_OPERAND + 1):
            for op, result in (("+", a + b), ("-", a - b)):
                if (op == "-" and a < b) or (a, op, b) in shown:
                    continue
                problems.append(dict(id=f"{a}{op}{b}", prompt=make_prompt(a, op, b), answer=str(result)))
    return problems


def splits(seed: int = 0) -> dict[str, list[dict]]:
    """A fixed shuffle; the first ``TEST_SIZE`` problems are the test split, the rest the training split."""
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    return {"test": problems[:TEST_SIZE], "train": problems[TEST_SIZE:]}


def write(directory: str) -> list[str]:
    paths = []
    for split, rows in splits().items():
        path = os.path.join(directory, f"chat_arithmetic_{split}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data")
    for written in write(target):
        print(written)
