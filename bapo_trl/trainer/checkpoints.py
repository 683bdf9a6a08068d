"""Checkpoints that are either complete or ignored.

Transformers writes ``checkpoint-N`` in place, file after file, and ``resume_from_checkpoint=True`` takes the
highest N: a run killed while writing would resume from a half-written checkpoint. BAPOTrainer writes a marker
last (atomically), and resumes from the newest checkpoint that has it; older checkpoints are never touched by a
new write, so an interrupted write cannot corrupt them. A folder that already exists is rewritten (a resume from
an earlier step writes the later steps again; an interrupted write left it): it loses its marker first, then the
rest of the earlier write, before the first file of the new write lands, so a marker always vouches for the files
of the write that wrote it and nothing else. With ``save_total_limit``, older checkpoints are rotated out (by
transformers' own ``rotate_checkpoints``) only after the new one is marked complete.

A run that starts at step k (fresh: 0; a resume: its checkpoint's step) abandons every complete checkpoint of its
``output_dir`` past k, which an earlier run wrote: before it writes anything their markers are renamed (durably), so
``resume_from_checkpoint=True`` follows the run the user chose, also when that run stops before it rewrote them. The
folders stay (an explicit path still resumes one) until this run writes them again.
"""

from __future__ import annotations

import json
import os
import re
import time

from transformers.utils import logging

logger = logging.get_logger(__name__)

MARKER = "bapo_checkpoint_complete.json"
#: A complete checkpoint of a branch a later run abandoned (its marker, renamed): never taken by ``latest``.
SUPERSEDED = "bapo_checkpoint_superseded.json"
_STEP = re.compile(r"^checkpoint-(\d+)$")


def write_atomically(path: str, write) -> None:
    """``write(tmp_path)`` then rename onto ``path``: a reader (or a resume after a crash) never sees half a file."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def mark_complete(folder: str, step: int, world_size: int = 1) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"global_step": step, "world_size": world_size, "time": time.time()}, f)

    write_atomically(os.path.join(folder, MARKER), write)


def is_complete(folder: str) -> bool:
    """The folder has a marker. Its files' times are not compared with the marker's: copies (``cp -r``, a git
    checkout such as tests/data/) and clocks (a step back, another node's on a shared filesystem) reorder them, and
    :func:`clear_for_rewrite` already removes a marker before any file of a new write lands."""
    return os.path.exists(os.path.join(folder, MARKER))


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # a filesystem that does not sync directories
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Remove a file or a folder tree; what is already gone is fine (with ``save_on_each_node`` on a shared
    filesystem, every node's main process clears the same folder)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for name in os.listdir(path):
                _remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def clear_for_rewrite(folder: str) -> None:
    """Before the first file of a checkpoint lands in ``folder``: if an earlier write left it (a resume from an earlier
    step rewrites the later checkpoints; a write cut short left one), remove its marker first, durably, then every
    other file of that write. A write cut short then leaves a folder without a marker (skipped), never the old marker
    over new weights and an old optimizer, and the marker written last vouches for this write's files only (no stale
    file of a write with other settings, such as other shards or another number of processes)."""
    if not os.path.isdir(folder):
        return
    try:
        os.unlink(os.path.join(folder, MARKER))
    except FileNotFoundError:
        pass
    else:
        _fsync_dir(folder)  # a power cut after this must not bring the old marker back over the new files
    for name in os.listdir(folder):
        _remove(os.path.join(folder, name))


def checkpoint_folders(output_dir: str) -> list[str]:
    """The names of the ``checkpoint-N`` folders of ``output_dir``, lowest step first (none if it does not exist)."""
    if not os.path.isdir(output_dir):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(output_dir)
                   if (m := _STEP.match(name)) and os.path.isdir(os.path.join(output_dir, name)))
    return [name for _, name in steps]


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step in ``output_dir`` (None if there is none)."""
    for name in reversed(checkpoint_folders(output_dir)):
        folder = os.path.join(output_dir, name)
        if is_complete(folder):
            return folder
    return None


