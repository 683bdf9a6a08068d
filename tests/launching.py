"""Helpers to run real `accelerate launch` jobs from tests: a free port each, one at a time, results in files."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(script, *args, num_processes=2, config_file=None, extra_launch=(), timeout=900, env=None,
                      python=sys.executable):
    """Run `accelerate launch` (with ``python``'s environment) and return the CompletedProcess; raise with the tail of
    the output on failure."""
    cmd = [python, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
           "--main_process_port", str(free_port())]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    else:
        cmd += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += list(extra_launch) + [str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def assert_zero3_partitioned(out, world_size: int = 2) -> list[dict]:
    """Every rank's ``launch_info`` record (written by train_bapo.py) shows a real ZeRO-3 run whose weights are split
    between the ranks; returns the records."""
    import json

    infos = [json.loads((Path(out) / "launch_info" / f"rank{r}.json").read_text()) for r in range(world_size)]
    for rank, info in enumerate(infos):
        assert info["rank"] == rank and info["world_size"] == world_size
        assert info["distributed_type"] == "DEEPSPEED" and info["zero_stage"] == 3
        assert info["ds_partitioned_parameters"] > 0 and info["local_shard_numel"] < info["full_numel"]
    return infos
