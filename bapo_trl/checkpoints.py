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


def _rank_state_path(folder: str, stem: str, rank: int) -> str:
    return os.path.join(folder, f"{stem}_rank{rank}.pt")


def save_rank_states(folder: str, states: dict, rank: int) -> None:
    """Per-process state beside TRL's checkpoint files (``stem -> object with state_dict()``), one file each."""
    import torch

    for stem, obj in states.items():
        os.makedirs(folder, exist_ok=True)
        state = obj.state_dict()
        write_atomically(_rank_state_path(folder, stem, rank), lambda tmp, state=state: torch.save(state, tmp))


def load_rank_states(folder: str, states: dict, rank: int) -> None:
    """Restore what :func:`save_rank_states` wrote; a missing file is an error naming it (never a silent fresh start)."""
    import torch

    for stem, obj in states.items():
        path = _rank_state_path(folder, stem, rank)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Resuming with {stem.replace('_', ' ')} on, but {path} is missing: the checkpoint was written "
                "without it (or by a run with a different number of processes)."
            )
        obj.load_state_dict(torch.load(path, weights_only=False))


class CheckpointMixin:
    """Trainer overrides (put before ``GRPOTrainer`` in the bases): per-rank rollout state joins each checkpoint,
    the completeness marker is written last, rotation waits for it, and ``resume_from_checkpoint=True`` takes the
    newest complete checkpoint. The trainer provides ``_rank_states()`` (file stem -> object with ``state_dict``),
    ``_after_state_load()`` and ``_end_of_training()``."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        save_rank_states(folder, self._rank_states(), self.accelerator.process_index)
        # Transformers rotates (save_total_limit) at the end of its own _save_checkpoint, before this checkpoint is
        # marked complete: a crash in between could leave no complete checkpoint. It does not rotate there; this
        # method rotates with transformers' own function once the new checkpoint counts.
        save_total_limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        self.accelerator.wait_for_everyone()  # every rank's share is on disk before the checkpoint counts
        if self.args.should_save:
            mark_complete(folder, self.state.global_step)
            rotate_checkpoints(output_dir=self._get_output_dir(trial=trial), save_total_limit=save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``resume_from_checkpoint=True`` (or ``"latest"``) resumes from the newest COMPLETE checkpoint."""
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._end_of_training()

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        load_rank_states(checkpoint, self._rank_states(), self.accelerator.process_index)
        self._after_state_load()
