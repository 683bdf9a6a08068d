"""Multi-process launches of async generation shared by test modules: train_bapo.py under ZeRO-3 on 2 processes,
async K=1 through a server."""

from __future__ import annotations


def zero3_async_from_train_bapo(server_url: str, out, *extra) -> tuple[str, list[float]]:
    """`accelerate launch` of train_bapo.py, ZeRO-3 on 2 processes, 4 steps of async K=1 through the server at
    ``server_url`` (``extra``: more flags); checks that ZeRO-3 partitioned the weights and that the first batch was
    fresh and every later one a step stale; returns the launch's output and the logged staleness per step."""
    from support.launching import REPO, accelerate_launch, assert_zero3_partitioned

    proc = accelerate_launch(
        REPO / "train_bapo.py", "--max_steps", "4",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "1",
        "--logging_steps", "1", "--output_dir", out, *extra,
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", server_url,
        "--async_generation", "--max_staleness", "1",
        config_file=REPO / "accelerate_configs" / "deepspeed_zero3.yaml", extra_launch=["--mixed_precision", "no"],
        timeout=1200,
    )
    from support.run_logs import values

    assert_zero3_partitioned(out)
    text = proc.stdout + proc.stderr
    staleness = values(out, "async/staleness_max")
    assert len(staleness) == 4 and staleness[0] == 0 and min(staleness[1:]) >= 1, staleness
    return text, staleness
