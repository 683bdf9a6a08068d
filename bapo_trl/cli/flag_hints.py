"""A flag the command does not know, with the one the user most likely meant: shared by ``bapo train``'s front door
(:mod:`.train_front`, without torch) and its parser (:mod:`.train`). Imports nothing but the standard library."""

from __future__ import annotations

import difflib


def unknown_flags(known: set[str], argv: list[str]) -> str | None:
    """``unknown option --max_stpes; did you mean --max_steps?`` for every flag of ``argv`` not in ``known``
    (prefixes included: abbreviations are off), or None when all are known."""
    unknown = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--") and arg.split("=", 1)[0] not in known]
    if not unknown:
        return None
    flags = sorted(o for o in known if o.startswith("--") and "-" not in o[2:])  # one spelling each
    parts = []
    for flag in unknown:
        close = difflib.get_close_matches(flag.replace("-", "_").replace("__", "--", 1), flags, n=1, cutoff=0.75)
        parts.append(f"unknown option {flag}" + (f"; did you mean {close[0]}?" if close else ""))
    return "; ".join(parts) + " (`--help` lists the options)"