def checkpoint_step(folder: str) -> int:
    """The optimizer step a checkpoint was written at: its marker's, else its trainer state's, else its name's."""
    for name, key in ((MARKER, "global_step"), ("trainer_state.json", "global_step")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                step = json.load(f).get(key)
            if step is not None:
                return int(step)
    match = _STEP.match(os.path.basename(os.path.normpath(folder)))
    if match is None:
        raise ValueError(f"resume_from_checkpoint: cannot tell the step of {folder!r} (no marker, no "
                         "trainer_state.json, not named checkpoint-N).")
    return int(match.group(1))


def supersede_later(output_dir: str, step: int) -> list[str]:
    """Before a run that starts at ``step`` writes anything: every complete checkpoint in ``output_dir`` past ``step``
    belongs to the branch it abandons. Each loses its marker (renamed to :data:`SUPERSEDED`, synced to disk, the
    folder's time kept for transformers' rotation); returns those folders."""
    if not os.path.isdir(output_dir):
        return []
    superseded = []
    # Highest step first: a stop part-way leaves the abandoned branch cut at a step, never with a hole in it.
    for name in reversed(checkpoint_folders(output_dir)):
        folder = os.path.join(output_dir, name)
        if int(_STEP.match(name).group(1)) <= step or not is_complete(folder):
            continue
        times = os.stat(folder)
        os.replace(os.path.join(folder, MARKER), os.path.join(folder, SUPERSEDED))
        _fsync_dir(folder)
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
        superseded.append(folder)
    return superseded


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
    """Per-process state beside TRL's checkpoint files (``stem -> state dict``, from ``obj.state_dict()``), one file
    each."""
    import torch

    for stem, state in states.items():
        os.makedirs(folder, exist_ok=True)
        write_atomically(_rank_state_path(folder, stem, rank), lambda tmp, state=state: torch.save(state, tmp))


def saved_world_size(folder: str) -> int | None:
    """How many processes wrote the checkpoint: from its marker, else from its per-rank files (None: no such file)."""
    marker = os.path.join(folder, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            size = json.load(f).get("world_size")
        if size is not None:
            return int(size)
    ranks = [int(m.group(1)) for name in os.listdir(folder) if (m := re.match(r"^.+_rank(\d+)\.pt$", name))]
    return max(ranks) + 1 if ranks else None


def refuse_other_world_size(folder: str, world_size: int) -> None:
    """A checkpoint written by another number of processes cannot be resumed (:func:`load_rank_states`)."""
    saved = saved_world_size(folder)
    if saved is not None and saved != world_size:
        raise ValueError(
            f"resume_from_checkpoint: {folder} was written by {saved} processes and this run has {world_size}. Its "
            "per-process rollout state (replay queues, partial-rollout pools, the generation batch in progress) "
            f"belongs to {saved} processes and cannot be redistributed without losing or repeating data: resume with "
            f"{saved} processes (accelerate launch --num_processes {saved}).")


def load_rank_states(folder: str, states: dict, rank: int, world_size: int = 1, optional: tuple[str, ...] = ()
                     ) -> None:
    """Restore what :func:`save_rank_states` wrote; a missing file is an error naming it (never a silent fresh start),
    except for the ``optional`` stems (state that older checkpoints did not have). A checkpoint written by another
    number of processes is refused: per-process state (replay queues, partial-rollout pools, generation batches)
    cannot be split or merged without losing or duplicating data."""
    import torch

    refuse_other_world_size(folder, world_size)
    for stem, obj in states.items():
        path = _rank_state_path(folder, stem, rank)
        if not os.path.exists(path) and stem in optional:
            continue
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Resuming with {stem.replace('_', ' ')} on, but {path} is missing: the checkpoint was written "
                "without it (or by a run with a different number of processes)."
            )
        obj.load_state_dict(torch.load(path, weights_only=False))


#: File stem of TRL's generation batch in progress (absent in checkpoints written before it was saved).
GENERATION_BATCH = "generation_batch"


class GenerationBatchState:
    """TRL's generation batch in progress: the micro-batches ``GRPOTrainer`` buffered when it generated (it trains on
    them over ``steps_per_generation x num_iterations`` micro-steps) and its micro-step counter. Saved with every
    checkpoint, so one written in the middle of a generation batch resumes that batch instead of generating a new one
    (which would lose the rest of it and shift every later generation boundary)."""

    #: The settings that say which prompts each step trains: how a generation batch is cut into micro-batches and how
    #: often each is trained, how many micro-steps make an update, how many completions make a group. A resume
    #: continues the checkpoint's data order under the same ones only: TRL's sampler, transformers' data skip
    #: (``global_step x gradient_accumulation_steps`` micro-batches), the saved micro-step counter and every rollout
    #: source's state count in them (under others, prompts are skipped or trained twice, groups regrouped).
    SHAPE = ("steps_per_generation", "num_iterations", "per_device_train_batch_size", "gradient_accumulation_steps",
             "num_generations")

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        buffered = self.trainer._buffered_inputs
        return {"micro_step": self.trainer._step,
                "buffered": None if buffered is None else [_to(batch, "cpu") for batch in buffered],
                "shape": {name: getattr(self.trainer.args, name) for name in self.SHAPE}}

    def _changed(self, state: dict) -> list[str]:
        """The shape settings this run changes, ``"`name` (saved there, this here)"`` (a checkpoint saves those it
        knew: older ones fewer, or none)."""
        return [f"`{name}` ({saved} there, {getattr(self.trainer.args, name)} here)"
                for name, saved in state.get("shape", {}).items() if getattr(self.trainer.args, name) != saved]

    def refuse_other_shape(self, folder: str, rank: int) -> None:
        """Before anything of the run is written (the resume supersedes later checkpoints): a checkpoint resumes only
        under the settings that ordered its data (:data:`SHAPE`), at a generation boundary as part-way."""
        import torch

        path = _rank_state_path(folder, GENERATION_BATCH, rank)
        if not os.path.exists(path):
            return
        changed = self._changed(torch.load(path, weights_only=False))
        if changed:
            raise ValueError(
                f"resume_from_checkpoint: {folder} was written under other batch settings: {', '.join(changed)}. A "
                "resume continues the checkpoint's data order (TRL's sampler, transformers' data skip, the batch in "
                "progress and the rollout state all count in its batches and groups): under other values it would "
                "skip or repeat prompts. Resume with the checkpoint's settings; to train on under new ones, start a "
                f"new run from its weights (model_name_or_path={folder}, without resume_from_checkpoint).")

    def load_state_dict(self, state: dict) -> None:
        device = self.trainer.accelerator.device
        changed = self._changed(state)
        if changed:  # refuse_other_shape refused it already, before the resume wrote anything
            raise ValueError(f"resume_from_checkpoint: written under other batch settings, {', '.join(changed)}.")
        buffered = state["buffered"]
        self.trainer._step = int(state["micro_step"])
        self.trainer._buffered_inputs = None if buffered is None else [_to(batch, device) for batch in buffered]

    def reset(self) -> None:
        """A new run starts at a generation boundary (TRL keeps both across ``train()`` calls otherwise)."""
        self.trainer._step, self.trainer._buffered_inputs = 0, None


def _to(batch: dict, device) -> dict:
    import torch

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


class CheckpointMixin:
    """Trainer overrides (put before ``GRPOTrainer`` in the bases): per-rank rollout state and TRL's generation batch
    in progress join each checkpoint, a folder written again is cleared (its marker first) before the first file lands,
    the completeness marker is written last, rotation waits for it, and ``resume_from_checkpoint=True`` takes the
    newest complete checkpoint (:meth:`_checkpoint_to_resume`, which the trainer's ``train()`` calls first). The
    trainer provides ``_rank_states()`` (file stem -> object with ``state_dict``)."""

    def _checkpoint_states(self) -> dict:
        return {**self._rank_states(), GENERATION_BATCH: GenerationBatchState(self)}

    def _save_checkpoint(self, model, trial):
        from transformers.trainer import TRAINING_ARGS_NAME
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        states = self._settled_rank_states()  # before anything is written: a failure leaves the folder as it was
        if self.args.should_save:  # the process that writes the marker removes the earlier write's one, and its files
            clear_for_rewrite(folder)
        self.accelerator.wait_for_everyone()  # ... before any rank's file of this write lands
        save_rank_states(folder, states, self.accelerator.process_index)
        # Transformers rotates (save_total_limit) at the end of its own _save_checkpoint, before this checkpoint is
        # marked complete: a crash in between could leave no complete checkpoint. It does not rotate there; this
        # method rotates with transformers' own function once the new checkpoint counts.
        save_total_limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        if self.args.should_save and os.path.exists(os.path.join(folder, TRAINING_ARGS_NAME)):
            self._save_training_args(os.path.join(folder, TRAINING_ARGS_NAME))  # saved with the limit set aside
        self.accelerator.wait_for_everyone()  # every rank's share is on disk before the checkpoint counts
        if self.args.should_save:
            mark_complete(folder, self.state.global_step, self.accelerator.num_processes)
            rotate_checkpoints(output_dir=self._get_output_dir(trial=trial), save_total_limit=save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _settled_rank_states(self) -> dict:
        """This process's rollout state for the checkpoint (stem -> state dict), or an error on every process if it
        failed on any: the main process's async generation waits for the batches generated ahead, which can fail (a
        stalled server, the producer's error) while the other processes would go on into the next collective."""
        from ..generation.processes import raised_on_every_process

        processes = self.accelerator.num_processes
        with raised_on_every_process(processes, "checkpoint: collecting the rollout state failed"):
            states = {stem: obj.state_dict() for stem, obj in self._checkpoint_states().items()}
        return states

    def _save_training_args(self, path: str) -> None:
        """The arguments as the user set them (transformers wrote them while ``save_total_limit`` was set aside)."""
        import torch

        write_atomically(path, lambda tmp: torch.save(self.args, tmp))

    def _checkpoint_to_resume(self, resume_from_checkpoint):
        """What ``train(resume_from_checkpoint=...)`` resumes from, once per run before it writes anything:
        ``True``/``"latest"`` is the newest COMPLETE checkpoint; the checkpoints of ``output_dir`` past the run's start
        step belong to a branch it abandons (:func:`supersede_later`); TRL's generation batch starts empty. A
        checkpoint at or past ``max_steps`` is refused (a finished run: there is nothing left to train)."""
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        step = None if resume is None else checkpoint_step(resume)
        if step is not None and 0 < self.args.max_steps <= step:
            # transformers' loop would train one step past max_steps from there (TRL's GRPOTrainer does, 5.24)
            raise ValueError(
                f"{resume} was written at step {step} and `max_steps` is {self.args.max_steps}: its run is finished, "
                "and resuming would train a step past max_steps. Raise `max_steps` to train on, or load the trained "
                f"model from {resume}.")
        if resume is not None:  # what the resume would refuse, refused before it supersedes anything
            refuse_other_world_size(resume, self.accelerator.num_processes)
            GenerationBatchState(self).refuse_other_shape(resume, self.accelerator.process_index)
        if self.args.should_save:  # checkpoints past this run's start belong to an abandoned branch
            start = 0 if resume is None else checkpoint_step(resume)
            abandoned = supersede_later(self.args.output_dir, start)
            if abandoned:
                logger.warning(
                    f"This run starts at step {start}: {len(abandoned)} complete checkpoint(s) of an earlier run in "
                    f"{self.args.output_dir} past it ({', '.join(map(os.path.basename, abandoned))}) no longer count "
                    "for resume_from_checkpoint=True (their marker is renamed to "
                    f"{SUPERSEDED}; a path still resumes one). This run writes them again as it reaches them.")
        GenerationBatchState(self).reset()
        return resume

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        load_rank_states(checkpoint, self._checkpoint_states(), self.accelerator.process_index,
                         self.accelerator.num_processes, optional=(GENERATION_BATCH,))
