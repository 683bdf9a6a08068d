"""``bapo train``'s console while it trains: one progress bar with the few numbers a run is read by, and every
logged metric in ``output_dir/metrics.jsonl`` (and in the ``report_to`` integrations, as before), instead of
transformers' one printed dict of ~70 metrics per logged step."""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..trainer.checkpoints import write_atomically

#: The file every logged entry goes to, one JSON object per line (``bapo plot`` reads the end-of-run JSON instead).
METRICS_FILE = "metrics.jsonl"


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def open_metrics(output_dir: str, step: int):
    """:data:`METRICS_FILE` for appending this run's entries: a new run (step 0) starts it empty; a resume at ``step``
    keeps the entries up to that step and drops the later ones, which the resumed run logs again (a run that
    crashed after its last checkpoint had written them)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, METRICS_FILE)
    kept = []
    if step > 0 and os.path.exists(path):
        with open(path) as old:
            for line in old:
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short by the crash
                    continue
                if isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")

    def write(tmp: str) -> None:  # the kept entries replace the file whole: a stop leaves the old one, never a cut one
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, write)
    return open(path, "a")


class ConsoleProgress(TrainerCallback):
    """Main process only: a tqdm bar over the optimizer steps showing the last generation batch's reward, the window
    the search chose and the loss; each log entry appended to :data:`METRICS_FILE` (:func:`open_metrics`). With
    ``disable_tqdm`` the bar is off and the file alone is written."""

    def __init__(self):
        self.bar = None
        self.file = None
        self.shown: dict[str, str] = {}

    @staticmethod
    def install(trainer) -> ConsoleProgress:
        """Replace transformers' console callbacks (a bar with printed dicts, or printed dicts) on ``trainer``."""
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        progress = ConsoleProgress()
        trainer.add_callback(progress)
        return progress

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.file = open_metrics(args.output_dir, state.global_step)
        if not args.disable_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="training", unit="step",
                            dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.file is None or not logs:
            return
        self.file.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        self.file.flush()
        if self.bar is None:
            return
        reward, low, high, loss = (_number(logs.get(k)) for k in ("reward", "bapo/clip_low", "bapo/clip_high",
                                                                     "loss"))
        if reward is not None:
            self.shown["reward"] = f"{reward:.3f}"
        if low is not None and high is not None:
            self.shown["window"] = f"[{low:.2f}, {high:.2f}]"
        if loss is not None:
            self.shown["loss"] = f"{loss:.4f}"
        self.bar.set_postfix(self.shown, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None
