"""Swap the class, keep your config (issue 64): for each config C as its users run it, ``BAPOConfig(**C)`` on
``BAPOTrainer`` against ``GRPOConfig(**C)`` on TRL's ``GRPOTrainer``, paired by seed (the same prompts in the same
order), final reward as the mean paired difference with a 95% bootstrap interval.

The configs (:data:`CONFIGS`): TRL's ``GRPOConfig`` defaults; dapo clip-higher (epsilon 0.2 / 0.28); GSPO as TRL
documents it; CISPO with TRL's documented cap (``epsilon_high=5.0``); SAPO and VESPO at TRL's defaults. BAPO(C) gets
nothing but C: the search path is the rule's (``bapo_trl.core.window_rule``) and every other BAPO field its
default (the dual clip included), as a user who swaps the two classes gets them.

The cells: staleness 8 and 32 (``steps_per_generation``), lr 1e-3 and 2e-3, on the 3-digit task and the 2-8-digit
task (``--task``), 160 steps, the study harness's run (``study.run_one``). The claim, written before the
confirmation ran (docs/data/dropin_protocol.md): in no cell does BAPO(C) - TRL(C)'s interval lie below zero, and for
each C BAPO(C) beats TRL(C) in at least one cell. Development seeds 100-109; confirmation seeds 700-719.

    python benchmarks/dropin_study.py --seeds 100-109                       # development, 3 digits (resumable)
    python benchmarks/dropin_study.py --seeds 100-109 --task reverse2-8     # development, 2-8 digits
    python benchmarks/dropin_study.py --seeds 700-719 --scenarios "replay 0.5,partial rollout"  # BAPO-only ones
    python benchmarks/dropin_study.py --report                              # report of both tasks' runs files
    python benchmarks/dropin_study.py --replicate                           # the beats again, seeds 1000-1019
    python benchmarks/dropin_study.py --readme                              # the README's table
    python benchmarks/dropin_study.py --quick                               # two short runs and the report (CI)

Runs files: ``docs/data/dropin_runs.jsonl`` and ``docs/data/dropin_runs_reverse2-8.jsonl`` (one line per run,
resumable: a run already there is skipped); report ``docs/data/dropin_study.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from evidence_study import TASK_NAMES, by_seed, interval, run_study
from study import (
    DEFAULT_TASK,
    REPO,
    STALENESS,
    TASKS,
    fmt_seeds,
    paired,
    parse_seeds,
    read_jsonl,
    task_model,
    task_of,
    verdict,
)

from bapo_trl.trainer.presets import GSPO_DOCUMENTED

#: Each config as its users run it (TRL's documented settings; "TRL defaults" is GRPOConfig's).
CONFIGS = {
    "TRL defaults": {},
    "dapo clip-higher": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
    "GSPO (documented)": dict(GSPO_DOCUMENTED),
    "CISPO (documented)": dict(loss_type="cispo", epsilon_high=5.0),
    "SAPO": dict(loss_type="sapo"),
    "VESPO": dict(loss_type="vespo"),
}
SCENARIOS = ("spg 8", "spg 32")
#: The scenarios only BAPOTrainer runs (issue 64, item 2), each with the scenario its TRL(C) runs in: the same
#: updates per generation batch on TRL's own trainer, without what BAPOTrainer adds (replay and partial rollout: one
#: update per batch, on-policy; async: four updates per batch, TRL's in-process generation, since TRL's server mode
#: needs CUDA for its weight sync: the protocol's amendment). A user reads what turning the scenario on costs or
#: gains against what TRL gave them.
BAPO_SCENARIOS = {"replay 0.5": "on-policy", "partial rollout": "on-policy", "async K=1": "spg 4",
                  "async K=2": "spg 4"}
#: What TRL itself requires of a config in a vLLM scenario (async): VESPO with vLLM refuses TRL's default
#: ``vllm_importance_sampling_mode`` ("sequence_mask") and asks for a token-level one; "token_truncate" is the one
#: TRL's documentation lists first, as the default (the protocol's amendment).
VLLM_REQUIRES = {"VESPO": dict(vllm_importance_sampling_mode="token_truncate")}
LEARNING_RATES = (1e-3, 2e-3)
STEPS = 160
DEV_SEEDS, CONFIRM_SEEDS = "100-109", "700-719"
#: The second fresh set (issue 77, item 7): every cell that beats on CONFIRM_SEEDS runs again here (``--replicate``),
#: and the README says which replicated. Never looked at before those runs.
REPLICATION_SEEDS = "1000-1019"


def methods(config: str) -> tuple[str, str]:
    """The pair's run names: BAPO(C) and TRL(C)."""
    return f"BAPO({config})", f"TRL({config})"


