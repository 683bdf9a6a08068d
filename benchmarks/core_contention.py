"""What one core's work costs the other core on this machine: a single-thread matmul loop timed alone and beside a
busy twin on the other core.

Why: the async benchmark's ideal bound takes generation and training times from the synchronous run, where each side
has the machine to itself; async, they run at once on two cores that share the L3 cache and memory bandwidth (and,
on a VM, possibly one physical core). This measures that share for plain compute, with no server, no HTTP and no
weight traffic, so the part of the K=1 efficiency gap that the machine alone explains can be told from the part the
pipeline could still remove.

* This process on ``server_bench.TRAINER_CORE``, the twin on ``server_bench.SERVER_CORE`` (the cores the server
  benchmarks give the trainer and the server), one torch thread each; the twin runs the same loop without end and
  says when it is busy, so the timed loop never sees its start-up.
* Two sizes: 256 x 256 float32 (fits a core's L2: contention for the shared cache and memory hardly matters) and
  1024 x 1024 (4 MiB a matrix: works through the L3).
* Interleaved: each round times the loop alone, then beside the twin; ratios beside / alone per round, median
  [min, max] over rounds.

Usage: ``python benchmarks/core_contention.py [--quick] [--rounds N]``. Last line:
``beside_over_alone_256=<median> beside_over_alone_1024=<median>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

SIZES = {256: 3000, 1024: 60}  # matmuls per timed loop: ~1-2 s each on this machine


def matmuls(count: int, size: int) -> float:
    a = torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(count):
        a @ a
    return time.perf_counter() - start


def twin(size: int, core: int) -> None:
    """The other core's load: the same loop, forever; prints ``busy`` once it runs. Imports torch only (no
    server_bench, which loads TRL), so it starts in seconds."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    matmuls(1, size)
    print("busy", flush=True)
    while True:
        matmuls(100, size)


def beside_twin(count: int, size: int, core: int) -> float:
    proc = subprocess.Popen([sys.executable, __file__, "--twin", str(size), str(core)], stdout=subprocess.PIPE,
                            text=True)
    try:
        if proc.stdout.readline().strip() != "busy":
            raise RuntimeError(f"the twin process did not start (exit code {proc.poll()})")
        return matmuls(count, size)
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of short loops (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; quick 2)")
    parser.add_argument("--twin", type=int, nargs=2, default=None, help=argparse.SUPPRESS)  # SIZE CORE
    opts = parser.parse_args(argv)
    if opts.twin is not None:
        twin(*opts.twin)
        return
    rounds = opts.rounds if opts.rounds is not None else (2 if opts.quick else 7)
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    if os.cpu_count() is None or os.cpu_count() < 2:
        raise SystemExit("core_contention needs 2 cores (this process on one, the twin on the other)")
    from server_bench import SERVER_CORE, TRAINER_CORE, spread

    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    medians = {}
    for size, count in SIZES.items():
        count = count // 10 if opts.quick else count
        alone, beside = [], []
        for _ in range(rounds):
            alone.append(matmuls(count, size))
            beside.append(beside_twin(count, size, SERVER_CORE))
        ratios = [b / a for a, b in zip(alone, beside)]
        medians[size] = statistics.median(ratios)
        print(f"{size} x {size}, {count} matmuls: alone {spread(alone)} s, beside the twin {spread(beside)} s, "
              f"beside / alone {spread(ratios)}")
    print(" ".join(f"beside_over_alone_{size}={value:.3f}" for size, value in medians.items()))


if __name__ == "__main__":
    main()
