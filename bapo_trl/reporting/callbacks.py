"""Callbacks a user adds to ``BAPOTrainer`` (as TRL keeps its own in ``trl/trainer/callbacks.py``):
:class:`PlotDynamicsCallback` leaves a finished run plottable again and draws its dynamics."""

from __future__ import annotations

import json
import os
import warnings

from transformers import TrainerCallback

from ..trainer.checkpoints import write_atomically
from .dynamics import LOG_HISTORY_NAME, plot_dynamics


def write_log_history(path: str, state, args=None) -> None:
    """Dump ``state.log_history`` (and the positive-share target) where the plot command finds it."""
    data = {"global_step": state.global_step,
            "positive_contribution_target": getattr(args, "positive_contribution_target", None),
            "log_history": state.log_history}

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)

    write_atomically(path, write)


class PlotDynamicsCallback(TrainerCallback):
    """At the end of training (main process only), save ``output_dir/bapo_log_history.json`` and draw the PNG.

    ``save_model`` does not write the log history and ``trainer_state.json`` exists only with checkpoints,
    so without this file a finished run could not be plotted again. ``output_path`` defaults to
    ``output_dir/dynamics.png``.
    """

    def __init__(self, output_path: str | os.PathLike | None = None, smooth: int | None = None):
        self.output_path = output_path
        self.smooth = smooth

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        write_log_history(os.path.join(args.output_dir, LOG_HISTORY_NAME), state, args)
        output = self.output_path or os.path.join(args.output_dir, "dynamics.png")
        label = os.path.basename(os.path.abspath(args.output_dir))
        try:
            plot_dynamics([state.log_history], output=output, labels=[label],
                          target=getattr(args, "positive_contribution_target", None), smooth=self.smooth)
        except ImportError as err:  # never lose a finished run (and its save_model) to a missing plot extra
            warnings.warn(f"PlotDynamicsCallback: no plot ({err}); `pip install matplotlib`, then "
                          f"`bapo plot {args.output_dir}`.", stacklevel=2)
