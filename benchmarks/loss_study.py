"""TRL's own losses against their BAPO-balanced versions on stale data (issue "BAPO's balance for every loss TRL
ships", item 6), on the embedded reversal task.

At staleness 32 (steps_per_generation=32), lr 1e-3 and 2e-3, 6 seeds each: each TRL loss with its defaults, run by
TRL's own GRPOTrainer, against the same loss balanced by BAPO (docs/loss_types.md), plus the paper's BAPO (dapo,
token level). Recorded per run: final reward, held-out accuracy, collapse (final reward < 0.1), the largest
gradient norm, final entropy, and for BAPO runs the window / gate it chose.

    python benchmarks/loss_study.py            # the study (144 runs of 160 steps; 9.3 minutes on 2 cores)
    python benchmarks/loss_study.py --quick    # every method once, a few steps (CI smoke), temp dir
    python benchmarks/loss_study.py --seeds 100-105   # the same on seeds 100..105 (files *_seeds100-105*)

Settings of the TRL baselines ("defaults" where TRL has one that trains):
- dapo clip-higher: epsilon 0.2, epsilon_high 0.28 (the DAPO paper's value, quoted by TRL);
- cispo: epsilon_high 5.0, TRL's documented recommendation (its literal default would cap every weight at 0.2);
- sapo, vespo: TRL's defaults (temperatures 1.0 / 1.05; k, lambda 2, 3 / 3, 2);
- GSPO: loss_type grpo, importance_sampling_level sequence, epsilon 0.2 (TRL's default);
- off-policy sequence mask: dapo with off_policy_mask_threshold 0.5 (TRL has no default; 0.5 nats of mean KL).
The BAPO version of each is the same settings in a BAPOConfig (BAPO then chooses the window, cap or gate; epsilon /
epsilon_high are ignored; no dual clip, ``study.BAPO_EXTRA``); "BAPO dapo" is the paper's BAPO, the balanced version of
dapo clip-higher.

Writes ``docs/data/loss_study.md`` and ``docs/data/loss_study_runs.json.gz``. The last line is
``runs=.. bapo_default_reward=.. trl_dapo_reward=.. balanced_better=../.. minutes=..``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from study import (
    COLLAPSE,
    LOSSES,
    fmt,
    mean,
    output_dir,
    parse_seeds,
    reuse,
    run_all,
    save_runs,
    seed_tag,
    summarize,
    table,
)
from study import loss_methods as methods

GATE_METRICS = ("bapo/sapo_temperature_pos", "bapo/sapo_temperature_neg", "bapo/vespo_k_pos", "bapo/vespo_lambda_pos",
                "bapo/vespo_k_neg", "bapo/vespo_lambda_neg", "bapo/search_active", "bapo/positive_gradient_share")
LEARNING_RATES = (1e-3, 2e-3)
SEEDS = 6
STEPS = 160


def plan(quick: bool, seeds: list[int] | None = None) -> list[dict]:
    runs = []
    for method, fields in methods().items():
        common = dict(method=method, extra_metrics=GATE_METRICS, **fields)
        if quick:  # every method once: 4 updates on an 8-step generation batch
            runs.append(dict(common, staleness="spg 8", lr=2e-3, seed=(seeds or [0])[0], steps=4))
            continue
        for lr in LEARNING_RATES:
            for seed in seeds or range(SEEDS):
                runs.append(dict(common, staleness="spg 32", lr=lr, seed=seed, steps=STEPS))
    return runs


COLUMNS = [("final reward", "reward_final"), ("held-out acc.", "heldout_accuracy"),
           ("final entropy", "entropy_final"), ("max grad norm", "grad_norm_max", 1), ("pos. share", "positive_share"),
           ("c_low", "clip_low"), ("c_high", "clip_high"), ("target met", "target_met")]


def gate_means(runs: list[dict]) -> dict[str, float]:
    """Mean gate parameters over the updates where the search could act, over all the given runs."""
    active = [h for run in runs for h in run["history"] if h.get("bapo/search_active")]
    return {name.split("/")[1]: mean([h.get(name) for h in active]) for name in GATE_METRICS[:6]
            if any(name in h for h in active)}


def pairs(runs: list[dict], lr: float) -> str:
    """TRL's loss against its BAPO-balanced version: reward, collapses, largest gradient norm, entropy."""
    lines = ["| loss | TRL final reward | BAPO final reward | TRL collapsed | BAPO collapsed | TRL max grad norm | "
             "BAPO max grad norm | TRL final entropy | BAPO final entropy |", "|" + "---|" * 9]
    for loss in LOSSES:
        cells = {}
        for side in ("TRL", "BAPO"):
            sums = [summarize(r) for r in runs if r["method"] == f"{side} {loss}" and r["lr"] == lr]
            cells[side] = (fmt([s["reward_final"] for s in sums]), f"{sum(s['reward_final'] < COLLAPSE for s in sums)}"
                           f"/{len(sums)}", fmt([s["grad_norm_max"] for s in sums], 1),
                           fmt([s["entropy_final"] for s in sums]))
        row = [loss] + [cells[side][i] for i in range(4) for side in ("TRL", "BAPO")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_report(runs: list[dict], command: str, elapsed: float, quick: bool) -> str:
    order = list(methods())
    runs = sorted(runs, key=lambda r: (order.index(r["method"]), r["lr"], r["seed"]))
    sections = [
        "# TRL's losses against their BAPO-balanced versions (tiny scale)\n",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} ({platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads 1 per run) in {elapsed / 60:.1f} minutes. Task: the embedded reversal task "
        "(`benchmarks/study.py`'s runs: batch 32 completions, 4 prompts x 8, constant learning rate). "
        + ("Quick mode: `steps_per_generation=8`, 4 optimizer steps, 1 seed, lr 0.002. " if quick else
           f"Staleness 32 (`steps_per_generation=32`), {STEPS} optimizer steps, "
           f"{len({r['seed'] for r in runs})} seeds per learning rate. ")
        + "Final "
        f"reward = mean sampled reward over the last 20% of steps; collapsed = final reward < {COLLAPSE}. "
        "Mean ± standard deviation over seeds. The settings of each method are in the script's docstring; the math "
        "of each balanced loss in `docs/loss_types.md`.\n",
    ]
    if quick:
        sections.append("**Quick mode (CI smoke): numbers are not meaningful.**\n")
        sections.append(table(runs, "method", lambda r: True, COLUMNS))
    else:
        for lr in LEARNING_RATES:
            sections.append(f"\n## lr {lr}: each TRL loss against its BAPO version\n")
            sections.append(pairs(runs, lr))
            sections.append(f"\n### lr {lr}: every method\n")
            sections.append(table(runs, "method", lambda r, lr=lr: r["lr"] == lr, COLUMNS))
    gates = {m: gate_means([r for r in runs if r["method"] == m]) for m in ("BAPO sapo", "BAPO vespo")
             if any(r["method"] == m for r in runs)}
    if gates:
        sections.append("\n## Gate parameters BAPO chose (mean over the active updates of all runs, both lr)\n")
        sections += [f"- {method}: " + ", ".join(f"{k} {v:.3g}" for k, v in means.items())
                     for method, means in gates.items()]
    return "\n".join(sections) + "\n"


def line(i: int, n: int, result: dict) -> str:
    s = summarize(result)
    return (f"[{i + 1}/{n}] {result['method']:<28} lr {result['lr']} seed {result['seed']}: final reward "
            f"{s['reward_final']:.3f}, max grad norm {s['grad_norm_max']:.2f}, entropy {s['entropy_final']:.3f} "
            f"({result['seconds']:.0f}s)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every method once, a few steps (CI smoke test)")
    parser.add_argument("--out", default=None, help="output directory (default: docs/data/, a temp dir with --quick)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", default=None, help="A-B: seeds A..B instead of 0-5 (files get a _seedsA-B suffix)")
    parser.add_argument("--reuse", default=None, help="a loss_study_runs.json(.gz) from an earlier run: its runs are "
                        "kept and not run again (same method, staleness, lr, seed, steps)")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds) if args.seeds else None
    out_dir = output_dir(args.out, args.quick, "loss-study-")
    from bapo_trl.recipes.toy import build_tiny_model

    build_tiny_model()  # once, before the workers race for the cache
    results, todo = reuse(plan(args.quick, seeds), args.reuse)
    reused, started = len(results), time.time()
    results += run_all(todo, args.workers, line)
    elapsed = time.time() - started + sum(r["seconds"] for r in results[:reused]) / max(1, args.workers)
    command = "python benchmarks/loss_study.py" + (" --quick" if args.quick else "") + (
        f" --seeds {args.seeds}" if args.seeds else "")
    tag = seed_tag(args.seeds)
    save_runs(results, os.path.join(out_dir, f"loss_study_runs{tag}.json.gz"))
    name = f"loss_study{tag}.md" if not args.quick else "loss_study_quick.md"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(write_report(results, command, elapsed, args.quick))

    def reward(method):
        return mean([summarize(r)["reward_final"] for r in results if r["method"] == method])

    better = sum(reward(f"BAPO {loss}") > reward(f"TRL {loss}") for loss in LOSSES)
    print(f"wrote {os.path.join(out_dir, name)}")
    print(f"runs={len(results)} bapo_default_reward={reward('BAPO dapo'):.3f} "
          f"trl_dapo_reward={reward('TRL dapo'):.3f} balanced_better={better}/{len(LOSSES)} "
          f"minutes={elapsed / 60:.1f}")


if __name__ == "__main__":
    sys.exit(main())
