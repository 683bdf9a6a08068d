"""Nothing a user trained is lost: kill -9 inside the write of a checkpoint, resume, and the run continues from the
complete checkpoint before it exactly like one that was never interrupted (CPU, fixed seed), with replay, partial
rollout (beside a second run, no server), and async generation against the real vLLM CPU server. The complete
checkpoint is in the MIDDLE of a generation batch (step 3 of batches of 4 updates): the resumed run trains the rest
of that batch, then generates what the uninterrupted run generated. The kill lands at a point the run itself signals
(no timing): inside the save of checkpoint-6, once its weights and per-rank state are on disk and before its
optimizer, trainer state and marker. (Replay's state through resumes from every checkpoint: the guarantee rows of
tests/test_guarantees.py and the 2-process replay launch of tests/test_launch.py; the kill itself does not depend on
the source.)

CPU runs are deterministic, so a run that ignored the checkpoint and started over would log the same history: the
test also checks that the resumed process ran only the steps after the checkpoint and left the checkpoint alone."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from support.launching import REPO
from support.server_training import reset_server_weights

pytestmark = pytest.mark.slow

STEPS = 12
RUN = ["--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "3", "--steps_per_generation", "4",
       "--per_device_train_batch_size", "16", "--disable_tqdm", "true", "--seed", "5"]
SOURCES = {
    "partial": ["--partial_rollout_budget", "4"],
    "async": ["--use_vllm", "--vllm_mode", "server", "--async_generation"],  # + the server's URL
}
CHECKPOINT = 3  # mid-batch: 4 updates per generation batch
TORN = 2 * CHECKPOINT  # the checkpoint whose write the kill cuts short

# train_bapo.py, except that the save of checkpoint-<step> stops once the weights and the per-rank state are on disk
# (transformers saves the optimizer next), touches <event> and waits there to be killed.
STOP_IN_SAVE = """
import pathlib, runpy, sys, threading
event, step, script = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
from bapo_trl import BAPOTrainer
save = BAPOTrainer._save_optimizer_and_scheduler
def stop_in_save(self, output_dir):
    if self.state.global_step == step:
        event.touch()
        threading.Event().wait()
    save(self, output_dir)
