"""The dynamics plot on a real short BAPO run: library function, command line and end-of-training callback."""

import json
import shutil
import subprocess
import sys

import matplotlib.image
import pytest

from bapo_trl.reporting.callbacks import PlotDynamicsCallback
from bapo_trl.reporting.dynamics import DPI, LOG_HISTORY_NAME, load_run, plot_dynamics

CORE = ["reward", "entropy", "clip_bounds", "positive_share", "clip_fractions", "entropy_clip", "staleness"]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """8 BAPO steps on stale data (4 steps per generation), checkpoints at steps 4 and 8, with the callback."""
    from support.harness import cpu_config, tiny_trainer

    out = tmp_path_factory.mktemp("plot") / "bapo-run"
    args = cpu_config(
        out, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1, seed=0,
        steps_per_generation=4, max_steps=8, learning_rate=5e-3, save_strategy="steps", save_steps=4,
        positive_contribution_target=0.45,
    )
    trainer = tiny_trainer(tiny_model_dir, args, model=tiny_model_dir, prompts=64,
                           callbacks=[PlotDynamicsCallback()])
    trainer.train()
    return out, trainer.state.log_history


@pytest.fixture(scope="module")
def replay_run(tiny_model_dir, tmp_path_factory):
    """A real short replay run (half of every batch's groups from the queue after the first step)."""
    from support.harness import cpu_config, tiny_trainer

    args = cpu_config(
        tmp_path_factory.mktemp("plot-replay"), save_strategy="no", per_device_train_batch_size=16,
        num_generations=4, max_completion_length=8, logging_steps=1, seed=0, steps_per_generation=1, max_steps=4,
        learning_rate=5e-3, replay_buffer_size=16, replay_ratio=0.5,
    )
    trainer = tiny_trainer(tiny_model_dir, args, model=tiny_model_dir, prompts=64)
    trainer.train()
    return trainer.state.log_history


def lines_by_metric(ax):
    groups = {}
    for line in ax.lines:
        if line.get_gid():
            groups.setdefault(line.get_gid(), []).append(line.get_label())
    return groups


def test_figure_has_the_panels_labels_and_target(run):
    _, history = run
    fig = plot_dynamics(history, target=0.45)
    assert fig.bapo_panels == CORE  # no replay in this run: no replay panel
    for name in CORE:
        ax = fig.bapo_axes[name]
        assert ax.get_title() and ax.get_ylabel() and ax.get_xlabel() == "optimizer step"
        assert lines_by_metric(ax), name
    assert set(lines_by_metric(fig.bapo_axes["clip_bounds"])) == {"bapo/clip_low", "bapo/clip_high"}
    targets = [ln for ln in fig.bapo_axes["positive_share"].lines if ln.get_label() == "_target"]
    assert [ln.get_ydata()[0] for ln in targets] == [0.45]


def test_two_runs_overlaid_and_replay_panel_when_logged(run, replay_run):
    _, history = run
    fig = plot_dynamics([history, replay_run], labels=["fresh", "replay"])  # two real runs, one with replay
    assert fig.bapo_panels == CORE + ["replay_fraction"]
    runs = {"fresh": history, "replay": replay_run}
    for name in CORE:
        for metric, labels in lines_by_metric(fig.bapo_axes[name]).items():  # one line per run that logged it
            assert labels == [label for label, h in runs.items() if any(metric in row for row in h)], (name, metric)
        assert len(fig.bapo_axes[name].lines) > 1
    assert lines_by_metric(fig.bapo_axes["replay_fraction"]) == {"replay/fraction": ["replay"],
                                                                 "replay/token_fraction": ["replay"]}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fresh", "replay"]
    # the panel draws what the replay run logged, and that run really replayed
    logged = [h["replay/fraction"] for h in replay_run if "replay/fraction" in h]
    (line,) = [ln for ln in fig.bapo_axes["replay_fraction"].lines if ln.get_gid() == "replay/fraction"]
    assert list(line.get_ydata()) == pytest.approx([100 * f for f in logged])  # drawn in percent
    assert max(logged) > 0


def test_run_directory_prefers_the_latest_history(run, tmp_path):
    out, history = run
    assert load_run(out)["path"].endswith(LOG_HISTORY_NAME)
    assert load_run(out)["positive_contribution_target"] == 0.45
    only_checkpoints = tmp_path / "ckpts"
    for step in (4, 8):
        shutil.copytree(out / f"checkpoint-{step}", only_checkpoints / f"checkpoint-{step}")
    newest = load_run(only_checkpoints)
    assert newest["path"].endswith("checkpoint-8/trainer_state.json")
    assert max(h["step"] for h in newest["log_history"]) == 8
    assert newest["positive_contribution_target"] is None  # no history file and no model card: rho0 unknown
    shutil.copy(out / "README.md", only_checkpoints / "README.md")  # the run's model card, with its BAPO section
    assert load_run(only_checkpoints)["positive_contribution_target"] == 0.45
    with pytest.raises(FileNotFoundError, match="PlotDynamicsCallback"):
        load_run(tmp_path)


def test_callback_writes_png_and_history(run):
    out, history = run
    png = matplotlib.image.imread(out / "dynamics.png")
    assert png.shape[0] > 500 and png.shape[1] == 12 * DPI
    saved = json.loads((out / LOG_HISTORY_NAME).read_text())
    assert saved["global_step"] == 8 and saved["positive_contribution_target"] == 0.45
    assert [h["step"] for h in saved["log_history"]] == [h["step"] for h in history]


def test_command_line_overlays_runs_and_writes_png_of_the_figure_size(run, tmp_path):
    out, history = run
    second = tmp_path / "second"
    second.mkdir()
    (second / "trainer_state.json").write_text(json.dumps({"global_step": 8, "log_history": history}))
    png = tmp_path / "sub" / "dynamics.png"
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.cli.plot", str(out), str(second), "-o", str(png),
                           "--labels", "a", "b"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "panels: " + ", ".join(CORE) in proc.stdout
    expected = plot_dynamics([out, second], labels=["a", "b"]).get_size_inches() * DPI
    assert matplotlib.image.imread(png).shape[:2] == (round(expected[1]), round(expected[0]))

    bad = subprocess.run([sys.executable, "-m", "bapo_trl.cli.plot", str(tmp_path / "nothing"), "-o", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such run directory" in bad.stderr and "Traceback" not in bad.stderr
