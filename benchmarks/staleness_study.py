"""The paper's staleness questions at tiny scale (its Fig. 2/7/9/11), on the embedded reversal task.

Does an adaptive window help when the data is stale, and is it the ADAPTING or merely the WIDENING that helps?
Methods: fixed windows [0.8, 1.2], [0.8, 1.28] (clip-higher), [0.8, 1.5], [0.5, 1.2], the widest fixed window
BAPO can reach [0.9, 3.0], and BAPO (paper default, gradient share, official-code variant). Staleness comes from
`steps_per_generation` (1 = on-policy, 8, 16, 32) and from replay. Every fixed window is a BAPOConfig whose search
path has one point, so every run logs the same metrics.

    python benchmarks/staleness_study.py            # the full study (about an hour on 2 cores), writes docs/
    python benchmarks/staleness_study.py --quick    # a few short runs (CI), writes to a temp dir

Results: `docs/results.md` (tables: mean and spread over seeds, the exact command, machine, time) and PNG
figures under `docs/`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

from bapo_trl.cli.summary import moved  # one definition of "the bounds moved"

METHODS = {
    "fixed [0.8,1.2]": dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.2, ratio_upper_max=1.2),
    "clip-higher [0.8,1.28]": dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.28,
                                   ratio_upper_max=1.28),
    "fixed [0.8,1.5]": dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.5, ratio_upper_max=1.5),
    "fixed [0.5,1.2]": dict(ratio_lower_start=0.5, ratio_lower_max=0.5, ratio_upper_start=1.2, ratio_upper_max=1.2),
    "widest fixed [0.9,3.0]": dict(ratio_lower_start=0.9, ratio_lower_max=0.9, ratio_upper_start=3.0,
                                   ratio_upper_max=3.0),
    "BAPO paper": dict(),
    "BAPO gradient share": dict(positive_contribution_mode="gradient"),
    "BAPO verl": dict(bapo_variant="verl"),
}
STALENESS = {
    "on-policy": dict(steps_per_generation=1),
    "spg 8": dict(steps_per_generation=8),
    "spg 16": dict(steps_per_generation=16),
    "spg 32": dict(steps_per_generation=32),
    "replay 0.5": dict(steps_per_generation=1, replay_buffer_size=64, replay_ratio=0.5, replay_max_staleness=16),
}
COLLAPSE = 0.1  # final reward below this: the run collapsed
#: Per-step metrics kept in docs/staleness_runs.json.gz (enough to redo every table and figure).
KEPT = ("step", "loss", "grad_norm", "reward", "entropy", "bapo/clip_low", "bapo/clip_high",
        "bapo/positive_contribution", "bapo/positive_contribution_before", "bapo/clip_fraction_negative",
        "bapo/clip_fraction_positive", "bapo/target_met", "bapo/search_exhausted", "bapo/search_steps",
        "bapo/staleness_mean", "replay/fraction", "bapo/positive_contribution_target", "entropy_clip/predicted_change",
        "entropy_clip/predicted_change_all", "entropy_clip/clip_effect", "entropy_clip/clipped_pos_low",
        "entropy_clip/clipped_pos_high", "entropy_clip/clipped_neg_low", "entropy_clip/clipped_neg_high")


def plan(quick: bool) -> list[dict]:
    """(method, staleness, lr, seed) runs: every method at the highest staleness with two learning rates, and a
    staleness sweep of fixed [0.8,1.2] vs BAPO paper."""
    if quick:
        return [dict(method=m, staleness="spg 8", lr=1e-3, seed=0, steps=24)
                for m in ("fixed [0.8,1.2]", "BAPO paper")]
    runs = []
    for method in METHODS:
        for lr in (1e-3, 2e-3):
            for seed in range(3):
                runs.append(dict(method=method, staleness="spg 32", lr=lr, seed=seed, steps=160))
    # three more seeds where the differences at staleness 32 are small
    for method in ("fixed [0.8,1.5]", "widest fixed [0.9,3.0]", "BAPO paper", "BAPO verl"):
        for lr in (1e-3, 2e-3):
            for seed in range(3, 6):
                runs.append(dict(method=method, staleness="spg 32", lr=lr, seed=seed, steps=160))
    for staleness in ("on-policy", "spg 8", "spg 16", "replay 0.5"):
        for method in ("fixed [0.8,1.2]", "BAPO paper"):
            for seed in range(3):
                runs.append(dict(method=method, staleness=staleness, lr=1e-3, seed=seed, steps=160))
    return runs


def run_one(spec: dict) -> dict:
    """One training run in a fresh process (one torch thread): its per-step history and a summary. ``spec``:
    method, staleness, lr, seed, steps; optional ``settings`` (config fields; default: the method's), ``trainer``
    (``"trl"``: TRL's own GRPOConfig / GRPOTrainer instead of BAPO's) and ``extra_metrics`` (kept besides KEPT)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bapo_trl import BAPOConfig, BAPOTrainer
    from bapo_trl.toy import build_tiny_model, evaluate_accuracy, make_reverse_dataset, reverse_reward

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if spec.get("trainer") == "trl" else (BAPOConfig, BAPOTrainer)
    kept = KEPT + tuple(spec.get("extra_metrics", ()))
    model_dir = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = time.time()
    with tempfile.TemporaryDirectory() as out:
        args = config_cls(
            output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
            save_strategy="no", disable_tqdm=True, logging_steps=1, per_device_train_batch_size=32,
            num_generations=8, max_completion_length=12, temperature=1.0, lr_scheduler_type="constant",
            learning_rate=spec["lr"], seed=spec["seed"], max_steps=spec["steps"],
            **spec.get("settings", METHODS.get(spec["method"], {})), **STALENESS[spec["staleness"]],
        )
        trainer = trainer_cls(model=model_dir, reward_funcs=reverse_reward, args=args,
                              train_dataset=make_reverse_dataset(8192, seed=spec["seed"]), processing_class=tokenizer)
        trainer.train()
        accuracy = evaluate_accuracy(trainer.model, tokenizer, make_reverse_dataset(200, seed=1, split="test"))
    history = [{k: v for k, v in h.items() if k in kept} for h in trainer.state.log_history if "loss" in h]
    return {**spec, "history": history, "heldout_accuracy": accuracy, "seconds": time.time() - started}


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def summarize(run: dict) -> dict:
    h = run["history"]
    rewards = [e["reward"] for e in h if "reward" in e]
    tail = h[int(len(h) * 0.8):]  # the last 20% of steps
    return {
        "reward_first": rewards[0] if rewards else float("nan"),
        "reward_final": _mean([e.get("reward") for e in tail]) if any("reward" in e for e in tail) else rewards[-1],
        "heldout_accuracy": run["heldout_accuracy"],
        "entropy_final": _mean([e.get("entropy") for e in tail]),
        "positive_share": _mean([e.get("bapo/positive_contribution") for e in h]),
        "clip_low": _mean([e.get("bapo/clip_low") for e in h]),
        "clip_high": _mean([e.get("bapo/clip_high") for e in h]),
        "clip_frac_neg": _mean([e.get("bapo/clip_fraction_negative") for e in h]),
        "clip_frac_pos": _mean([e.get("bapo/clip_fraction_positive") for e in h]),
        "target_met": _mean([e.get("bapo/target_met") for e in h]),
        "exhausted": _mean([e.get("bapo/search_exhausted") for e in h]),
        "moved": _mean([moved(e) for e in h]),  # inactive updates (nothing on the path changes the loss) excluded
        "grad_norm_max": max((e.get("grad_norm", 0) for e in h), default=float("nan")),
    }


def _fmt(values, digits=2):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(runs, rows_key, filter_fn, columns):
    groups: dict = {}
    for run in runs:
        if filter_fn(run):
            groups.setdefault(run[rows_key], []).append(run)
    header = f"| {rows_key} | n | " + " | ".join(c[0] for c in columns) + " | collapsed |"
    lines = [header, "|" + "---|" * (len(columns) + 3)]
    for key, members in groups.items():
        sums = [summarize(m) for m in members]
        cells = [_fmt([s[c[1]] for s in sums], c[2] if len(c) > 2 else 2) for c in columns]
        collapsed = sum(s["reward_final"] < COLLAPSE for s in sums)
        lines.append(f"| {key} | {len(members)} | " + " | ".join(cells) + f" | {collapsed} |")
    return "\n".join(lines)


COLUMNS = [("final reward", "reward_final"), ("held-out acc.", "heldout_accuracy"), ("final entropy", "entropy_final"),
           ("pos. share", "positive_share"), ("c_low", "clip_low"), ("c_high", "clip_high"),
           ("clip frac A<0", "clip_frac_neg"), ("clip frac A>0", "clip_frac_pos"), ("target met", "target_met"),
           ("search exhausted", "exhausted"), ("max grad norm", "grad_norm_max")]


def figures(runs, out_dir) -> list[str]:
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
        means = [_mean([summarize(r)["reward_final"] for r in sweep if r["method"] == method and r["staleness"] == s])
                 for s in order]
        axes[2].bar([i + 0.4 * k for i in range(len(order))], means, width=0.4, label=method)
    axes[2].set_xticks([i + 0.2 for i in range(len(order))], order)
    axes[2].set(title="Final reward by staleness (lr 1e-3)", ylabel="final reward")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "staleness_study.png")
    fig.savefig(path, dpi=110)
    written.append(path)
    return written


