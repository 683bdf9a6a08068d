"""Helpers to run real `accelerate launch` jobs from tests: a free port each, one at a time, results in files."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_quick(script: str, *args: str) -> str:
    """``benchmarks/<script> --quick *args`` in a process of its own; its last line (the machine-readable summary)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout.strip().splitlines()[-1]


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


def accelerate_launch_machines(script, *args, num_machines=2, processes_per_machine=1, config_file=None,
                               extra_launch=(), timeout=900, env=None, machine_env=None, python=sys.executable,
                               log_dir=None):
    """Run one `accelerate launch` per "machine", all on this host: ``--num_machines N --machine_rank R
    --main_process_ip 127.0.0.1 --main_process_port P`` (the same free port for all), as a user starts them on N
    nodes. ``machine_env`` (optional) maps a machine rank to environment variables of that launcher only. Returns
    the output (stdout + stderr) of each launcher, by machine rank; raises with the tails when one fails, after ending
    the others (only the process groups started here)."""
    import signal
    import tempfile
    import time

    port = free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="machines-"))
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, logs, cmds = [], [], []
    for rank in range(num_machines):
        cmd = [python, "-m", "accelerate.commands.launch", "--num_processes", str(num_machines * processes_per_machine),
               "--num_machines", str(num_machines), "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port)]
        if config_file is not None:
            cmd += ["--config_file", str(config_file)]
        else:
            cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += list(extra_launch) + [str(script), *map(str, args)]
        log = log_dir / f"machine{rank}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env={**base_env, **(machine_env or {}).get(rank, {})},
                                          stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))  # its own group: ended alone on failure
        logs.append(log)
        cmds.append(cmd)
        if rank == 0:
            time.sleep(1)  # machine 0 opens the rendezvous port (static rendezvous: the others connect to it)

    def stop_all():
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()

    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
    timed_out = any(p.poll() is None for p in procs) and failed is None
    stop_all()
    outputs = [log.read_bytes().decode(errors="replace") for log in logs]
    if failed is not None or timed_out:
        what = f"machine {failed} failed ({procs[failed].returncode})" if failed is not None else f"timeout {timeout} s"
        tails = "\n".join(f"--- machine {r}: {' '.join(cmds[r])}\n{out[-4000:]}" for r, out in enumerate(outputs))
        raise AssertionError(f"multi-machine launch: {what}\n{tails}")
    return outputs
