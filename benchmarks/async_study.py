"""Does BAPO keep async training stable, and what does async buy in wall-clock? The staleness study's task with
generation in the real vLLM CPU server, synchronous (K=0) and async with K = 1, 2, 4 batches ahead.

Methods: fixed [0.8, 1.2], the widest fixed window BAPO can reach [0.9, 3.0], BAPO (paper) and BAPO (official-code
variant), from ``staleness_study.METHODS``. Every run: the embedded model and reversal task, batch 32 x 8
generations, ``steps_per_generation=4`` (so a batch is also reused within its generation round), constant lr
2e-3 (``--lr``), the server pinned to core 1 and the trainer to core 0 (one torch thread); runs one after another
against one server (each run pushes its own initial weights before generating). Reported per (K, method): final reward
(mean of the last 5 generation rounds = 20 steps), held-out accuracy, wall-clock of the run, and the seconds until the
mean reward of 3 consecutive generation rounds first reached 0.5.

    python benchmarks/async_study.py            # the study (about 20 minutes on 2 cores), writes docs/data/
    python benchmarks/async_study.py --quick    # two short runs (make test-on-demand), writes to a temp dir
    python benchmarks/async_study.py --seeds 100-101   # the study on seeds 100..101 (files *_seeds100-101*)
    python benchmarks/async_study.py --options  # the async options: K=1/2/4 (eager and lazy weight loading),
                                                # in-flight updates, replay that saves generation; BAPO (paper, dual
                                                # clip) vs the widest fixed window, 3 seeds

The last line is ``runs=N k1_speedup=<sync wall-clock / K=1 wall-clock, BAPO paper> bapo_k4_reward=..
fixed_k4_reward=..``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import study  # noqa: E402
from server_bench import TRAINER_CORE, Server  # noqa: E402  (the real vLLM CPU server, pinned to a core)
from study import METHODS, parse_seeds, seed_tag  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STUDIED = ("fixed [0.8,1.2]", "widest fixed [0.9,3.0]", "BAPO paper", "BAPO verl")
#: Kept besides study.KEPT.
ASYNC_METRICS = ("async/wait_seconds", "async/staleness_max", "async/generate_seconds", "async/load_seconds",
                 "async/queue_depth")


#: ``--options``: the async settings compared, on top of the method's own.
OPTION_SETTINGS = {
    "sync": {},
    "K=1": dict(async_generation=True, max_staleness=1),
    "K=2": dict(async_generation=True, max_staleness=2),
    "K=4": dict(async_generation=True, max_staleness=4),
    "K=2 lazy": dict(async_generation=True, max_staleness=2, lazy_weight_loading=True),
    "K=4 lazy": dict(async_generation=True, max_staleness=4, lazy_weight_loading=True),
    "K=2 in-flight": dict(async_generation=True, max_staleness=2, inflight_update_tokens=4),
    "K=1 replay saves": dict(async_generation=True, max_staleness=1, replay_buffer_size=64, replay_ratio=0.5,
                             replay_saves_generation=True, replay_max_staleness=24),
}
#: ``--options``: BAPO as the paper runs it, with the official code's dual clip of negative tokens, against the
#: widest fixed window BAPO's search can reach.
OPTION_METHODS = {"BAPO paper + dual clip": dict(delta=3.0),
                  "widest fixed [0.9,3.0]": METHODS["widest fixed [0.9,3.0]"]}


def plan_options(seeds: list[int], lr: float) -> list[dict]:
    return [dict(method=m, setting=name, k=OPTION_SETTINGS[name].get("max_staleness", 0), seed=s, steps=120, lr=lr)
            for name in OPTION_SETTINGS for m in OPTION_METHODS for s in seeds]


def plan(quick: bool, lr: float, seeds: list[int] | None = None) -> list[dict]:
    if quick:
        return [dict(method="BAPO paper", k=k, seed=(seeds or [0])[0], steps=8, lr=lr) for k in (0, 1)]
    return [dict(method=m, k=k, seed=s, steps=120, lr=lr) for k in (0, 1, 2, 4) for m in STUDIED
            for s in seeds or range(2)]


def run_one(spec: dict, server) -> dict:
    """study.run_one in the server scenario (``steps_per_generation=4``) with the method's and the async settings;
    adds the final reward (last 5 generation rounds), the seconds until the reward first reached 0.5 (3 rounds
    smoothed) and the largest staleness seen."""
    if "setting" in spec:  # --options
        method, asynchronous = OPTION_METHODS[spec["method"]], OPTION_SETTINGS[spec["setting"]]
    else:
        method = METHODS[spec["method"]]
        asynchronous = dict(async_generation=True, max_staleness=spec["k"]) if spec["k"] else {}
    run = study.run_one({**spec, "staleness": "server sync", "settings": {**method, **asynchronous},
                         "server_url": server.url, "extra_metrics": ASYNC_METRICS})
    history, times = run["history"], run["step_seconds"]
    # the reward is logged on the steps that generate (every steps_per_generation-th)
    rewarded = [(i, h["reward"]) for i, h in enumerate(history) if "reward" in h]
    rewards = [r for _, r in rewarded]
    window = 3  # generation rounds (12 steps)
    smoothed = [statistics.mean(rewards[max(0, j - window + 1) : j + 1]) for j in range(len(rewards))]
    reached = next((times[rewarded[j][0]] for j, r in enumerate(smoothed) if r >= 0.5 and j >= window - 1), None)
    return {**spec, "history": history, "heldout_accuracy": run["heldout_accuracy"], "seconds": times[-1],
            "final_reward": statistics.mean(rewards[-5:]), "seconds_to_0.5": reached,
            "max_staleness_seen": max(h.get("bapo/staleness_max", 0) for h in history)}


def table(results: list[dict]) -> str:
    lines = ["| K | method | final reward | held-out accuracy | wall-clock (s) | s to reward 0.5 | max staleness |",
             "|---|---|---|---|---|---|---|"]
    for k in sorted({r["k"] for r in results}):
        for method in STUDIED:
            rs = [r for r in results if r["k"] == k and r["method"] == method]
            if not rs:
                continue

            def col(key, fmt):
                values = [r[key] for r in rs if r[key] is not None]
                if not values:
                    return "never"
                text = " / ".join(fmt.format(v) for v in values)
                return text + ("" if len(values) == len(rs) else f" ({len(rs) - len(values)} never)")

            lines.append(f"| {k or 'sync'} | {method} | {col('final_reward', '{:.2f}')} | "
                         f"{col('heldout_accuracy', '{:.2f}')} | {col('seconds', '{:.0f}')} | "
                         f"{col('seconds_to_0.5', '{:.0f}')} | {max(r['max_staleness_seen'] for r in rs):.0f} |")
    return "\n".join(lines)


def options_table(results: list[dict]) -> str:
    """--options: mean and range over seeds per (setting, method)."""
    lines = [
        "| setting | method | final reward | held-out accuracy | wall-clock (s) | s to reward 0.5 | max staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in OPTION_SETTINGS:
        for method in OPTION_METHODS:
            rs = [r for r in results if r["setting"] == setting and r["method"] == method]

            def col(key):
                values = [r[key] for r in rs if r[key] is not None]
                never = len(rs) - len(values)
                if not values:
                    return "never"
                text = f"{statistics.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]"
                return text + (f" ({never} never)" if never else "")

            lines.append(f"| {setting} | {method} | {col('final_reward')} | {col('heldout_accuracy')} | "
                         f"{col('seconds')} | {col('seconds_to_0.5')} | "
                         f"{max(r['max_staleness_seen'] for r in rs):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--options", action="store_true", help="the async options study (see the module doc)")
    parser.add_argument("--seeds", default=None, help="N (seeds 0..N-1) or A-B (seeds A..B); default: 3 with "
                        "--options, 2 otherwise")
    parser.add_argument("--out", default=None, help="results directory (default: docs/data/, a temp dir with --quick)")
    parser.add_argument("--lr", type=float, default=2e-3, help="constant learning rate (the study ran 2e-3 and 1e-3)")
    parser.add_argument("--server-url", default=None, help="a running vLLM server of the embedded model to use "
                        "instead of starting one (the tests pass theirs); it is not pinned to a core then")
    opts = parser.parse_args()
    from bapo_trl.recipes.toy import build_tiny_model

    os.sched_setaffinity(0, {TRAINER_CORE})
    out = Path(opts.out or (tempfile.mkdtemp() if opts.quick else REPO / "docs" / "data"))
    model_dir = build_tiny_model()
    seeds = parse_seeds(opts.seeds) if opts.seeds else None
    runs = plan_options(seeds or parse_seeds(3), opts.lr) if opts.options else plan(opts.quick, opts.lr, seeds)
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = SimpleNamespace(url=opts.server_url, stop=lambda: None) if opts.server_url else \
            Server(model_dir, Path(tmp) / "server.log")
        try:
            for i, spec in enumerate(runs):
                results.append(run_one(spec, server))
                r = results[-1]
                print(f"[{i + 1}/{len(runs)}] {r.get('setting', r['k'])} {r['method']} seed {r['seed']}: final reward "
                      f"{r['final_reward']:.2f}, {r['seconds']:.0f} s", flush=True)
        finally:
            server.stop()
    minutes = (time.time() - started) / 60
    if opts.options:
        text = options_table(results)
        print(text)
        with gzip.open(out / f"async_options_runs{seed_tag(opts.seeds)}.json.gz", "wt") as f:
            json.dump(results, f)
        (out / f"async_options_table{seed_tag(opts.seeds)}.md").write_text(
            text + f"\n\n{len(runs)} runs, {minutes:.1f} min.\n")
        return
    text = table(results)
    print(text)
    tag = f"lr{opts.lr:g}{seed_tag(opts.seeds)}"
    with gzip.open(out / f"async_runs_{tag}.json.gz", "wt") as f:
        json.dump(results, f)
    (out / f"async_study_table_{tag}.md").write_text(text + f"\n\n{len(runs)} runs, {minutes:.1f} min.\n")

    def mean_of(k, method, key):
        values = [r[key] for r in results if r["k"] == k and r["method"] == method and r[key] is not None]
        return statistics.mean(values) if values else float("nan")

    top = max(r["k"] for r in results)
    fixed = mean_of(top, "fixed [0.8,1.2]", "final_reward")
    print(f"runs={len(results)} "
          f"k1_speedup={mean_of(0, 'BAPO paper', 'seconds') / mean_of(1, 'BAPO paper', 'seconds'):.3f} "
          f"bapo_k{top}_reward={mean_of(top, 'BAPO paper', 'final_reward'):.3f} fixed_k{top}_reward={fixed:.3f}")


if __name__ == "__main__":
    main()
