"""Two checkouts of bapo_trl timed on the same async_overlap runs, interleaved against one vLLM CPU server.

Why: a speed claim about a change is a ratio measured in one run, with both versions taking turns (A, B, A, B ...) so
that the drift of a shared machine hits both alike. ``async_overlap.py`` times configurations inside one process,
hence of one version; here each (round, version) is a trainer subprocess with that checkout first on ``PYTHONPATH``
(pinned to core 0, one torch thread), all against one server (core 1), the version order alternating per round.

    python benchmarks/code_ab.py --a /path/to/old/checkout --b . --batch 36 --configs sync,k1 --rounds 4
    python benchmarks/code_ab.py --quick    # a smoke run: this checkout against itself, tiny sizes

Per version and configuration: steps/s, efficiency and pipeline efficiency (``async_overlap``'s definitions, against
the same version's synchronous run of the same round), ``async/load_seconds`` where logged; then B / A of steps/s per
round (paired), median [min, max]. Last line: ``b_over_a_<config>=<median> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(1)
import server_bench as bench
import bapo_trl
from types import SimpleNamespace
from pathlib import Path
out = {{"bapo_trl": bapo_trl.__file__, "runs": {{}}}}
for config in {configs!r}:
    out["runs"][config] = bench.run({model!r}, SimpleNamespace(url={url!r}), Path({tmp!r}) / config, steps={steps},
                                    warmup={warmup}, batch={batch}, length={length}, **bench.CONFIGS[config])
print("RESULT " + json.dumps(out))
"""


def child(code: str, opts, model: str, url: str, tmp: Path, configs: list[str]) -> dict:
    """One trainer process on checkout ``code``: the configurations in order; their results."""
    script = CHILD.format(here=str(HERE), configs=configs, model=model, url=url, tmp=str(tmp), steps=opts.steps,
                          warmup=opts.warmup, batch=opts.batch, length=opts.completion_length)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(code).resolve()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"trainer process for {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    expected = str(Path(code).resolve() / "bapo_trl")
    if not result["bapo_trl"].startswith(expected):
        raise RuntimeError(f"the trainer process imported {result['bapo_trl']}, not the checkout {code}")
    return result["runs"]


def figures(runs: dict) -> dict[str, dict[str, float]]:
    """Per configuration of one (round, version): steps/s, efficiencies (against that round's sync run), load."""
    import server_bench as bench

    table = {}
    for config, row in runs.items():
        entry = {"steps_per_second": row["steps_per_second"]}
        if "async/wait_seconds" in row:
            twin = runs.get(bench.SYNC_TWIN.get(config, "sync"))
            if twin is not None:
                entry["efficiency"] = bench.own_efficiency(row, twin)
            entry["pipeline_efficiency"] = bench.own_efficiency(row)
            if "async/load_seconds" in row:
                entry["load_seconds"] = row["async/load_seconds"]
        table[config] = entry
    return table


def main() -> None:
    import server_bench as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a",
                        help="checkout A (the directory holding its bapo_trl package); required but with --quick")
    parser.add_argument("--b", help="checkout B; required but with --quick")
    parser.add_argument("--configs", default="sync,k1", help=f"comma-separated, of {list(bench.CONFIGS)}")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: this checkout against itself, one round of sync, 2 timed steps "
                             "after 2, 8 completions of 8 tokens, a model of hidden 64, 2 layers, unless given")
    bench.add_run_arguments(parser, steps=12, warmup=3, completion_length=48)
    opts = parser.parse_args()
    if opts.quick:  # its own defaults; values given beside it still win
        here = str(HERE.parent)
        parser.set_defaults(a=here, b=here, configs="sync", rounds=1, steps=2, warmup=2, batch=8, completion_length=8,
                            hidden=64, layers=2)
        opts = parser.parse_args()
    if opts.a is None or opts.b is None:
        parser.error("--a and --b are required (or --quick)")
    configs = [c for c in opts.configs.split(",") if c]
    unknown = [c for c in configs if c not in bench.CONFIGS]
    if unknown or not configs:
        raise SystemExit(f"--configs: {unknown or 'none'} not among {list(bench.CONFIGS)}")
    if not bench.whole_groups(opts.batch):
        raise SystemExit(f"--batch must be a positive multiple of {bench.GENERATIONS}, got {opts.batch}")
    for code in (opts.a, opts.b):
        if not (Path(code) / "bapo_trl" / "__init__.py").is_file():
            raise SystemExit(f"{code} holds no bapo_trl package")
    os.sched_setaffinity(0, {bench.TRAINER_CORE})
    versions = {"A": opts.a, "B": opts.b}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = bench.build_model(tmp / "model", opts.hidden, opts.layers)
        server = bench.Server(model, tmp / "server.log")
        try:
            for index in range(opts.rounds):
                order = ("A", "B") if index % 2 == 0 else ("B", "A")
                done = {}
                for name in order:
                    done[name] = figures(child(versions[name], opts, model, server.url, tmp / f"{index}-{name}",
                                               configs))
                    print(f"round {index + 1} {name}: " + json.dumps(done[name]), flush=True)
                rounds.append(done)
        finally:
            server.stop()
    print(f"\nA = {opts.a}, B = {opts.b}; batch {opts.batch} x {opts.completion_length} tokens, {opts.rounds} rounds "
          f"of {opts.steps} timed steps after {opts.warmup}; median [min, max] over rounds")
    last = []
    for config in configs:
        for key in ("steps_per_second", "efficiency", "pipeline_efficiency", "load_seconds"):
            cells = {name: [r[name][config][key] for r in rounds if key in r[name][config]] for name in versions}
            if cells["A"] or cells["B"]:
                print(f"{config:18s} {key:20s} A {bench.spread(cells['A']):>24s}   B {bench.spread(cells['B']):>24s}")
        ratios = [r["B"][config]["steps_per_second"] / r["A"][config]["steps_per_second"] for r in rounds]
        print(f"{config:18s} {'B/A steps/s':20s} {bench.spread(ratios)}")
        last.append(f"b_over_a_{config}={statistics.median(ratios):.3f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "rounds": rounds}, indent=1))
    print(" ".join(last))


if __name__ == "__main__":
    main()
