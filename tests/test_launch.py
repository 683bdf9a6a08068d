"""Every accelerate config is launched for real (2 processes on CPU) and must prove it ran distributed.

Each launch runs `train_bapo.py` itself on the embedded tiny model for a few steps. `launch_info/rank<N>.json`
(written by the script for every rank) says what the launch really did: a config that silently fell back to
two independent world-size-1 runs, or a ZeRO-3 run that did not partition the weights, fails here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from support.launching import (
    PORT_ATTEMPTS,
    REPO,
    accelerate_launch,
    assert_zero3_partitioned,
    free_port,
    launch_infos,
    port_clash,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("use_test_cache")]

CONFIGS = REPO / "accelerate_configs"
TRAIN = REPO / "train_bapo.py"
SHORT_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
             "--steps_per_generation", "2", "--max_completion_length", "8"]
# yaml-configured precision is bf16 for GPUs; on CPU it is turned off at launch (JSON configs use "auto").
NO_MIXED = ["--mixed_precision", "no"]

# multi_gpu.yaml and deepspeed_zero3.yaml plain are launched (and their topology checked) by
# test_two_processes_with_the_replay_queue and test_two_processes_zero3_with_partial_rollout below.
LAUNCHED_ELSEWHERE = {"multi_gpu.yaml", "deepspeed_zero3.yaml"}
CASES = {
    "zero2": dict(config="deepspeed_zero2.yaml", launch=NO_MIXED, kind="DEEPSPEED", stage=2),
    "zero3_lora_ref": dict(config="deepspeed_zero3.yaml", launch=NO_MIXED, kind="DEEPSPEED", stage=3,
                           args=["--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                                 "--lora_target_modules", "q_proj", "v_proj", "--beta", "0.05"]),
    "zero3_offload": dict(config="deepspeed_zero3_offload.yaml", launch=[], kind="DEEPSPEED", stage=3),
    "zero3_json": dict(config="deepspeed_zero3_json.yaml", launch=[], kind="DEEPSPEED", stage=3),
    # deepspeed_configs/zero2.json, through the JSON accelerate config with its file swapped (no yaml ships for it)
    "zero2_json": dict(config="deepspeed_zero3_json.yaml", launch=[], kind="DEEPSPEED", stage=2,
                       json="deepspeed_configs/zero2.json"),
}
DEEPSPEED_JSONS = REPO / "deepspeed_configs"


def config_for(case, tmp_path):
    """The accelerate config file of a case (a copy pointing at another DeepSpeed JSON when the case names one)."""
    path = CONFIGS / case["config"]
    if "json" not in case:
        return path
    text = path.read_text()
    assert "deepspeed_configs/zero3.json" in text and "zero3_init_flag: true" in text
    text = text.replace("deepspeed_configs/zero3.json", case["json"]).replace("zero3_init_flag: true",
                                                                             "zero3_init_flag: false")
    copy = tmp_path / f"accelerate-{os.path.basename(case['json'])}.yaml"
    copy.write_text(text)
    return copy


def test_every_config_file_has_a_launch_test():
    assert ({c["config"] for c in CASES.values()} | {"single_gpu.yaml"} | LAUNCHED_ELSEWHERE
            == {p.name for p in CONFIGS.glob("*.yaml")})
    used = {c["json"] for c in CASES.values() if "json" in c}
    for config in {c["config"] for c in CASES.values()} | LAUNCHED_ELSEWHERE:
        text = (CONFIGS / config).read_text()
        used |= {f"deepspeed_configs/{p.name}" for p in DEEPSPEED_JSONS.glob("*.json") if p.name in text}
    assert used == {f"deepspeed_configs/{p.name}" for p in DEEPSPEED_JSONS.glob("*.json")}


@pytest.mark.parametrize("name", list(CASES))
def test_launch_is_really_distributed(name, tmp_path):
    case = CASES[name]
    out = tmp_path / "run"
    proc = accelerate_launch(
        TRAIN, *SHORT_RUN, "--output_dir", out, *case.get("args", []),
        config_file=config_for(case, tmp_path), extra_launch=case["launch"], timeout=1200,
    )
    if case["stage"] == 3:  # the weights really are split between the two ranks
        infos = assert_zero3_partitioned(out)
    else:
        infos = launch_infos(out)
    assert_two_ranks(infos, case["kind"], case["stage"])
    if "--use_peft" in case.get("args", []):
        assert infos[0]["trainable_parameters"] < infos[0]["num_parameters"] / 5
        assert (out / "adapter_model.safetensors").exists()
    else:
        assert (out / "model.safetensors").exists()
    assert "BAPO run summary" in proc.stdout


def assert_two_ranks(infos: list[dict], kind: str, stage: int | None) -> None:
    """Each launch_info record shows a world of 2 of the config's kind (DDP runs as MULTI_CPU here) and ZeRO stage."""
    for rank, info in enumerate(infos):
        assert info["rank"] == rank and info["world_size"] == 2
        assert info["distributed_type"] == ("MULTI_CPU" if kind == "MULTI_GPU" else kind)
        assert info["zero_stage"] == stage


