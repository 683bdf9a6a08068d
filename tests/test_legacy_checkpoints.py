"""Checkpoints written before the rollout-source redesign (by the code of commit 0a2653b, tests/data/) still resume.

Each fixture's per-rank state files are loaded into today's sources (the probe records what each one holds right
after loading) and the run trains on from the saved step. Fast tier: replay + partial rollout + the closed-loop
target, through train_bapo.py's own job. Slow tier: async generation and async partial rollout, with the real vLLM
CPU server.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

import bapo_trl.trainer.checkpoints as checkpoints

FIXTURES = Path(__file__).parent / "data" / "checkpoints_0a2653b"

pytestmark = pytest.mark.usefixtures("use_test_cache")


@pytest.fixture
def loaded(monkeypatch):
    """``{stem: state_dict()}`` of every per-rank state object, right after the checkpoint was loaded into it."""
    seen = {}
    load = checkpoints.load_rank_states

    def recording(folder, states, *args, **kwargs):
        load(folder, states, *args, **kwargs)
        seen.update({stem: copy.deepcopy(obj.state_dict()) for stem, obj in states.items()  # before training
                     if (Path(folder) / f"{stem}_rank0.pt").exists()})

    monkeypatch.setattr(checkpoints, "load_rank_states", recording)
    return seen


def copy_fixture(name: str, out: Path) -> Path:
    checkpoint = out / "checkpoint-2"
    shutil.copytree(FIXTURES / name, checkpoint)
    return checkpoint


def saved(checkpoint: Path, stem: str) -> dict:
    return torch.load(checkpoint / f"{stem}_rank0.pt", weights_only=False)


def test_replay_partial_rollout_and_target_checkpoint_resumes(tmp_path, loaded):
    from bapo_trl.cli.train import make_parser, run

    checkpoint = copy_fixture("replay_partial_target", tmp_path / "out")
    argv = ["--max_steps", "4", "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--steps_per_generation", "2", "--replay_buffer_size", "8", "--replay_ratio", "0.5",
            "--partial_rollout_budget", "4", "--target_entropy", "1.0", "--num_train_prompts", "64", "--seed", "3",
            "--disable_tqdm", "true", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint",
            str(checkpoint)]
    trainer = run(argv, parser=make_parser())
    assert set(loaded) == {"replay_queue", "partial_rollout", "target_controller"}
    queue, pool, target = (saved(checkpoint, s) for s in ("replay_queue", "partial_rollout", "target_controller"))
    assert len(loaded["replay_queue"]["groups"]) == len(queue["groups"]) > 0
    assert loaded["replay_queue"]["totals"] == queue["totals"]
    for a, b in zip(loaded["replay_queue"]["groups"], queue["groups"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded["partial_rollout"] == pool and len(pool["groups"]) > 0
    assert loaded["target_controller"] == target
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert steps[-2:] == [3, 4] and 2 not in steps[len(steps) - 2:]  # trained on from the saved step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["async", "async_partial"])
def test_async_checkpoint_resumes_with_the_real_server(name, tiny_server, tiny_model_dir, tmp_path, loaded):
    from support.server_training import reset_server_weights, train_with_server

    reset_server_weights(tiny_server.url, tiny_model_dir)
    checkpoint = copy_fixture(name, tmp_path / "out")
    extra = dict(partial_rollout_budget=3) if name == "async_partial" else {}

    class Resumed(__import__("bapo_trl").BAPOTrainer):
        def train(self, *args, **kwargs):
            return super().train(resume_from_checkpoint=str(checkpoint))

    trainer = train_with_server(tiny_model_dir, tmp_path / "out", tiny_server.url, trainer_cls=Resumed,
                                async_generation=True, steps_per_generation=1, max_steps=4, **extra)
    state = saved(checkpoint, "async_generation")
    assert loaded["async_generation"]["batches_handed"] == state["batches_handed"] == 2
    if name == "async_partial":
        assert loaded["async_generation"]["pool"] == state["pool"]
    # steps 1-2 come from the checkpoint's trainer state; this run trained 3 and 4
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]
