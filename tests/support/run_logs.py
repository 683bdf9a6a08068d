"""What a `bapo train` / `train_bapo.py` run logged, read from its output folder's ``metrics.jsonl`` (the console shows
a progress bar, not the logged dicts): every entry, in order, rank 0's."""

from __future__ import annotations

import json
from pathlib import Path


def logged(out) -> list[dict]:
    """Every entry the run(s) into ``out`` logged (a resumed run appends its own after the first run's)."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def values(out, key: str) -> list[float]:
    """The logged values of ``key``, one per entry that has it."""
    return [float(e[key]) for e in logged(out) if e.get(key) is not None]


def training_steps(out) -> list[int]:
    """The steps of the training entries (those with a ``loss``), in the order they were logged."""
    return [int(e["step"]) for e in logged(out) if "loss" in e]