@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_single_process_config(tmp_path):
    """single_gpu.yaml on CPU: one process, no distribution (the laptop path)."""
    out = tmp_path / "run"
    accelerate_launch(TRAIN, *SHORT_RUN, "--output_dir", out, num_processes=1,
                      config_file=CONFIGS / "single_gpu.yaml", extra_launch=NO_MIXED)
    info = json.loads((out / "launch_info" / "rank0.json").read_text())
    assert info["world_size"] == 1 and info["distributed_type"] in ("NO", "CPU")


def test_two_processes_with_the_replay_queue(tmp_path):
    """DDP over gloo with replay wrapped around partial rollout: each rank keeps its own queue and pool, saves them,
    and replayed groups are trained. A second launch resumes from the checkpoint in the MIDDLE of a generation batch
    (step 3 of batches of 2 updates) and continues exactly as the uninterrupted run did on both ranks: it runs
    steps 4-6 only, with the same metrics (gathered from both ranks) at every later step and the same final weights
    (CPU, fixed seed)."""
    run = ["--max_steps", "6", "--per_device_train_batch_size", "8", "--num_generations", "4",
           "--steps_per_generation", "2", "--max_completion_length", "8", "--replay_buffer_size", "8",
           "--replay_ratio", "0.5", "--replay_max_staleness", "8", "--partial_rollout_budget", "4",
           "--save_strategy", "steps", "--save_steps", "3", "--seed", "3"]
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    proc = accelerate_launch(TRAIN, *run, "--output_dir", out, config_file=CONFIGS / "multi_gpu.yaml",
                             extra_launch=NO_MIXED)
    assert_two_ranks(launch_infos(out), "MULTI_GPU", None)
    assert "BAPO run summary" in proc.stdout and (out / "model.safetensors").exists()
    checkpoint = out / "checkpoint-6"
    for state in ("replay_queue", "partial_rollout"):
        assert (checkpoint / f"{state}_rank0.pt").exists() and (checkpoint / f"{state}_rank1.pt").exists()
    logs = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert any(h.get("replay/fraction", 0) > 0 for h in logs)
    assert any(h.get("replay/staleness_mean") is not None for h in logs)

    proc = accelerate_launch(TRAIN, *run, "--output_dir", resumed, "--resume_from_checkpoint", out / "checkpoint-3",
                             config_file=CONFIGS / "multi_gpu.yaml", extra_launch=NO_MIXED)
    # It resumed (a deterministic fresh start would end the same): rank 0 logged steps 4-6 only, and wrote no
    # checkpoint-3 of its own.
    from support.run_logs import training_steps

    assert training_steps(resumed) == [4, 5, 6], proc.stdout[-3000:]
    assert not (resumed / "checkpoint-3").exists() and (resumed / "checkpoint-6").exists()
    reference = {h["step"]: h for h in logs if "loss" in h}
    again = {h["step"]: h for h in json.loads((resumed / "checkpoint-6" / "trainer_state.json").read_text())[
        "log_history"] if "loss" in h}
    assert sorted(again) == sorted(reference) == list(range(1, 7))  # steps 1-3 come from the checkpoint's history
    compared = set()
    for step in range(4, 7):
        assert again[step].keys() == reference[step].keys(), step
        for key in ("loss", "grad_norm", "reward", "bapo/clip_low", "bapo/clip_high", "replay/fraction",
                    "replay/size", "partial/carried"):
            if key in reference[step]:  # the generation metrics are logged at the steps that generate
                assert again[step][key] == pytest.approx(reference[step][key], abs=1e-5, nan_ok=True), (step, key)
                compared.add(key)
    assert {"loss", "reward", "bapo/clip_high", "replay/fraction", "partial/carried"} <= compared, compared
    a, b = (load_file(folder / "checkpoint-6" / "model.safetensors") for folder in (out, resumed))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_two_processes_zero3_with_partial_rollout(tmp_path):
    """ZeRO-3 on 2 processes with partial rollout (transformers generation): every rank makes the same generate
    calls even when it has nothing to grow (the weights are gathered collectively), completions span steps, and each
    rank's pool is saved in the checkpoint."""
    out = tmp_path / "run"
    proc = accelerate_launch(
        TRAIN, "--max_steps", "4", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--steps_per_generation", "1", "--max_completion_length", "10", "--partial_rollout_budget", "3",
        "--partial_rollout_max_resumes", "2", "--save_strategy", "steps", "--save_steps", "4", "--output_dir", out,
        config_file=CONFIGS / "deepspeed_zero3.yaml", extra_launch=NO_MIXED, timeout=1200,
    )
    assert_zero3_partitioned(out)  # a world of 2, ZeRO-3, the weights really split between the ranks
    assert "BAPO run summary" in proc.stdout and (out / "model.safetensors").exists()
    checkpoint = out / "checkpoint-4"
    assert (checkpoint / "partial_rollout_rank0.pt").exists() and (checkpoint / "partial_rollout_rank1.pt").exists()
    logs = [h for h in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(logs) == 4 and max(h["partial/segments_per_completion"] for h in logs) > 1
    assert max(h["partial/token_staleness_max"] for h in logs) >= 1


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_deepspeed_bf16_config_on_cpu_fails_with_one_actionable_line(tmp_path):
    """The DeepSpeed configs ask for bf16; on this CPU machine, launched without `--mixed_precision no`, the job
    used to end in DeepSpeed's "config values mismatch" on every rank. Now: one line saying what to pass."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for attempt in range(PORT_ATTEMPTS):  # a port found free may be taken before the launcher binds it: a new one
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml"), "--num_processes", "1",
               "--main_process_port", str(free_port()), "train_bapo.py", "--max_steps", "1", "--output_dir",
               str(tmp_path)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if not port_clash(proc.stderr) or attempt == PORT_ATTEMPTS - 1:
            break
    assert proc.returncode != 0
    assert "error: the accelerate config asks DeepSpeed for mixed_precision bf16" in proc.stderr
    assert "add `--mixed_precision no` to `accelerate launch`" in proc.stderr
    # the only traceback left is torchrun's report that its child exited with 2; none from train_bapo.py's process
    assert "config values mismatch" not in proc.stderr
    assert f'File "{REPO / "bapo_trl"}' not in proc.stderr and f'File "{REPO / "train_bapo.py"}' not in proc.stderr


def test_launch_check_reads_accelerate_variables():
    from bapo_trl.cli.launch_info import launch_errors

    class Args:
        bf16, fp16 = False, False

    ds_bf16 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert "--mixed_precision no" in launch_errors(Args, ds_bf16, cuda_available=False)[0]
    assert "`--bf16 True`" in launch_errors(Args, ds_bf16, cuda_available=True)[0]
    Args.bf16 = True
    assert launch_errors(Args, ds_bf16, cuda_available=True) == []
    assert launch_errors(Args, {"ACCELERATE_MIXED_PRECISION": "bf16"}, cuda_available=False) == []  # no DeepSpeed


def test_the_embedded_model_built_by_rank_1_is_complete(tmp_path):
    """Under an initialised process group transformers' save_pretrained writes on rank 0 only: a rank-1 build once
    produced a 'complete' directory without config or weights (first multi-process launch on a fresh machine)."""
    accelerate_launch(REPO / "tests" / "dist_scripts" / "build_on_rank1.py", tmp_path)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["initialized"] and {"config.json", "model.safetensors"} <= set(seen["files"])
        assert seen["parameters"] > 0


def test_two_processes_replace_an_earlier_run_once_both_have_built_their_trainers(tmp_path):
    """``--overwrite_output_dir`` over an earlier run, 2 processes: the main process removes it once the trainers
    accepted the settings, the other waits at the same barrier (each decides as the main process saw the folder: one
    that looked after the removal would skip the barrier and hang the launch), and the run writes its own files."""
    out = tmp_path / "run"
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        (out / checkpoint).mkdir(parents=True)
        for name in ("model.safetensors", "trainer_state.json", "bapo_checkpoint_complete.json"):
            (out / checkpoint / name).write_text("old")
    for name in ("metrics.jsonl", "model.safetensors", "README.md"):
        (out / name).write_text("old")
    proc = accelerate_launch(TRAIN, *SHORT_RUN, "--output_dir", out, "--overwrite_output_dir",
                             config_file=CONFIGS / "multi_gpu.yaml", extra_launch=NO_MIXED, timeout=600)
    assert_two_ranks(launch_infos(out), "MULTI_GPU", None)
    assert "replaced the earlier run" in proc.stdout and "BAPO run summary" in proc.stdout
    assert not any(name.startswith("checkpoint-") for name in os.listdir(out))
    assert (out / "model.safetensors").read_bytes() != b"old" and (out / "metrics.jsonl").read_text() != "old"


#: tests/support/failing_backend_launch.py's cases: (the process whose backend fails, its error, the other's error).
FAILING_BACKEND = {
    "sync": (1, "RuntimeError: the sampler of process 1 is down",
             "RuntimeError: generation backend 'fails_on_process_one': sampling: on process 1: RuntimeError: the "
             "sampler of process 1 is down"),
    "checkpoint": (0, "RuntimeError: the sampler failed on the batch generated ahead",
                   "RuntimeError: checkpoint: collecting the rollout state failed: on process 0: RuntimeError: the "
                   "sampler failed on the batch generated ahead"),
}


@pytest.mark.parametrize("case", list(FAILING_BACKEND))
def test_a_backend_that_fails_on_one_process_ends_the_run_on_every_process(case, tmp_path):
    """A generation backend of the user's own raising on one process only ends the run with an error on every process
    (each records its error in a file) instead of leaving the other to enter the next collective alone. ``sync``: the
    synchronous source, each process samples its own prompts, process 1's fails. ``checkpoint``: async generation, the
    batch generated ahead fails while the checkpoint after step 1 waits for it on the main process; nothing of that
    checkpoint is written. Seen failing without each fix: the launch still ended, but the other process raised nothing
    of its own (``sync``: accelerate's launcher stopped it once process 1 had exited; ``checkpoint``: gloo's
    "Connection closed by peer" once process 0 had exited); where neither happens (not measured: across machines,
    NCCL) it would wait in the collective."""

    failing, its_error, other_error = FAILING_BACKEND[case]
    other = 1 - failing
    script = REPO / "tests" / "support" / "failing_backend_launch.py"
    try:
        accelerate_launch(script, tmp_path / "out", case, config_file=CONFIGS / "multi_gpu.yaml",
                          extra_launch=NO_MIXED, timeout=240)
    except AssertionError as failed:
        output = str(failed)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launch did not end: process {other} waited for process {failing}, whose sampling failed")
    else:
        pytest.fail(f"the launch succeeded although process {failing}'s sampler raised")
    assert its_error.split(": ", 1)[1] in output
    errors = {rank: (tmp_path / "out" / f"error_rank{rank}.txt") for rank in (0, 1)}
    assert errors[failing].read_text() == its_error
    assert errors[other].exists(), f"process {other} raised nothing: it was stopped inside a collective"
    assert other_error in errors[other].read_text()
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_trls_push_failing_on_the_main_process_under_zero3_raises_on_every_process(tiny_model_dir, tmp_path):
    """TRL's weight push (CUDA's NCCL path, here through a stand-in client: tests/dist_scripts/trl_push_failure.py)
    failing on the main process, at once (the server gone), part-way through the walk, or at the prefix-cache
    reset, raises on both ranks of a ZeRO-3 launch, each after walking every weight (the gathers are collectives),
    and the next push goes through whole; so does colocate's push failing on rank 1 before TRL's walk begins there
    (vLLM's sleep mode: its engine's wake-up; a stand-in engine). Seen failing on the old code: the main process
    raised at once and went on to the next case's collectives while rank 1 was still gathering weights; here gloo
    then aborted the launch (rank 1: "Connection reset by peer"); where the mismatch is not detected (NCCL) a rank
    waits until the process group's timeout. The colocate case was seen failing without the walks made for one not
    begun (gloo aborted the launch). Last, the disk path's restart check before TRL's generate failing on the main
    process raises on both ranks, and so do the CPU colocate reload failing on rank 1 and the disk push's gather
    whose copy fails on the main process, after both walked every weight (review s8, F3, F4), and TRL's generate
    whose request fails on the main process (F6: the other rank waited in TRL's broadcast)."""
    script = REPO / "tests" / "dist_scripts" / "trl_push_failure.py"
    try:
        accelerate_launch(script, tiny_model_dir, tmp_path, config_file=CONFIGS / "deepspeed_zero3.yaml",
                          extra_launch=NO_MIXED, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the launch did not end: a rank waited in a collective for the main process, whose push failed")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    weights = ranks[0]["parameters"]
    for rank, record in enumerate(ranks):
        assert record["world_size"] == 2 and record["zero3"], record
        cases = record["cases"]
        for case in ("push fails at once", "push fails part-way", "prefix-cache reset fails"):
            error = cases[case]["error"]
            assert error is not None and "stand-in" in error, (rank, case, error)
            assert rank == 0 or error.startswith("RuntimeError: pushing the weights: on process 0: ConnectionError")
        # every rank walked every weight in every case (the first push also walks them for TRL's metadata)
        assert cases["push fails at once"]["walked"] == 2 * weights, (rank, cases)
        pushes = [case for case in cases if "walked" in cases[case]]
        assert all(cases[case]["walked"] == weights for case in pushes[1:]), (rank, cases)
        assert cases["push succeeds"]["error"] is None
    received = {case: value["received"] for case, value in ranks[0]["cases"].items() if "received" in value}
    assert received == {"push fails at once": 0, "push fails part-way": 5, "prefix-cache reset fails": weights,
                        "push succeeds": weights, "colocate wake-up fails on rank 1": weights}
    colocate = [record["cases"]["colocate wake-up fails on rank 1"] for record in ranks]
    assert colocate[1]["error"] == "RuntimeError: the engine could not wake up (stand-in)"
    assert colocate[1]["received"] == 0
    assert colocate[0]["error"].startswith("RuntimeError: pushing the weights: on process 1: RuntimeError: the engine")
    assert colocate[0]["walked"] == colocate[1]["walked"] == weights  # rank 1 walked with rank 0 all the same
    checks = [record["cases"]["restart check fails on the main process"]["error"] for record in ranks]
    assert checks == ["WeightSyncError: the vLLM server is gone (stand-in)",
                      "WeightSyncError: on the main process: WeightSyncError: the vLLM server is gone (stand-in)"]
    reloads = [record["cases"]["colocate reload fails on rank 1"]["error"] for record in ranks]
    failed = "RuntimeError: the engine could not reload the weights (stand-in)"
    assert reloads == [f"RuntimeError: pushing the weights: on process 1: {failed}", failed]
    gathers = [record["cases"]["disk gather fails on the main process"]["error"] for record in ranks]
    assert gathers == ["RuntimeError: host memory exhausted (stand-in)", "RuntimeError: gathering the weights: on "
                       "process 0: RuntimeError: host memory exhausted (stand-in)"]
    generations = [record["cases"]["generation fails on the main process"]["error"] for record in ranks]
    assert generations == ["ConnectionError: the server is gone (stand-in)", "RuntimeError: generation on the main "
                           "process: ConnectionError: the server is gone (stand-in)"]
