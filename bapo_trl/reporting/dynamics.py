"""Training-dynamics plots of BAPO runs: one PNG with a panel per quantity a researcher checks, runs overlaid.

Input is a run's logged history (``trainer.state.log_history``). In a run directory it is read from, in this
order of preference when several reach the same step:

* ``bapo_log_history.json``, written at the end of training by :class:`~.callbacks.PlotDynamicsCallback` (also
  holds the positive-share target, so the plot can draw it);
* ``trainer_state.json`` at the top level (``trainer.save_state()``) or in the newest ``checkpoint-*/`` (written
  only when checkpoints are saved: ``save_strategy != "no"``). ``trainer.save_model()`` writes neither. The
  target then comes from the model card's BAPO section, when the run wrote one.

Noisy per-step series are drawn as a centred rolling mean over about 5% of their logged points (at least 1;
``smooth=`` overrides), with the raw values faint underneath, so trends are visible without hiding the noise.

The library side of ``bapo plot RUN_DIR ... -o dynamics.png`` (:mod:`bapo_trl.cli.plot` parses and calls
:func:`plot_dynamics`) and of :class:`~.callbacks.PlotDynamicsCallback`.

Drawn with the Agg canvas on a plain ``Figure`` (no pyplot state), so it never changes a notebook's backend.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

#: File the callback writes next to the model; the plot command reads it like ``trainer_state.json``.
LOG_HISTORY_NAME = "bapo_log_history.json"
#: Resolution of the PNG; the size in pixels is ``figure.get_size_inches() * DPI``.
DPI = 100
#: Figure width and height of one row of panels, in inches.
WIDTH, ROW_HEIGHT, HEADER_HEIGHT = 12.0, 2.8, 0.7


@dataclass(frozen=True)
class Series:
    label: str
    keys: tuple[str, ...]  # the first key a run logged is used (fallbacks for plain GRPO runs)
    linestyle: str = "-"


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    scale: float = 1.0  # 100 turns fractions into percent
    optional: bool = False  # drawn only when a run logged one of its series


PANELS = (
    Panel("reward", "Reward (one point per generation batch)", "mean reward per completion",
          (Series("reward", ("reward",)),)),
    Panel("entropy", "Policy entropy", "nats per token", (Series("entropy", ("entropy",)),)),
    Panel("clip_bounds", "Clip bounds chosen by the search", "importance ratio  pi / pi_old",
          (Series("c_high", ("bapo/clip_high",)), Series("c_low", ("bapo/clip_low",), "--"))),
    Panel("positive_share", "Positive-advantage share of the loss (rho)", "share of the loss",
          (Series("at the chosen bounds", ("bapo/positive_contribution",)),
           Series("at the start bounds", ("bapo/positive_contribution_before",), ":"))),
    Panel("clip_fractions", "Clipped tokens by advantage sign", "% of completion tokens",
          (Series("A > 0, ratio above c_high", ("bapo/clip_fraction_high", "clip_ratio/high_mean")),
           Series("A < 0, ratio below c_low", ("bapo/clip_fraction_low", "clip_ratio/low_mean"), "--")),
          scale=100.0),
    Panel("entropy_clip", "Entropy-Clip Rule: predicted entropy change (-Cov(log pi, A X))", "per unit lr",
          (Series("kept tokens (chosen window)", ("entropy_clip/predicted_change",)),
           Series("all tokens (no clipping)", ("entropy_clip/predicted_change_all",), ":"),
           Series("clip effect", ("entropy_clip/clip_effect",), "--")), optional=True),
    Panel("staleness", "Staleness of the trained tokens", "optimizer steps since sampling",
          (Series("all tokens (mean)", ("bapo/staleness_mean",)),
           Series("replayed tokens (mean)", ("replay/staleness_mean",), "--")), optional=True),
    Panel("replay_fraction", "Replayed share of each generation batch", "% of the batch",
          (Series("sequences", ("replay/fraction",)), Series("tokens", ("replay/token_fraction",), "--")),
          scale=100.0, optional=True),
    Panel("partial_rollout", "Partial rollout: how the scored completions were generated", "per scored completion",
          (Series("segments (policy versions)", ("partial/segments_per_completion",)),
           Series("resumes (steps carried)", ("partial/resumes_mean",), "--")), optional=True),
    Panel("async_time", "Async generation: where each generation batch's time went", "seconds per batch",
          (Series("server generating", ("async/generate_seconds",)),
           Series("trainer waiting for it", ("async/wait_seconds",), "--"),
           Series("weight push", ("async/push_seconds",), ":")), optional=True),
    Panel("async_age", "Async generation: positive share by token age", "share of the loss",
          (Series("age 0", ("bapo/positive_loss_share/age_0",)),
           Series("age 1", ("bapo/positive_loss_share/age_1",), "--"),
           Series("age 2", ("bapo/positive_loss_share/age_2",), "-."),
           Series("age 3+", ("bapo/positive_loss_share/age_3+",), ":")), optional=True),
)


# -- reading runs ---------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    return {"log_history": data} if isinstance(data, list) else data


def _last_step(state: dict) -> int:
    steps = [h.get("step", 0) for h in state.get("log_history", [])]
    return max([state.get("global_step", 0) or 0] + steps)


def load_run(run: str | os.PathLike) -> dict:
    """``{"log_history", "positive_contribution_target" (or None), "path"}`` of a run directory or JSON file.

    A directory may hold several histories (callback file, ``trainer_state.json``, checkpoints); the one that
    reaches the latest step wins, so a stale checkpoint never hides the end of the run.
    """
    run = os.fspath(run)
    if os.path.isfile(run):
        candidates = [run]
    elif os.path.isdir(run):
        checkpoints = glob.glob(os.path.join(glob.escape(run), "checkpoint-*", "trainer_state.json"))
        candidates = [p for p in (os.path.join(run, LOG_HISTORY_NAME), os.path.join(run, "trainer_state.json"))
                      if os.path.isfile(p)] + checkpoints
    else:
        raise FileNotFoundError(f"{run}: no such run directory or file.")
    if not candidates:
        raise FileNotFoundError(
            f"{run}: no {LOG_HISTORY_NAME} or trainer_state.json (top level or checkpoint-*/). Train with "
            "PlotDynamicsCallback, or call trainer.save_state(), or save checkpoints (save_strategy != 'no')."
        )
    states = [(_read_json(p), p) for p in candidates]
    state, path = max(states, key=lambda sp: _last_step(sp[0]))  # max keeps the first (preferred) of equals
    target = state.get("positive_contribution_target")
    if target is None:
        target = _target_from_model_card(os.path.dirname(os.path.abspath(path)))
    return {"log_history": state.get("log_history", []), "path": path, "positive_contribution_target": target}


def _target_from_model_card(folder: str) -> float | None:
    """rho0 from the BAPO section of the model card (``README.md``) that checkpointed runs write (the row
    :func:`~bapo_trl.trainer.model_card.bapo_card_section` writes, read back by its ``target_from_card``).

    ``trainer_state.json`` does not hold the training arguments, and ``training_args.bin`` is a pickle that a
    plotting tool should not unpickle.
    """
    from ..trainer.model_card import target_from_card

    for candidate in (folder, os.path.dirname(folder)):
        card = os.path.join(candidate, "README.md")
        if os.path.isfile(card):
            with open(card) as f:
                target = target_from_card(f.read())
            if target is not None:
                return target
    return None


def metric_series(log_history: Iterable[dict], key: str) -> tuple[list[float], list[float]]:
    """Optimizer steps and values of one logged metric (entries without it are skipped; ``None`` becomes NaN)."""
    steps, values = [], []
    for entry in log_history:
        if key in entry and "step" in entry:
            value = entry[key]
            steps.append(float(entry["step"]))
            values.append(float("nan") if value is None else float(value))
    return steps, values


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean over ``window`` points that ignores NaN.

    NaN where the window does not fit (the first and last ``window // 2`` points): a truncated window there
    bends periodic series such as staleness, and the raw values drawn underneath show those points anyway.
    Series shorter than the window are returned unsmoothed.
    """
    import numpy as np

    y = np.asarray(values, dtype=float)
    window = int(window)
    if window <= 1 or window > y.size:
        return y.tolist()
    finite = np.isfinite(y)
    kernel = np.ones(window)
    sums = np.convolve(np.where(finite, y, 0.0), kernel, mode="same")
    counts = np.convolve(finite.astype(float), kernel, mode="same")
    inside = np.convolve(np.ones(y.size), kernel, mode="same") == window
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(inside & (counts > 0), sums / np.maximum(counts, 1), np.nan).tolist()


