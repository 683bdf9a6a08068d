"""Helpers to run real `accelerate launch` jobs from tests: a free port each, one at a time, results in files."""

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def script_module(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts folder is no package), for its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bapo_script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_quick(script: str, *args: str) -> str:
    """``benchmarks/<script> --quick *args`` in a process of its own; its last line (the machine-readable summary)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout.strip().splitlines()[-1]


#: what a process prints when the port it was told to listen on was taken meanwhile: Python's OSError (vLLM's server),
#: torch's TCPStore ("EADDRINUSE"), accelerate's own check on machine 0 of several. (One machine: accelerate, finding
#: the port taken, picks one itself; only a port taken after its check and before the bind is then a clash.)
PORT_CLASH = re.compile(r"EADDRINUSE|address already in use|another process is utilizing it", re.IGNORECASE)
#: launches retried with a new port after a clash (a clash twice in a row on random ports is not chance)
PORT_ATTEMPTS = 3


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, for a process started later to listen on (it cannot be held until then: the child binds it).

    The race, and what is done about it: asking the kernel for a free port (bind to port 0) returns one from the
    ephemeral range, the range every outgoing connection and every other bind-to-0 also draws its local port from, so
    on a busy machine (parallel test runs, gloo's connections) that port could be taken before the child binds it.
    This picks a random port OUTSIDE that range (20000 up to it), which only an explicit bind of that very port can
    take; checked free on every interface. What is left (another process binding the same random port in between) is
    handled where a process is launched: a launch whose output shows :data:`PORT_CLASH` is retried on a new port."""
    low, high = _ephemeral_range()
    ranges = [r for r in (range(20000, low), range(high + 1, 65536)) if len(r) > 1000]
    for _ in range(200) if ranges else ():
        port = random.choice(random.choice(ranges))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # no room outside the ephemeral range on this machine: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_clash(output: str) -> bool:
    """Whether a launch failed because its port was taken before it bound it (then launch it again on a new one)."""
    return bool(PORT_CLASH.search(output))


@contextlib.contextmanager
def refused_port():
    """A port where nothing listens, for the block: bound here and never listening, so a connection to it is refused
    and no other process can start listening on it meanwhile (a port merely found free could be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def accelerate_launch(script, *args, num_processes=2, config_file=None, extra_launch=(), timeout=900, env=None,
                      python=sys.executable):
    """Run `accelerate launch` (with ``python``'s environment) and return the CompletedProcess; raise with the tail of
    the output on failure."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(PORT_ATTEMPTS):  # the rendezvous port taken before rank 0 bound it: again, on another
        cmd = [python, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
               "--main_process_port", str(free_port())]
        if config_file is not None:
            cmd += ["--config_file", str(config_file)]
        else:
            cmd += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += list(extra_launch) + [str(script), *map(str, args)]
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or not port_clash(proc.stdout + proc.stderr) or attempt == PORT_ATTEMPTS - 1:
            break
        print(f"launch: port clash on attempt {attempt + 1}, launching again on a new port")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def launch_infos(out, world_size: int = 2) -> list[dict]:
    """Every rank's ``launch_info`` record (written by train_bapo.py), in rank order."""
    import json

    return [json.loads((Path(out) / "launch_info" / f"rank{r}.json").read_text()) for r in range(world_size)]


def assert_zero3_partitioned(out, world_size: int = 2) -> list[dict]:
    """Every rank's ``launch_info`` record (written by train_bapo.py) shows a real ZeRO-3 run whose weights are split
    between the ranks; returns the records."""
    infos = launch_infos(out, world_size)
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
    the others (only the process groups started here). A launch whose rendezvous port was taken before machine 0
    bound it is launched again on a new port (:func:`free_port`)."""
    import tempfile

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="machines-"))
    for attempt in range(PORT_ATTEMPTS):
        outputs, failure = _launch_machines_once(
            free_port(), log_dir / f"attempt{attempt}" if attempt else log_dir, script, args, num_machines,
            processes_per_machine, config_file, extra_launch, timeout, env, machine_env, python)
        if failure is None:
            return outputs
        if not any(port_clash(out) for out in outputs) or attempt == PORT_ATTEMPTS - 1:
            raise AssertionError(failure)
        print(f"multi-machine launch: port clash on attempt {attempt + 1}, launching again on a new port")


def _launch_machines_once(port, log_dir, script, args, num_machines, processes_per_machine, config_file,
                          extra_launch, timeout, env, machine_env, python) -> tuple[list[str], str | None]:
    """One launch of :func:`accelerate_launch_machines` on ``port``: every launcher's output, and what failed (None
    if all succeeded)."""
    import signal
    import time

    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, logs, cmds = [], [], []
    for rank in range(num_machines):
        cmd = [python, "-m", "accelerate.commands.launch",
               "--num_processes", str(num_machines * processes_per_machine), "--num_machines", str(num_machines),
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
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
            # Not a bound: the others' rendezvous clients retry until machine 0's store listens (static
            # rendezvous), however long it takes; this only lets machine 0 usually bind its port first.
            time.sleep(1)

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
        what = (f"machine {failed} failed ({procs[failed].returncode})" if failed is not None
                else f"timeout {timeout} s")
        tails = "\n".join(f"--- machine {r}: {' '.join(cmds[r])}\n{out[-4000:]}" for r, out in enumerate(outputs))
        return outputs, f"multi-machine launch: {what}\n{tails}"
    return outputs, None
