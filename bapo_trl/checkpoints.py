"""Checkpoints that are either complete or ignored.

Transformers writes ``checkpoint-N`` in place, file after file, and ``resume_from_checkpoint=True`` takes the
highest N: a run killed while writing would resume from a half-written checkpoint. BAPOTrainer writes a marker
last (atomically), and resumes from the newest checkpoint that has it; older checkpoints are never touched by a
new write, so an interrupted write cannot corrupt them. With ``save_total_limit``, older checkpoints are rotated
out (by transformers' own ``rotate_checkpoints``) only after the new one is marked complete.
"""

from __future__ import annotations

import json
import os
import re
import time

MARKER = "bapo_checkpoint_complete.json"
_STEP = re.compile(r"^checkpoint-(\d+)$")


def write_atomically(path: str, write) -> None:
    """``write(tmp_path)`` then rename onto ``path``: a reader (or a resume after a crash) never sees half a file."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def mark_complete(folder: str, step: int) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"global_step": step, "time": time.time()}, f)

    write_atomically(os.path.join(folder, MARKER), write)


def is_complete(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, MARKER))


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step in ``output_dir`` (None if there is none)."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _STEP.match(name))
    )
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if is_complete(folder):
            return folder
    return None


def resolve_resume(resume, output_dir: str):
    """``True``/``"true"``/``"latest"`` -> the newest complete checkpoint; a path must be complete (or at least
    hold a ``trainer_state.json`` when written by another trainer)."""
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "latest")):
        found = latest_complete_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"resume_from_checkpoint: no complete checkpoint in {output_dir!r}.")
        return found
    if not os.path.isdir(resume):
        raise ValueError(f"resume_from_checkpoint: {resume!r} is not a directory.")
    if not is_complete(resume) and not os.path.exists(os.path.join(resume, "trainer_state.json")):
        raise ValueError(
            f"resume_from_checkpoint: {resume!r} is incomplete (its write was interrupted); the newest complete one "
            f"is {latest_complete_checkpoint(os.path.dirname(os.path.abspath(resume)))!r}."
        )
    return resume
