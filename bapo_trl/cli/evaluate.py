"""``bapo evaluate``: avg@k / pass@k of a model or checkpoint on a math dataset, scored with the training reward (the
evaluation itself: :mod:`bapo_trl.recipes.math_reasoning.evaluate`).

    bapo evaluate --model outputs/run/checkpoint-200 --dataset HuggingFaceH4/aime_2024 --k 16 \\
        --max_new_tokens 8192 --temperature 0.6 --output aime24.json

(or ``python -m bapo_trl.cli.evaluate ...``, the same command.) Each flag is also accepted with dashes
(``--max-new-tokens``), as TRL's parser accepts both spellings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..recipes.math_reasoning.evaluate import evaluate
from .main import OneSpellingHelpFormatter, both_spellings

DESCRIPTION = ("avg@k / pass@k of a model or checkpoint on a math dataset, scored with the training reward. Each flag "
               "is also accepted with dashes (--max-new-tokens = --max_new_tokens), as TRL's parser accepts both.")


class DefaultsHelpFormatter(OneSpellingHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except where there is none to show (a required option, or a default
    of ``None``, whose meaning the help text gives). Each flag is listed once, with underscores; the dashed spelling
    (``--max-new-tokens``) is accepted too."""

    def _get_help_string(self, action):
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


#: The dtypes ``--dtype`` takes.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def make_parser(prog: str = "python -m bapo_trl.cli.evaluate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Model or checkpoint directory, hub id, LoRA adapter directory, or "
                   "a bapo_trl.recipes.models registry name (smollm2-135m-instruct).")
    p.add_argument("--dataset", required=True, help="Local .jsonl/.json/.parquet/.csv file or hub dataset id.")
    p.add_argument(*both_spellings("--dataset_config"), default=None,
                   help="Hub dataset config (default: none; GSM8K's 'main' is automatic).")
    p.add_argument("--split", default=None, help="Split (default: 'test', or 'train' if that is the only one).")
    p.add_argument(*both_spellings("--math_dataset_format"), default="auto",
                   help="Math format (bapo_trl.recipes.math_reasoning.data): auto (known dataset ids, then the "
                   "columns) or a format name.")
    p.add_argument(*both_spellings("--math_instruction_role"), default="system", choices=["system", "user"],
                   help="The boxed-answer instruction as a system message, or after the problem in the user message.")
    p.add_argument("--k", type=int, default=16, help="Samples per problem (the paper: 16).")
    p.add_argument(*both_spellings("--num_problems"),
                   type=int, default=None, help="Only the first N problems (default: all).")
    p.add_argument(*both_spellings("--max_new_tokens"), type=int, default=1024, help="Longest completion, in tokens.")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (then all k samples agree).")
    p.add_argument(*both_spellings("--top_p"), type=float, default=1.0, help="Nucleus sampling (1.0 = off).")
    p.add_argument(*both_spellings("--batch_size"), type=int, default=16, help="Samples generated together.")
    p.add_argument("--reward", default="boxed_accuracy", help="Reward by registry name or dotted path.")
    p.add_argument(*both_spellings("--correct_threshold"),
                   type=float, default=0.5, help="A sample with reward >= this is correct.")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16.")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU; default: torch's).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    p.add_argument(*both_spellings("--keep_chars"),
                   type=int, default=2000, help="Characters of the first completion kept per problem.")
    p.add_argument("--output", default=None,
                   help="Write the JSON report here (default: only the summary line on stdout).")
    return p


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first flag whose value cannot give a report (a negative batch size drew no sample and scored 0), or whose
    report could not be written (found at the end, after the whole evaluation); None if all can."""
    checks = [
        (args.k >= 1, "--k must be >= 1"),
        (args.batch_size >= 1, f"--batch_size must be >= 1, got {args.batch_size}"),
        (args.num_problems is None or args.num_problems >= 1,
         f"--num_problems must be >= 1 (or left out for all), got {args.num_problems}"),
        (args.max_new_tokens >= 1, f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"),
        (args.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"),
        (0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
        (args.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}"),
    ]
    if args.math_dataset_format != "auto":
        from ..recipes.math_reasoning.data import resolve_format

        try:
            resolve_format(args.math_dataset_format)
        except ValueError as err:
            checks.append((False, f"--math_dataset_format: {err}"))
    if args.output is not None:
        folder = os.path.dirname(os.path.abspath(args.output))
        checks.append((not os.path.isdir(args.output), f"--output {args.output!r} is a directory: name a file"))
        checks.append((os.path.isdir(folder) and os.access(folder, os.W_OK),
                       f"--output {args.output!r}: its folder {folder!r} does not exist or is not writable"))
    return next((message for ok, message in checks if not ok), None)


def main(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.evaluate") -> dict:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:  # before any dataset or model is loaded
        parser.error(problem)
    try:
        report = evaluate(args)
    except (ValueError, OSError) as err:  # a bad path, dataset, split or reward: one line, no traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    metrics = {key: value for key, value in report.items() if key.startswith(("avg@", "pass@"))}
    print(json.dumps({"model": args.model, "dataset": args.dataset, "num_scored": report["num_scored"], **metrics}))
    return report


def command(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.evaluate") -> int:
    """``bapo evaluate``'s contract (:mod:`.main`): the report is printed (and written with ``--output``)."""
    main(argv, prog=prog)
    return 0


if __name__ == "__main__":
    sys.exit(command())
