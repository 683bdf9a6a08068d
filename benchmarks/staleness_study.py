"""The paper's staleness questions at tiny scale (its Fig. 2/7/9/11), on the embedded reversal task.

Does an adaptive window help when the data is stale, and is it the ADAPTING or merely the WIDENING that helps?
(The shared scaffolding -- training run, summary, tables, files -- is in ``study.py``.) Methods: fixed windows
[0.8, 1.2], [0.8, 1.28] (clip-higher), [0.8, 1.5], [0.5, 1.2], the widest fixed window BAPO can reach [0.9, 3.0],
and BAPO (paper default, gradient share, official-code variant). Staleness comes from `steps_per_generation`
(1 = on-policy, 8, 16, 32) and from replay. Every fixed window is a BAPOConfig whose search path has one point, so
every run logs the same metrics.

    python benchmarks/staleness_study.py            # the full study (about an hour on 2 cores), writes docs/data/
    python benchmarks/staleness_study.py --quick    # a few short runs (CI), writes to a temp dir
    python benchmarks/staleness_study.py --seeds 100-105   # every cell on seeds 100..105 (files *_seeds100-105*)

Results: `docs/data/staleness_study.md` (tables: mean and spread over seeds, the exact command, machine, time) and PNG
figures under `docs/data/`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from study import (
    COLLAPSE,
    KEPT,
    METHODS,
    STALENESS,
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


def plan(quick: bool, seeds: list[int] | None = None) -> list[dict]:
    """(method, staleness, lr, seed) runs: every method at the highest staleness with two learning rates, and a
    staleness sweep of fixed [0.8,1.2] vs BAPO paper. ``seeds`` (``--seeds``): every cell on these seeds instead."""
    if quick:
        return [dict(method=m, staleness="spg 8", lr=1e-3, seed=(seeds or [0])[0], steps=24)
                for m in ("fixed [0.8,1.2]", "BAPO paper")]
    first, more = (seeds, seeds) if seeds else (range(3), range(3, 6))
    runs = []
    for method in METHODS:
        for lr in (1e-3, 2e-3):
            for seed in first:
                runs.append(dict(method=method, staleness="spg 32", lr=lr, seed=seed, steps=160))
    # three more seeds where the differences at staleness 32 are small
    for method in ("fixed [0.8,1.5]", "widest fixed [0.9,3.0]", "BAPO paper", "BAPO verl") if not seeds else ():
        for lr in (1e-3, 2e-3):
            for seed in more:
                runs.append(dict(method=method, staleness="spg 32", lr=lr, seed=seed, steps=160))
    for staleness in ("on-policy", "spg 8", "spg 16", "replay 0.5"):
        for method in ("fixed [0.8,1.2]", "BAPO paper"):
            for seed in first:
                runs.append(dict(method=method, staleness=staleness, lr=1e-3, seed=seed, steps=160))
    return runs


COLUMNS = [("final reward", "reward_final"), ("held-out acc.", "heldout_accuracy"), ("final entropy", "entropy_final"),
           ("pos. share", "positive_share"), ("c_low", "clip_low"), ("c_high", "clip_high"),
           ("clip frac A<0", "clip_frac_neg"), ("clip frac A>0", "clip_frac_pos"), ("target met", "target_met"),
           ("search exhausted", "exhausted"), ("max grad norm", "grad_norm_max")]


def figures(runs, out_dir, name: str = "staleness_study.png") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    main = [r for r in runs if r["staleness"] == "spg 32" and r["lr"] == 1e-3] or runs
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for method in METHODS:
        members = [r for r in main if r["method"] == method]
        if not members:
            continue
        steps = [e["step"] for e in members[0]["history"] if "reward" in e]
        curves = [[e["reward"] for e in r["history"] if "reward" in e] for r in members]
        n = min(map(len, curves))
        axes[0].plot(steps[:n], [statistics.mean(c[i] for c in curves) for i in range(n)], marker="o", label=method)
        sums = [summarize(r) for r in members]
        axes[1].scatter([s["reward_final"] for s in sums], [s["entropy_final"] for s in sums], label=method)
    axes[0].set(title=f"Reward per generation ({main[0]['staleness']}, lr {main[0]['lr']})",
                xlabel="optimizer step", ylabel="mean reward")
    axes[1].set(title="Final entropy against final reward (one dot per run)", xlabel="final reward",
                ylabel="entropy (nats/token)")
    sweep = [r for r in runs if r["lr"] == 1e-3 and r["method"] in ("fixed [0.8,1.2]", "BAPO paper")]
    order = [s for s in STALENESS if any(r["staleness"] == s for r in sweep)]
    for k, method in enumerate(("fixed [0.8,1.2]", "BAPO paper")):
        means = [mean([summarize(r)["reward_final"] for r in sweep if r["method"] == method and r["staleness"] == s])
                 for s in order]
        axes[2].bar([i + 0.4 * k for i in range(len(order))], means, width=0.4, label=method)
    axes[2].set_xticks([i + 0.2 for i in range(len(order))], order)
    axes[2].set(title="Final reward by staleness (lr 1e-3)", ylabel="final reward")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    written.append(path)
    return written


def write_report(runs, out_dir, command, elapsed, quick, figure="staleness_study.png") -> str:
    main = lambda lr: (lambda r: r["staleness"] == "spg 32" and r["lr"] == lr)  # noqa: E731
    discussion = os.path.join(os.path.dirname(os.path.abspath(__file__)), "staleness_discussion.md")
    sections = [
        "# Staleness study (tiny scale)\n",
        *([open(discussion).read()] if os.path.exists(discussion) and not quick else []),
        "## How the numbers were made\n",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} ({platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads 1 per run, 2 runs in parallel) in {elapsed / 60:.1f} minutes. Task: reverse a 3-digit string "
        "(embedded tiny model, 2 layers, ~90k parameters, warm-started so wrong answers are longer than right ones). "
        "160 optimizer steps, batch 32 completions (4 prompts x 8), dapo aggregation, constant learning rate. Final "
        "reward = mean sampled reward over the last 20% of steps; held-out accuracy = greedy exact match on 200 "
        f"prompts never trained on; collapsed = final reward < {COLLAPSE}. Mean ± standard deviation over seeds.\n",
    ]
    if quick:
        sections.append("**Quick mode (CI smoke): numbers are not meaningful.**\n")
        sections.append(table(runs, "method", lambda r: True, COLUMNS))
    else:
        for lr in (1e-3, 2e-3):
            sections.append(f"\n## All methods at staleness 32 (steps_per_generation=32), lr {lr}\n")
            sections.append(table(runs, "method", main(lr), COLUMNS))
        sections.append("\n## Staleness sweep, lr 1e-3\n")
        for method in ("fixed [0.8,1.2]", "BAPO paper"):
            sections.append(f"\n### {method}\n")
            sections.append(table(runs, "staleness", lambda r, m=method: r["method"] == m and r["lr"] == 1e-3,
                                  COLUMNS[:4] + COLUMNS[8:10]))
    sections.append(f"\n![staleness study]({figure})\n")
    return "\n".join(sections)


def line(i: int, n: int, result: dict) -> str:
    s = summarize(result)
    return (f"[{i + 1}/{n}] {result['method']:<24} {result['staleness']:<10} lr {result['lr']} seed {result['seed']}: "
            f"final reward {s['reward_final']:.3f}, held-out {s['heldout_accuracy']:.3f}, entropy "
            f"{s['entropy_final']:.3f} ({result['seconds']:.0f}s)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short runs (CI smoke test)")
    parser.add_argument("--out", default=None, help="output directory (default: docs/data/, a temp dir with --quick)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", default=None, help="A-B: run every cell on seeds A..B instead (files get a "
                        "_seedsA-B suffix)")
    parser.add_argument("--reuse", default=None, help="a staleness_runs.json from an earlier run: its runs are kept "
                        "and not run again (same method, staleness, lr, seed, steps)")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds) if args.seeds else None
    out_dir = output_dir(args.out, args.quick, "staleness-")
    from bapo_trl.recipes.toy import build_tiny_model

    build_tiny_model()  # once, before the workers race for the cache
    results, todo = reuse(plan(args.quick, seeds), args.reuse)
    reused, started = len(results), time.time()
    results += run_all(todo, args.workers, line)
    # wall time of this invocation plus an estimate for reused runs (their run time over the workers)
    elapsed = time.time() - started + sum(r["seconds"] for r in results[:reused]) / max(1, args.workers)
    command = "python benchmarks/staleness_study.py" + (" --quick" if args.quick else "") + (
        f" --seeds {args.seeds}" if args.seeds else "")
    for run in results:  # runs reused from an older file may carry every metric: keep the same subset
        run["history"] = [{k: v for k, v in h.items() if k in KEPT} for h in run["history"]]
    tag = seed_tag(args.seeds)
    save_runs(results, os.path.join(out_dir, f"staleness_runs{tag}.json.gz"))
    figures(results, out_dir, f"staleness_study{tag}.png")
    name = f"staleness_study{tag}.md" if not args.quick else "staleness_study_quick.md"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(write_report(results, out_dir, command, elapsed, args.quick, f"staleness_study{tag}.png"))
    bapo = [summarize(r)["reward_final"] for r in results if r["method"] == "BAPO paper"]
    fixed = [summarize(r)["reward_final"] for r in results if r["method"] == "fixed [0.8,1.2]"]
    print(f"wrote {os.path.join(out_dir, name)}")
    print(f"runs={len(results)} bapo_final_reward={mean(bapo):.3f} fixed_final_reward={mean(fixed):.3f} "
          f"minutes={elapsed / 60:.1f}")


if __name__ == "__main__":
    sys.exit(main())