def auto_window(num_points: int) -> int:
    """About 5% of the points: 8 for a 160-step run, none for 20 generation batches."""
    return max(1, num_points // 20)


def _has_data(values: Sequence[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def _resolve_runs(runs) -> list:
    """A single run (path or log-history list) or a list of them."""
    if isinstance(runs, (str, os.PathLike)):
        return [runs]
    runs = list(runs)
    if runs and all(isinstance(r, dict) for r in runs):  # one log history
        return [runs]
    return runs


# -- drawing --------------------------------------------------------------------------------------------------------


def plot_dynamics(runs, output: str | os.PathLike | None = None, labels: Sequence[str] | None = None,
                  target: float | None = None, smooth: int | None = None):
    """Draw the training dynamics of one or several runs; returns the ``matplotlib.figure.Figure``.

    Args:
        runs: run directories / JSON files (see the module docstring), ``trainer.state.log_history`` lists, or a
            list mixing them. Several runs are overlaid, one colour each.
        output: write a PNG there (``DPI`` dots per inch; parent directories are created).
        labels: one legend label per run (default: the directory name, or ``run 1``, ``run 2``...).
        target: the positive-share target rho0 to draw; default: the one stored with each run, if any.
        smooth: rolling-mean window in logged points (1 = raw only); default :func:`auto_window`.

    The figure carries ``fig.bapo_panels`` (panel names, in order) and ``fig.bapo_axes`` (name -> axes); every
    plotted (smoothed) line has the metric key as its gid and the run label as its label.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    loaded = []
    for i, run in enumerate(_resolve_runs(runs)):
        if isinstance(run, (str, os.PathLike)):
            info = load_run(run)
            path = os.path.abspath(os.fspath(run))
            default = os.path.basename(os.path.dirname(path) if os.path.isfile(path) else path.rstrip(os.sep))
        else:
            info = {"log_history": list(run), "positive_contribution_target": None}
            default = f"run {i + 1}"
        info["label"] = labels[i] if labels is not None and i < len(labels) else default
        loaded.append(info)
    if not loaded:
        raise ValueError("plot_dynamics needs at least one run.")
    if labels is not None and len(labels) != len(loaded):
        raise ValueError(f"{len(labels)} labels for {len(loaded)} runs.")

    def keys_logged(panel: Panel, run: dict) -> list[tuple[Series, str]]:
        found = []
        for series in panel.series:
            key = next((k for k in series.keys if _has_data(metric_series(run["log_history"], k)[1])), None)
            if key is not None:
                found.append((series, key))
        return found

    panels = [p for p in PANELS if not p.optional or any(keys_logged(p, run) for run in loaded)]
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(WIDTH, HEADER_HEIGHT + ROW_HEIGHT * nrows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels):]:
        ax.remove()

    fig.bapo_panels = [p.name for p in panels]
    fig.bapo_axes = {}
    for panel, ax in zip(panels, axes):
        fig.bapo_axes[panel.name] = ax
        drawn_styles = {}
        for index, run in enumerate(loaded):
            colour = f"C{index % 10}"
            for series, key in keys_logged(panel, run):
                steps, values = metric_series(run["log_history"], key)
                values = [v * panel.scale for v in values]
                window = smooth if smooth is not None else auto_window(len(values))
                if window > 1:
                    ax.plot(steps, values, color=colour, linestyle=series.linestyle, linewidth=0.7, alpha=0.25,
                            label="_raw")
                ax.plot(steps, rolling_mean(values, window), color=colour, linestyle=series.linestyle,
                        linewidth=1.8, label=run["label"], gid=series.keys[0])
                drawn_styles[series.label] = series.linestyle
        handles = [Line2D([], [], color="0.3", linestyle=ls, label=name) for name, ls in drawn_styles.items()]
        if panel.name == "positive_share":
            goals = {target if target is not None else run["positive_contribution_target"] for run in loaded}
            for goal in sorted(g for g in goals if g is not None):
                ax.axhline(goal, color="black", linestyle=(0, (5, 3)), linewidth=1.2, label="_target")
                handles.append(Line2D([], [], color="black", linestyle=(0, (5, 3)), label=f"target rho0 = {goal:g}"))
            ax.set_ylim(-0.02, 1.02)
        if panel.name == "clip_bounds" and drawn_styles:
            ax.axhline(1.0, color="0.6", linewidth=0.8, label="_ratio_one")
        if not drawn_styles:
            ax.text(0.5, 0.5, "not logged by these runs", transform=ax.transAxes, ha="center", va="center",
                    color="0.5")
        if len(handles) > 1:
            ax.legend(handles=handles, loc="best", fontsize="small", frameon=False)
        ax.set_title(panel.title, fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)

    window_note = "rolling mean over ~5% of the points" if smooth is None else f"rolling mean over {smooth} points"
    note = f"bold: {window_note}, faint: raw values" if smooth != 1 else "raw values"
    fig.legend(handles=[Line2D([], [], color=f"C{i % 10}", linewidth=2.5, label=run["label"])
                        for i, run in enumerate(loaded)],
               loc="outside upper center", ncols=min(len(loaded), 6), frameon=False, fontsize="large",
               title=f"BAPO training dynamics ({note})", title_fontsize="large")
    if output is not None:
        output = os.fspath(output)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        fig.savefig(output, dpi=DPI)
    return fig


# -- callback -------------------------------------------------------------------------------------------------------
