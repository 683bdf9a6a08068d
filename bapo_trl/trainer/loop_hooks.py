"""The trainer's two hooks into transformers' training loop: a callback once per optimizer step (the closed-loop
target moves there), and evaluation that leaves training's random state as it found it."""

from __future__ import annotations

import contextlib
import random
from typing import Callable

import numpy as np
import torch
from transformers import TrainerCallback


@contextlib.contextmanager
def training_random_state_kept(device: torch.device):
    """Save Python's, NumPy's and torch's random states (CPU, and the CUDA device in use) and restore them on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" \
        else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class EvaluationKeepsTrainingRandomState:
    """Trainer mixin: TRL's evaluation, with training's random state put back afterwards: evaluating (its dataloader,
    TRL's own sampling) then changes nothing training draws next (TRL's shuffle of each generation batch, its
    sampling), so a run trains the same batches and weights with or without ``eval_strategy``."""

    def evaluate(self, *args, **kwargs):
        with training_random_state_kept(self.accelerator.device):
            return super().evaluate(*args, **kwargs)


class AtEachUpdate(TrainerCallback):
    """Calls ``end_of_update`` once per optimizer step, after the optimizer stepped and before a checkpoint
    is saved."""

    def __init__(self, end_of_update: Callable[[], None]):
        self.end_of_update = end_of_update

    def on_step_end(self, args, state, control, **kwargs):
        self.end_of_update()
