"""The loss head-to-head on a real model (issue "BAPO's balance for every loss TRL ships", item 6, second part):
SmolLM2-135M-Instruct on the shipped chat arithmetic task, stale data, a few of the methods of
`benchmarks/loss_study.py` (the tiny-scale study picks which), each seed trained then evaluated on the 48 held-out
problems (avg@8 before and after).

    python benchmarks/loss_study_smollm2.py                       # default methods, 2 seeds (under an hour, 2 cores)
    python benchmarks/loss_study_smollm2.py --methods "TRL dapo" "BAPO dapo" --seeds 3   # or --seeds 100-102
    python benchmarks/loss_study_smollm2.py --quick               # one method, 1 step, 2 problems (smoke), temp dir

Training: full fine-tuning in float32 on CPU, transformers generation, 8 prompts x 4 samples x 16 tokens per
generation, ``steps_per_generation=4`` (each batch is trained on for 4 optimizer steps: up to 3 steps stale), batch
8 completions per step, lr 2e-5 (twice the README's recipe, so that the ratios leave 1 and the windows matter),
20 steps, one torch thread per run, two runs at a time. Evaluation as in the README: 48 problems, 8 samples each,
16 tokens, temperature 1.0, seed 0.

Writes ``docs/data/loss_study_smollm2.md`` and ``docs/data/loss_study_smollm2_runs.json``. The last line is
``runs=.. base_avg8=.. <method>_avg8=.. ... minutes=..``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

from study import SMOLLM2_QUICK as QUICK
from study import SMOLLM2_TRAINING as TRAINING
from study import fmt as _fmt
from study import loss_methods as tiny_methods  # the same settings per method as the tiny study
from study import mean as _mean
from study import parse_seeds
from study import train_smollm2 as train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = os.path.join(REPO, "tests", "data", "chat_arithmetic_test.jsonl")
#: From the tiny study (docs/data/loss_study.md): BAPO's default, the TRL baseline it replaces (dapo clip-higher), the
#: strongest TRL loss there (GSPO) and the strongest balanced one (BAPO vespo). CISPO and SAPO collapsed there.
DEFAULT_METHODS = ("TRL dapo", "BAPO dapo", "TRL GSPO", "BAPO vespo")
EVALUATION = ["--k", "8", "--max_new_tokens", "16", "--temperature", "1.0", "--threads", "1", "--seed", "0"]


def evaluate(model: str, quick: bool) -> dict:
    """avg@8 / pass@k of ``model`` on the held-out split (the README's evaluation command, in this process)."""
    from bapo_trl.cli.evaluate import make_parser
    from bapo_trl.recipes.math_reasoning import evaluate as ev

    report = ev.evaluate(make_parser().parse_args(
        ["--model", model, "--dataset", TEST, *EVALUATION] + (["--num_problems", "2", "--k", "2"] if quick else [])))
    return {key: value for key, value in report.items() if key.startswith(("avg@", "pass@", "num_scored", "seconds"))}


def run_one(spec: dict) -> dict:
    """One seed of one method in a fresh process: train, save, evaluate.
    ``spec["method"] == "base"``: evaluate only."""
    import torch

    torch.set_num_threads(1)
    from bapo_trl.recipes.models import prepare_model

    model_dir = prepare_model("smollm2")
    started = time.time()
    if spec["method"] == "base":
        return {**spec, "history": [], "eval": evaluate(model_dir, spec["quick"]), "seconds": time.time() - started}
    with tempfile.TemporaryDirectory() as out:
        trained, history = train(spec, model_dir, out, QUICK if spec["quick"] else TRAINING)
        train_seconds = time.time() - started
        result = evaluate(trained, spec["quick"])
    return {**spec, "history": history, "eval": result, "train_seconds": train_seconds,
            "seconds": time.time() - started}


def _finite(values):
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def summarize(run: dict) -> dict:
    h = run["history"]
    quarter = max(1, len(h) // 4)
    rewards = [e["reward"] for e in h if "reward" in e]  # logged at the steps that generated
    quarter_of_rewards = max(1, len(rewards) // 4)
    return {
        "avg8": run["eval"].get("avg@8", run["eval"].get("avg@2", float("nan"))),
        "pass8": run["eval"].get("pass@8", float("nan")),
        "reward_first": _mean(rewards[:quarter_of_rewards]),
        "reward_last": _mean(rewards[-quarter_of_rewards:]),
        "entropy_last": _mean([e.get("entropy") for e in h[-quarter:]]),
        "grad_norm_max": max(_finite([e.get("grad_norm") for e in h]), default=float("nan")),
        "clip_high": _mean([e.get("bapo/clip_high") for e in h if e.get("bapo/search_active")]),
        "active": _mean([e.get("bapo/search_active") for e in h]),
        "staleness": _mean([e.get("bapo/staleness_mean") for e in h]),
    }


def write_report(runs: list[dict], command: str, elapsed: float, quick: bool, workers: int) -> str:
    base = [summarize(r)["avg8"] for r in runs if r["method"] == "base"]
    lines = [
        "# The loss head-to-head on SmolLM2-135M-Instruct (chat arithmetic, stale data)\n",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} ({platform.machine()}, {os.cpu_count()} cores, "
        f"one torch thread per run, {workers} run(s) at a time) in {elapsed / 60:.1f} minutes. Settings: the script's "
        "docstring (full fine-tuning, 8 prompts x 4 samples x 16 tokens per generation, `steps_per_generation=4`, "
        "batch 8, lr 2e-5, 20 steps; each method's loss settings as in `benchmarks/loss_study.py`). Held-out: 48 "
        "problems, 8 samples, 16 tokens, temperature 1.0, seed 0. Mean ± standard deviation over seeds; the "
        "training reward is per generation batch of 8 prompts, so it is noisy.\n",
        *(["**Quick mode (smoke): numbers are not meaningful.**\n"] if quick else []),
        f"Base model: avg@8 {_fmt(base, 1)}%.\n",
        "| method | seeds | held-out avg@8 (%) | pass@8 (%) | train reward, first quarter | train reward, last "
        "quarter | final entropy | max grad norm | c_high (active updates) | search active | minutes per run |",
        "|" + "---|" * 11,
    ]
    for method in dict.fromkeys(r["method"] for r in runs if r["method"] != "base"):
        members = [r for r in runs if r["method"] == method]
        sums = [summarize(r) for r in members]
        col = lambda key, d=2: _fmt([s[key] for s in sums], d)  # noqa: E731
        lines.append(f"| {method} | {len(members)} | {col('avg8', 1)} | {col('pass8', 1)} | "
                     f"{col('reward_first')} | {col('reward_last')} | {col('entropy_last', 3)} | "
                     f"{col('grad_norm_max')} | {col('clip_high')} | {col('active')} | "
                     f"{_fmt([r['seconds'] / 60 for r in members], 1)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help=f"methods of benchmarks/loss_study.py (default: {', '.join(DEFAULT_METHODS)})")
    parser.add_argument("--seeds", default="2", help="N (seeds 0..N-1) or A-B (seeds A..B)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one method, 1 step, 2 problems x 2 samples (smoke)")
    parser.add_argument("--out", default=None, help="output directory (default: docs/data/, a temp dir with --quick)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods) - set(tiny_methods()))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {sorted(tiny_methods())}")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods: each method once, got {args.methods}")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as error:
        parser.error(str(error))
    out_dir = args.out or (tempfile.mkdtemp(prefix="loss-study-smollm2-") if args.quick else
                           os.path.join(REPO, "docs", "data"))
    os.makedirs(out_dir, exist_ok=True)
    from bapo_trl.recipes.models import prepare_model

    prepare_model("smollm2")  # once, before the workers race for the cache
    chosen = args.methods[:1] if args.quick else args.methods
    todo = [dict(method="base", seed=0, quick=args.quick)] + [
        dict(method=m, seed=s, quick=args.quick) for s in (seeds[:1] if args.quick else seeds) for m in chosen]
    results, started = [], time.time()
    name = "loss_study_smollm2_quick" if args.quick else "loss_study_smollm2"
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for i, result in enumerate(pool.imap_unordered(run_one, todo)):
            results.append(result)
            with open(os.path.join(out_dir, f"{name}_runs.json"), "w") as f:  # kept as they come (long runs)
                json.dump(results, f, indent=1)
            s = summarize(result)
            print(f"[{i + 1}/{len(todo)}] {result['method']:<24} seed {result['seed']}: avg@8 {s['avg8']:.1f}, "
                  f"reward {s['reward_first']:.2f} -> {s['reward_last']:.2f}, max grad norm {s['grad_norm_max']:.2f} "
                  f"({result['seconds']:.0f}s)", flush=True)
    elapsed = time.time() - started
    order = ["base", *chosen]
    results.sort(key=lambda r: (order.index(r["method"]), r["seed"]))
    command = "python benchmarks/loss_study_smollm2.py" + (" --quick" if args.quick else "") + (
        "" if args.methods == list(DEFAULT_METHODS) else " --methods " + " ".join(f'"{m}"' for m in args.methods)) + (
        "" if args.seeds == "2" or args.quick else f" --seeds {args.seeds}") + (
        "" if args.workers == 2 else f" --workers {args.workers}")
    with open(os.path.join(out_dir, f"{name}_runs.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(write_report(results, command, elapsed, args.quick, args.workers))
    avg = {m: _mean([summarize(r)["avg8"] for r in results if r["method"] == m]) for m in order}
    print(f"wrote {os.path.join(out_dir, name + '.md')}")
    print(f"runs={len(results)} base_avg8={avg['base']:.1f} "
          + " ".join(f"{m.replace(' ', '_')}_avg8={avg[m]:.1f}" for m in chosen) + f" minutes={elapsed / 60:.1f}")


if __name__ == "__main__":
    sys.exit(main())
