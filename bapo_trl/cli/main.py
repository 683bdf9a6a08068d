"""The ``bapo`` command: one entry point for the package's commands, each the module it always was.

    bapo train ...      = python train_bapo.py ...        (multi-process: accelerate launch train_bapo.py ...)
    bapo serve ...      = python -m bapo_trl.cli.serve ...
    bapo evaluate ...   = python -m bapo_trl.cli.evaluate ...
    bapo plot ...       = python -m bapo_trl.cli.plot ...
    bapo models ...     = python -m bapo_trl.cli.models ...
    bapo env            = python -m bapo_trl.cli.env          (versions and device, for a bug report)
    bapo --version      (also -V): the package's version

The contract of a subcommand: its module defines ``command(argv, prog) -> int`` (parse ``argv``, run, return the exit
code), which its ``python -m`` form runs too (``sys.exit(command())``); the rest of the command line goes there, so
its flags, help text and exit codes are the module's, with ``bapo SUBCOMMAND`` as the program name. A new subcommand
is such a module plus one line of :data:`SUBCOMMANDS`. Only the chosen subcommand's module is imported, so
``bapo plot`` and ``bapo --help`` do not load torch or transformers.

``train``, ``serve`` and ``evaluate`` take each flag with dashes or underscores, as TRL's parser does
(``--max-new-tokens`` is ``--max_new_tokens``): :func:`both_spellings` gives a flag its second spelling and
:class:`OneSpellingHelpFormatter` shows only the first in ``--help``.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import sys

PROG = "bapo"

#: subcommand -> (module defining ``command(argv, prog) -> int``, one line of help)
SUBCOMMANDS = {
    "train": ("bapo_trl.cli.train_front", "train with BAPO on top of TRL's GRPO (= train_bapo.py)"),
    "serve": ("bapo_trl.cli.serve", "start a vLLM server with the flags BAPO/TRL training needs (GPU or CPU)"),
    "evaluate": ("bapo_trl.cli.evaluate", "avg@k / pass@k of a model or checkpoint on a math dataset"),
    "plot": ("bapo_trl.cli.plot", "training-dynamics PNG of one or more runs"),
    "models": ("bapo_trl.cli.models", "prepare a registry model offline (smollm2) and print its directory"),
    "env": ("bapo_trl.cli.env", "versions of python, torch, trl, vllm, ... and the device, for a bug report"),
}


def both_spellings(flag: str) -> list[str]:
    """``"--max_new_tokens"`` -> ``["--max_new_tokens", "--max-new-tokens"]`` (and ``"--dry-run"`` ->
    ``["--dry-run", "--dry_run"]``): the flag as written first (argparse names the attribute after it), then its
    other spelling, as TRL's parser accepts both. A flag without ``_`` or ``-`` in its name has one spelling."""
    name = flag[2:]
    other = name.replace("_", "-") if "_" in name else name.replace("-", "_")
    return [flag] if other == name else [flag, f"--{other}"]


class OneSpellingHelpFormatter(argparse.HelpFormatter):
    """``--help`` lists each flag once, as first written (its other spelling, dashes for underscores or the reverse,
    is accepted too: :func:`both_spellings`); ``-h, --help`` and other short forms are shown as usual."""

    def _format_action_invocation(self, action):
        seen, shown = set(), []
        for option in action.option_strings:
            key = option.replace("-", "_")
            if key not in seen:
                seen.add(key)
                shown.append(option)
        if len(shown) < len(action.option_strings):
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} [ARGS ...]", f"       {PROG} --version", "",
             "BAPO (adaptive clipping) for TRL: training, vLLM serving, evaluation, plots, models and the "
             "environment.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", f"`{PROG} SUBCOMMAND --help` shows its flags; `{PROG} --version` (or -V) prints the package's "
              "version.", "train, serve and evaluate take each flag with dashes or underscores (--max-new-tokens = "
              "--max_new_tokens),", "as TRL's parser does. The `python -m bapo_trl...` forms, `python train_bapo.py` "
              "and", "`accelerate launch train_bapo.py` (multi-process training) work as well."]
    return "\n".join(lines) + "\n"


def _error(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message} (see `{PROG} --help`)\n")
    return 2


def _run(name: str, argv: list[str]) -> int:
    """Run subcommand ``name`` as its ``python -m`` form does (its module's ``command``), and return the exit code."""
    return importlib.import_module(SUBCOMMANDS[name][0]).command(argv, prog=f"{PROG} {name}")


def main(argv: list[str] | None = None) -> int:
    """``bapo SUBCOMMAND ARGS...``; the console script exits with the returned code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _error(f"missing subcommand: one of {', '.join(SUBCOMMANDS)}")
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0
    if name in ("-V", "--version"):
        from .. import __version__

        sys.stdout.write(f"bapo_trl {__version__}\n")
        return 0
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; one of {', '.join(SUBCOMMANDS)}"
        return _error(f"unknown subcommand {name!r}{hint}")
    return _run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