def specs(configs, scenarios, seeds, lrs=LEARNING_RATES, steps=STEPS, task=DEFAULT_TASK) -> list[dict]:
    """Runs in order: scenario, seed, rate, config, then BAPO(C) before TRL(C) (a study cut short leaves pairs). In a
    scenario only BAPOTrainer runs, TRL(C) runs in its rival scenario (:data:`BAPO_SCENARIOS`; once, when two
    scenarios share it)."""
    todo, keys = [], set()
    for scenario in scenarios:
        for seed in seeds:
            for lr in lrs:
                for config in configs:
                    for name, trainer in zip(methods(config), ("bapo", "trl")):
                        where = BAPO_SCENARIOS.get(scenario, scenario) if trainer == "trl" else scenario
                        if (name, where, lr, seed) in keys:
                            continue
                        keys.add((name, where, lr, seed))
                        settings = dict(CONFIGS[config])
                        if STALENESS[where].get("server"):
                            settings.update(VLLM_REQUIRES.get(config, {}))
                        todo.append(dict(method=name, staleness=where, lr=lr, seed=seed, steps=steps,
                                         trainer=trainer, settings=settings, trainer_kwargs={},
                                         **({} if task == DEFAULT_TASK else {"task": task})))
    return todo


def default_results(task: str) -> str:
    suffix = "" if task == DEFAULT_TASK else f"_{task}"
    return os.path.join(REPO, "docs", "data", f"dropin_runs{suffix}.jsonl")


def table(runs: list[dict], resamples: int = 10000, scenarios=SCENARIOS) -> tuple[list[str], dict]:
    """The report's table for one task's runs (a row per config, a column per cell: BAPO(C) - TRL(C) [interval] and
    the verdict), and per config the verdicts ``{cell: word}``. In a scenario of :data:`BAPO_SCENARIOS`, TRL(C)'s
    runs are those of its rival scenario (same seed and rate)."""
    order = {s: i for i, s in enumerate(scenarios)}
    cells = sorted({(r["staleness"], r["lr"]) for r in runs if r["staleness"] in order and r["method"].startswith(
        "BAPO(")}, key=lambda c: (order[c[0]], c[1]))
    head = "| config | " + " | ".join(f"{s.replace('spg', 'staleness')}, lr {lr:g}" for s, lr in cells) + " |"
    lines, verdicts = [head, "|---" * (len(cells) + 1) + "|"], {}
    for config in CONFIGS:
        bapo, trl = methods(config)
        row = []
        for cell in cells:
            values = by_seed(runs, cell, "reward_final")
            rival = (BAPO_SCENARIOS.get(cell[0], cell[0]), cell[1])
            values[trl] = by_seed(runs, rival, "reward_final").get(trl, {})
            c = paired(values, bapo, trl, resamples)
            if c["n"] < 2:
                row.append("-")
                continue
            word = verdict(c["low"], c["high"])
            verdicts.setdefault(config, {})[cell] = word
            row.append(f"{'**' if word != 'ties' else ''}{word} {interval(c)}{'**' if word != 'ties' else ''} "
                       f"(n={c['n']})")
        if any(x != "-" for x in row):
            lines.append(f"| {config} | " + " | ".join(row) + " |")
    return lines, verdicts


def claim(verdicts: dict) -> list[str]:
    """The pre-registered claim, config by config: no 'loses' in any cell, and at least one 'beats'."""
    out = []
    for config, words in verdicts.items():
        losses = [c for c, w in words.items() if w == "loses"]
        beats = [c for c, w in words.items() if w == "beats"]
        held = not losses and bool(beats)
        out.append(f"- {config}: {'holds' if held else 'FAILS'} ({len(beats)} beats, {len(losses)} loses, "
                   f"{len(words) - len(beats) - len(losses)} ties of {len(words)} cells)")
    return out


def complete(runs: list[dict], scenarios=SCENARIOS) -> bool:
    """Whether the confirmation runs hold every config x cell x seed of the protocol in ``scenarios``: BAPO(C) in the
    scenario, TRL(C) in its rival scenario (:data:`BAPO_SCENARIOS`; the same one for the claim's)."""
    want = set()
    for scenario in scenarios:
        for lr in LEARNING_RATES:
            for seed in parse_seeds(CONFIRM_SEEDS, count=False):
                for config in CONFIGS:
                    bapo, trl = methods(config)
                    want |= {(bapo, scenario, lr, seed), (trl, BAPO_SCENARIOS.get(scenario, scenario), lr, seed)}
    return want <= {(r["method"], r["staleness"], r["lr"], r["seed"]) for r in runs}


#: The README's short names of the configs (its table has a column per config).
SHORT = {"TRL defaults": "TRL's defaults", "dapo clip-higher": "clip-higher", "GSPO (documented)": "GSPO",
         "CISPO (documented)": "CISPO", "SAPO": "SAPO", "VESPO": "VESPO"}