BAPOTrainer._save_optimizer_and_scheduler = stop_in_save
sys.argv = sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def train(out, *extra, env, logs, source=(), stop_in_save=None):
    """Start train_bapo.py (``stop_in_save=(event, step)``: under STOP_IN_SAVE); its stdout and stderr go to files (a
    pipe nobody reads can fill up and block the child)."""
    script = [str(REPO / "train_bapo.py")]
    if stop_in_save is not None:
        script = ["-c", STOP_IN_SAVE, str(stop_in_save[0]), str(stop_in_save[1]), *script]
    with open(logs.with_suffix(".out"), "w") as stdout, open(logs.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen([sys.executable, *script, *RUN, *source, "--output_dir", str(out), *extra], env=env,
                                stdout=stdout, stderr=stderr, text=True)


def tail(logs):
    return logs.with_suffix(".err").read_text()[-3000:]


def history(out):
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return {h["step"]: h for h in state["log_history"] if "loss" in h}


def steps_logged(out) -> list[int]:
    """The training steps logged into ``out``'s metrics.jsonl, in order (one per step: logging_steps=1; a resumed
    run keeps the lines up to its checkpoint and logs the rest)."""
    from support.run_logs import training_steps

    return training_steps(out)


def fingerprint(folder):
    """Name -> (size, mtime_ns, sha256) of every file in a checkpoint folder."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def source_flags(request, tmp_path, monkeypatch):
    """The flags of the source under test; for async, the real vLLM CPU server started on the embedded model."""
    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    flags = list(SOURCES[request.param])
    if request.param == "async":
        # the embedded model, where train_bapo.py resolves it in the session's test cache: the tiny server serves it
        model_dir = request.getfixturevalue("tiny_model_dir")
        monkeypatch.setenv("BAPO_TRL_CACHE", str(request.getfixturevalue("test_cache")))
        server = request.getfixturevalue("start_server")(model_dir)
        reset_server_weights(server.url, model_dir)  # an earlier test trained the shared server's weights
        flags += ["--vllm_server_base_url", server.url, "--vllm_server_timeout", "60"]
        monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    return request.param, flags


# side_by_side: partial trains on its own cache with no server (about one core); async shares the
# session's server, so it runs one at a time
@pytest.mark.parametrize("source_flags", [s if s == "async" else pytest.param(s, marks=pytest.mark.side_by_side)
                                          for s in SOURCES], indirect=True)
def test_kill_9_then_resume_continues_exactly(source_flags, tmp_path):
    name, flags = source_flags
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    reference = train(tmp_path / "reference", env=env, logs=tmp_path / "reference-log", source=flags)
    assert reference.wait(timeout=600) == 0, tail(tmp_path / "reference-log")
    assert steps_logged(tmp_path / "reference") == list(range(1, STEPS + 1))

    event = tmp_path / "inside-the-save"
    victim = train(tmp_path / "victim", env=env, logs=tmp_path / "victim-log", source=flags,
                   stop_in_save=(event, TORN))
    deadline = time.time() + 600
    while not event.exists():
        assert victim.poll() is None, "the run ended before the save it stops in"
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # the run waits inside the save: the kill lands there, however late it comes
    victim.wait()
    assert victim.returncode == -signal.SIGKILL

    # The write of checkpoint-6 was cut short (new weights on disk, no optimizer): no marker, so
    # `--resume_from_checkpoint latest` takes checkpoint-3, which that write left alone.
    kept, torn = f"checkpoint-{CHECKPOINT}", tmp_path / "victim" / f"checkpoint-{TORN}"
    assert {n for n in os.listdir(tmp_path / "victim") if n.startswith("checkpoint-")} == {kept, torn.name}
    assert (torn / "model.safetensors").exists() and not (torn / "optimizer.pt").exists()
    assert not (torn / "bapo_checkpoint_complete.json").exists()
    assert (tmp_path / "victim" / kept / "bapo_checkpoint_complete.json").exists()

    before = fingerprint(tmp_path / "victim" / kept)
    assert steps_logged(tmp_path / "victim")[-1] > CHECKPOINT  # the crashed run logged steps past its checkpoint

    resumed = train(tmp_path / "victim", "--resume_from_checkpoint", "latest", env=env, logs=tmp_path / "resumed-log",
                    source=flags)
    assert resumed.wait(timeout=600) == 0, tail(tmp_path / "resumed-log")

    # It resumed (a fresh start would rewrite the checkpoint at step 3), and metrics.jsonl holds each step once: the
    # crashed run's lines past the checkpoint were dropped, not logged twice (issue 75, finding 7).
    assert steps_logged(tmp_path / "victim") == list(range(1, STEPS + 1))
    assert fingerprint(tmp_path / "victim" / kept) == before
    assert (torn / "bapo_checkpoint_complete.json").exists() and (torn / "optimizer.pt").exists()  # written again

    ref, res = history(tmp_path / "reference"), history(tmp_path / "victim")
    assert sorted(ref) == sorted(res) == list(range(1, STEPS + 1))  # equal lengths before comparing step by step
    for step in range(CHECKPOINT + 1, STEPS + 1):
        for key in ("loss", "grad_norm", "bapo/clip_low", "bapo/clip_high", "bapo/positive_contribution",
                    "replay/size", "replay/fraction", "reward", "partial/carried", "async/staleness_max"):
            if key in ref[step]:
                assert res[step][key] == pytest.approx(ref[step][key], abs=1e-5, nan_ok=True), (step, key)
    a = load_file(tmp_path / "reference" / f"checkpoint-{STEPS}" / "model.safetensors")
    b = load_file(tmp_path / "victim" / f"checkpoint-{STEPS}" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    state_file = {"replay": "replay_queue", "partial": "partial_rollout", "async": "async_generation"}[name]
    for file in (f"{state_file}_rank0.pt", "generation_batch_rank0.pt", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth"):
        assert (tmp_path / "victim" / f"checkpoint-{STEPS}" / file).exists(), file
