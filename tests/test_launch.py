"""Every accelerate config is launched for real (2 processes on CPU) and must prove it ran distributed.

Each launch runs `train_bapo.py` itself on the embedded tiny model for two steps. `launch_info/rank<N>.json`
(written by the script for every rank) says what the launch really did: a config that silently fell back to
two independent world-size-1 runs, or a ZeRO-3 run that did not partition the weights, fails here.
"""

import json

import pytest

from launching import REPO, accelerate_launch

pytestmark = pytest.mark.slow

CONFIGS = REPO / "accelerate_configs"
TRAIN = REPO / "train_bapo.py"
SHORT_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
             "--steps_per_generation", "2", "--max_completion_length", "8"]
# yaml-configured precision is bf16 for GPUs; on CPU it is turned off at launch (JSON configs use "auto").
NO_MIXED = ["--mixed_precision", "no"]

CASES = {
    "multi_gpu": dict(config="multi_gpu.yaml", launch=NO_MIXED, kind="MULTI_GPU", stage=None),
    "zero2": dict(config="deepspeed_zero2.yaml", launch=NO_MIXED, kind="DEEPSPEED", stage=2),
    "zero3": dict(config="deepspeed_zero3.yaml", launch=NO_MIXED, kind="DEEPSPEED", stage=3),
    "zero3_lora_ref": dict(config="deepspeed_zero3.yaml", launch=NO_MIXED, kind="DEEPSPEED", stage=3,
                           args=["--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                                 "--lora_target_modules", "q_proj", "v_proj", "--beta", "0.05"]),
    "zero3_offload": dict(config="deepspeed_zero3_offload.yaml", launch=[], kind="DEEPSPEED", stage=3),
    "zero3_json": dict(config="deepspeed_zero3_json.yaml", launch=[], kind="DEEPSPEED", stage=3),
}


def test_every_config_file_has_a_launch_test():
    assert {c["config"] for c in CASES.values()} | {"single_gpu.yaml"} == {p.name for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("name", list(CASES))
def test_launch_is_really_distributed(name, tmp_path):
    case = CASES[name]
    out = tmp_path / "run"
    proc = accelerate_launch(
        TRAIN, *SHORT_RUN, "--output_dir", out, *case.get("args", []),
        config_file=CONFIGS / case["config"], extra_launch=case["launch"], timeout=1200,
    )
    infos = [json.loads((out / "launch_info" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, info in enumerate(infos):
        assert info["rank"] == rank and info["world_size"] == 2
        assert info["distributed_type"] == ("MULTI_CPU" if case["kind"] == "MULTI_GPU" else case["kind"])
        assert info["zero_stage"] == case["stage"]
        if case["stage"] == 3:  # the weights really are split between the two ranks
            assert info["ds_partitioned_parameters"] > 0
            assert info["local_shard_numel"] < info["full_numel"]
    if "--use_peft" in case.get("args", []):
        assert infos[0]["trainable_parameters"] < infos[0]["num_parameters"] / 5
        assert (out / "adapter_model.safetensors").exists()
    else:
        assert (out / "model.safetensors").exists()
    assert "BAPO run summary" in proc.stdout


def test_single_process_config(tmp_path):
    """single_gpu.yaml on CPU: one process, no distribution (the laptop path)."""
    out = tmp_path / "run"
    accelerate_launch(TRAIN, *SHORT_RUN, "--output_dir", out, num_processes=1,
                      config_file=CONFIGS / "single_gpu.yaml", extra_launch=NO_MIXED)
    info = json.loads((out / "launch_info" / "rank0.json").read_text())
    assert info["world_size"] == 1 and info["distributed_type"] in ("NO", "CPU")


def test_two_processes_with_the_replay_queue(tmp_path):
    """DDP over gloo with replay on: each rank keeps its own queue, saves it, and replayed groups are trained."""
    out = tmp_path / "run"
    accelerate_launch(
        TRAIN, "--max_steps", "4", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--steps_per_generation", "2", "--max_completion_length", "8", "--replay_buffer_size", "8",
        "--replay_ratio", "0.5", "--save_strategy", "steps", "--save_steps", "4", "--output_dir", out,
        config_file=CONFIGS / "multi_gpu.yaml", extra_launch=NO_MIXED,
    )
    info = json.loads((out / "launch_info" / "rank1.json").read_text())
    assert info["world_size"] == 2
    checkpoint = out / "checkpoint-4"
    assert (checkpoint / "replay_queue_rank0.pt").exists() and (checkpoint / "replay_queue_rank1.pt").exists()
    logs = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert any(h.get("replay/fraction", 0) > 0 for h in logs)
    assert any(h.get("replay/staleness_mean") is not None for h in logs)


def test_two_processes_zero3_with_partial_rollout(tmp_path):
    """ZeRO-3 on 2 processes with partial rollout (transformers generation): every rank makes the same generate
    calls even when it has nothing to grow (the weights are gathered collectively), completions span steps, and each
    rank's pool is saved in the checkpoint."""
    out = tmp_path / "run"
    accelerate_launch(
        TRAIN, "--max_steps", "4", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--steps_per_generation", "1", "--max_completion_length", "10", "--partial_rollout_budget", "3",
        "--partial_rollout_max_resumes", "2", "--save_strategy", "steps", "--save_steps", "4", "--output_dir", out,
        config_file=CONFIGS / "deepspeed_zero3.yaml", extra_launch=NO_MIXED, timeout=1200,
    )
    info = json.loads((out / "launch_info" / "rank1.json").read_text())
    assert info["world_size"] == 2 and info["zero_stage"] == 3
    checkpoint = out / "checkpoint-4"
    assert (checkpoint / "partial_rollout_rank0.pt").exists() and (checkpoint / "partial_rollout_rank1.pt").exists()
    logs = [h for h in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(logs) == 4 and max(h["partial/segments_per_completion"] for h in logs) > 1
    assert max(h["partial/token_staleness_max"] for h in logs) >= 1