def cell_verdicts(runs: list[dict], seeds: str, resamples: int = 10000) -> dict:
    """``{(scenario, lr, config): paired comparison with its verdict}`` over ``seeds`` (the README's cells)."""
    chosen = set(parse_seeds(seeds, count=False))
    runs = [r for r in runs if r["seed"] in chosen]
    out = {}
    for scenario in SCENARIOS:
        for lr in LEARNING_RATES:
            values = by_seed(runs, (scenario, lr), "reward_final")
            for config in CONFIGS:
                c = paired(values, *methods(config), resamples)
                out[(scenario, lr, config)] = {**c, "word": verdict(c["low"], c["high"]) if c["n"] >= 2 else None}
    return out


def replication_specs(tasks: dict[str, list[dict]], resamples: int = 10000) -> list[dict]:
    """The runs that repeat every cell beating on :data:`CONFIRM_SEEDS` on :data:`REPLICATION_SEEDS` (both
    trainers)."""
    todo = []
    for task, runs in tasks.items():
        for (scenario, lr, config), c in cell_verdicts(runs, CONFIRM_SEEDS, resamples).items():
            if c["word"] == "beats":
                todo += specs([config], [scenario], parse_seeds(REPLICATION_SEEDS, count=False), (lr,), task=task)
    return todo


def readme_table(tasks: dict[str, list[dict]], resamples: int = 10000) -> list[str]:
    """The README's table: a row per cell of both tasks, a column per config, BAPO(C) - TRL(C) on the confirmation
    seeds to three decimals ([interval]; bold where BAPO(C) beats, "loses" written out). A cell that beats there ran
    again on :data:`REPLICATION_SEEDS`: ``again:`` and that set's verdict follow it (``again: pending`` until those
    runs are in). Then the claim per config on each set. tests/test_readme.py checks the README holds these lines."""
    lines = ["| task, staleness, lr | " + " | ".join(SHORT[c] for c in CONFIGS) + " |", "|---" * (len(CONFIGS) + 1)
             + "|"]
    words: dict[str, list[str]] = {c: [] for c in CONFIGS}
    again: dict[str, list[str]] = {c: [] for c in CONFIGS}
    for task, runs in tasks.items():
        first = cell_verdicts(runs, CONFIRM_SEEDS, resamples)
        second = cell_verdicts(runs, REPLICATION_SEEDS, resamples)
        for scenario in SCENARIOS:
            for lr in LEARNING_RATES:
                row = []
                for config in CONFIGS:
                    c = first[(scenario, lr, config)]
                    word = c["word"]
                    words[config].append(word)
                    text = f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"
                    cell = f"**{text}**" if word == "beats" else f"loses {text}" if word == "loses" else text
                    if word == "beats":
                        repeat = second[(scenario, lr, config)]["word"] or "pending"
                        again[config].append(repeat)
                        cell += f" again: {repeat}"
                    row.append(cell)
                label = f"{TASK_NAMES.get(task, task)}, {scenario.split()[1]}, {lr:g}"
                lines.append(f"| {label} | " + " | ".join(row) + " |")
    held = ["holds" if "beats" in w and "loses" not in w else "**fails**" for w in words.values()]
    lines.append(f"| the claim on seeds {CONFIRM_SEEDS}: never loses, beats once | " + " | ".join(held) + " |")
    replicated = [f"{a.count('beats')} of {len(a)} beats" if a and "pending" not in a else "pending" if a else "-"
                  for a in again.values()]
    lines.append(f"| its beats again on seeds {REPLICATION_SEEDS} | " + " | ".join(replicated) + " |")
    return lines