def write_report(runs, out_dir, command, elapsed, quick) -> str:
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
    sections.append("\n![staleness study](staleness_study.png)\n")
    return "\n".join(sections)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short runs (CI smoke test)")
    parser.add_argument("--out", default=None, help="output directory (default: docs/, or a temp dir with --quick)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reuse", default=None, help="a staleness_runs.json from an earlier run: its runs are kept "
                        "and not run again (same method, staleness, lr, seed, steps)")
    args = parser.parse_args(argv)
    out_dir = args.out or (tempfile.mkdtemp(prefix="staleness-") if args.quick else
                           os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs"))
    os.makedirs(out_dir, exist_ok=True)
    from bapo_trl.toy import build_tiny_model

    build_tiny_model()  # once, before the workers race for the cache
    runs_plan = plan(args.quick)
    results = []
    if args.reuse:
        key = lambda r: (r["method"], r["staleness"], r["lr"], r["seed"], r["steps"])  # noqa: E731
        wanted = {key(r) for r in runs_plan}
        with (gzip.open(args.reuse, "rt") if args.reuse.endswith(".gz") else open(args.reuse)) as f:
            results = [r for r in json.load(f) if key(r) in wanted]
        done = {key(r) for r in results}
        runs_plan = [r for r in runs_plan if key(r) not in done]
        print(f"reusing {len(results)} runs from {args.reuse}; {len(runs_plan)} to run")
    reused = len(results)
    started = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for i, result in enumerate(pool.imap_unordered(run_one, runs_plan)):
            results.append(result)
            s = summarize(result)
            print(f"[{i + 1}/{len(runs_plan)}] {result['method']:<24} {result['staleness']:<10} lr {result['lr']} "
                  f"seed {result['seed']}: final reward {s['reward_final']:.3f}, held-out {s['heldout_accuracy']:.3f}, "
                  f"entropy {s['entropy_final']:.3f} ({result['seconds']:.0f}s)", flush=True)
    # wall time of this invocation plus an estimate for reused runs (their run time over the workers)
    elapsed = time.time() - started + sum(r["seconds"] for r in results[:reused]) / max(1, args.workers)
    command = "python benchmarks/staleness_study.py" + (" --quick" if args.quick else "")
    for run in results:  # runs reused from an older file may carry every metric: keep the same subset
        run["history"] = [{k: v for k, v in h.items() if k in KEPT} for h in run["history"]]
    with gzip.open(os.path.join(out_dir, "staleness_runs.json.gz"), "wt") as f:
        json.dump(results, f)
    figures(results, out_dir)
    name = "results.md" if not args.quick else "results_quick.md"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(write_report(results, out_dir, command, elapsed, args.quick))
    bapo = [summarize(r)["reward_final"] for r in results if r["method"] == "BAPO paper"]
    fixed = [summarize(r)["reward_final"] for r in results if r["method"] == "fixed [0.8,1.2]"]
    print(f"wrote {os.path.join(out_dir, name)}")
    print(f"runs={len(results)} bapo_final_reward={_mean(bapo):.3f} fixed_final_reward={_mean(fixed):.3f} "
          f"minutes={elapsed / 60:.1f}")


if __name__ == "__main__":
    sys.exit(main())