def report(tasks: dict[str, list[dict]], resamples: int = 10000) -> str:
    lines = ["# Swap the class, keep your config: BAPO(C) - TRL(C)", "",
             "Final reward, mean paired difference over seeds with a 95% bootstrap interval; **beats**/**loses** "
             "only where the interval excludes zero. Generated by `python benchmarks/dropin_study.py --report` "
             "(issue 64; protocol: docs/data/dropin_protocol.md).", ""]
    both: dict[str, dict] = {}  # label -> config -> {(task, cell): word}
    incomplete: set[str] = set()  # tasks whose confirmation is still running
    for task, runs in tasks.items():
        if not runs:
            continue
        dev, confirm = set(parse_seeds(DEV_SEEDS)), set(parse_seeds(CONFIRM_SEEDS))
        for label, keep in (("development", lambda seed: seed in dev), ("confirmation", lambda seed: seed in confirm),
                            ("other", lambda seed: seed not in dev | confirm)):
            chosen = [r for r in runs if keep(r["seed"])]
            if not chosen:
                continue
            rows, verdicts = table(chosen, resamples)
            seen = sorted({r["seed"] for r in chosen})
            lines += [f"## {TASK_NAMES.get(task, task)}: {label} seeds ({fmt_seeds(seen)})", ""]
            if label == "confirmation" and not complete(chosen):
                incomplete.add(task)
                lines += ["**Incomplete: the confirmation is still running** (some cells have fewer than the "
                          f"protocol's {len(parse_seeds(CONFIRM_SEEDS))} seeds, `n` below): these are not its "
                          "reading yet.", ""]
            if verdicts:
                lines += [*rows, "", "The claim on this task alone, config by config:", "", *claim(verdicts), ""]
                for config, words in verdicts.items():
                    both.setdefault(label, {}).setdefault(config, {}).update(
                        {(task, cell): word for cell, word in words.items()})
            rows, verdicts = table(chosen, resamples, scenarios=tuple(BAPO_SCENARIOS))
            if verdicts:
                lines += ["Scenarios only BAPOTrainer runs, BAPO(C) there against TRL(C) without them (replay and "
                          "partial rollout: TRL on-policy, one update per batch; async, whose batches come from a "
                          "vLLM CPU server K batches ahead: TRL with the same four updates per batch and its own "
                          "in-process generation, since its server mode needs CUDA; the protocol's amendment). Not "
                          "part of the claim: what turning the scenario on costs or gains in reward at the same "
                          "number of steps (async's gain is wall-clock time, not measured here).", ""]
                if label == "confirmation" and not complete(chosen, tuple(BAPO_SCENARIOS)):
                    lines += ["**Incomplete: these runs are still going** (cells with fewer than the protocol's "
                              f"{len(parse_seeds(CONFIRM_SEEDS))} seeds, `n`, are not its reading yet; scenarios "
                              "not shown have not run).", ""]
                lines += [*rows, ""]
    for label, verdicts in both.items():
        lines += [f"## The claim over every cell of both tasks: {label} seeds", ""]
        if label == "confirmation" and (incomplete or len(tasks) < 2):
            lines += ["**Not the protocol's reading yet: the confirmation is still running.**", ""]
        lines += ["As the protocol states it (8 cells per config: no cell loses, at least one beats):", "",
                  *claim(verdicts), ""]
    return "\n".join(lines)


def both_tasks() -> dict[str, list[dict]]:
    """Each task's runs, from its runs file."""
    return {task: [r for r in read_jsonl(default_results(task)) if task_of(r) == task]
            for task in TASKS if os.path.exists(default_results(task))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=DEV_SEEDS, help=f"A-B (development {DEV_SEEDS}, confirmation "
                        f"{CONFIRM_SEEDS})")
    parser.add_argument("--task", default=DEFAULT_TASK, choices=list(TASKS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {list(SCENARIOS) + list(BAPO_SCENARIOS)}")
    parser.add_argument("--results", default=None, help="runs file (default docs/data/dropin_runs[_TASK].jsonl)")
    parser.add_argument("--report", action="store_true", help="only write the report from both tasks' runs files")
    parser.add_argument("--report-out", default=os.path.join(REPO, "docs", "data", "dropin_study.md"))
    parser.add_argument("--quick", action="store_true", help="two short runs and the report, in a temp dir (CI)")
    parser.add_argument("--readme", action="store_true", help="only print the README's table (confirmation seeds)")
    parser.add_argument("--replicate", action="store_true", help="run every cell that beats on the confirmation "
                        f"seeds again on seeds {REPLICATION_SEEDS} (resumable)")
    parser.add_argument("--resamples", type=int, default=10000)
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if set(scenarios) - set(SCENARIOS) - set(BAPO_SCENARIOS):
        parser.error(f"--scenarios: choose from {list(SCENARIOS) + list(BAPO_SCENARIOS)}")
    if args.quick:
        tmp = tempfile.mkdtemp(prefix="dropin-")
        results = os.path.join(tmp, "runs.jsonl")
        task_model(args.task)
        run_study(specs(["GSPO (documented)"], ["spg 8"], [0, 1], (1e-3,), 8, args.task), results)
        text = report({args.task: read_jsonl(results)}, args.resamples)
        print(text)
        return 0
    if args.readme:
        print("\n".join(readme_table(both_tasks(), args.resamples)))
        return 0
    if args.replicate:
        todo = replication_specs(both_tasks(), args.resamples)
        for task in TASKS:
            mine = [spec for spec in todo if task_of(spec) == task]
            if mine:
                task_model(task)
                run_study(mine, default_results(task))
        print("\n".join(readme_table(both_tasks(), args.resamples)))
        return 0
    if not args.report:
        task_model(args.task)  # built once here, not by each run
        run_study(specs(args.configs, scenarios, parse_seeds(args.seeds, count=False), task=args.task),
                  args.results or default_results(args.task))
    text = report(both_tasks(), args.resamples)
    with open(args.report_out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
