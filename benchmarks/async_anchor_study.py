"""BAPO's async generation beside TRL's own ``AsyncGRPOTrainer`` and both synchronous trainers, at equal wall-clock
and equal samples (issue 76; the protocol, written first: ``docs/data/async_anchor_protocol.md``).

Every run is its own process (a clean clock, its own CPU-seconds, nothing left over from the last trainer), against
one vLLM CPU server per (seed, task) block (every trainer pushes its own initial weights when training starts: TRL's
async trainer in its cold sync, BAPO's in its first push). Runs are interleaved: for each seed every trainer runs
before the next seed starts, in an order that rotates from block to block. Each run appends one line to the results
file as it ends, so the study resumes where it stopped; ``touch <results>.pause`` pauses it between two runs (remove
the file to go on), so a machine that must do something else for a while does not skew a run.

    python benchmarks/async_anchor_study.py run --seeds 100-104              # development seeds, both tasks/configs
    python benchmarks/async_anchor_study.py run --seeds 100-104 --again --results mine.jsonl   # reproduce them
    python benchmarks/async_anchor_study.py probe --seeds 100-104 [--probe heldout-30s]   # the held-out probe
    python benchmarks/async_anchor_study.py run --seeds 100-100 --tasks reverse3 --configs "TRL defaults" --quick
    python benchmarks/async_anchor_study.py report --results docs/data/async_anchor_runs.jsonl.gz NEW.jsonl \
        --compact docs/data/async_anchor_runs.jsonl.gz --seeds 100-104 --write docs/data/async_anchor_dev.md
    python benchmarks/async_anchor_study.py report --readme     # the README's table, from the committed runs

The report reads a run's reward at equal wall-clock (B1 = the seconds TRL sync takes for 160 steps on that seed,
and B1/2), per sample consumed (trained or dropped) and as the time to a target reward, each paired by seed with a
95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from study import (  # noqa: E402
    TASKS,
    TRAINING,
    append_jsonl,
    bootstrap_ci,
    commit,
    fmt_seeds,
    parse_seeds,
    read_jsonl,
)

#: The trainers (protocol's table). ``server``: generation in the vLLM server; ``threads``: torch threads (a trainer
#: without the server gets the machine's two cores, as its users' would; one beside a server gets one core, the
#: server the other: the protocol's amendment of 2026-11-29).
TRAINERS = {
    "TRL sync": dict(kind="trl", server=False),
    "BAPO sync": dict(kind="bapo", server=False),
    "BAPO sync server": dict(kind="bapo", server=True),
    "BAPO async K=1": dict(kind="bapo", server=True, settings=dict(async_generation=True, max_staleness=1)),
    "BAPO async K=2": dict(kind="bapo", server=True, settings=dict(async_generation=True, max_staleness=2)),
    "TRL async": dict(kind="trl-async", server=True, max_staleness=4),
    "TRL async matched": dict(kind="trl-async", server=True, max_staleness=1),
}
#: The configs C, as their users set them (the drop-in study's names). GSPO is not run: ``AsyncGRPOConfig`` has no
#: ``loss_type`` or ``importance_sampling_level``.
CONFIGS = {"TRL defaults": {}, "dapo clip-higher": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)}
LEARNING_RATE = 1e-3
#: TRL sync's steps that define the wall-clock budget B1 (its seconds for them, per seed).
BUDGET_STEPS = 160
#: Every trainer trains until this many seconds have passed on its training clock: about 10x B1 on this machine
#: (TRL sync's 160 steps take 2-3 s here), long enough for the server trainers to reach the time-to-target readings.
SECONDS_CAP = 30.0
#: Generation batches smoothed for a reading (the protocol's "mean of the last 10 logged batches").
WINDOW = 10
#: Time-to-target thresholds per task (protocol).
TARGET = {"reverse3": 0.5, "reverse2-8": 0.2}
#: Per-step metrics kept (enough to redo every reading).
KEPT_PREFIXES = ("reward", "loss", "sample/", "batch/samples", "async/", "bapo/staleness", "bapo/weight_sync_lag",
                 "perf/step_s", "perf/rollout_wait_s", "bapo/clip_low", "bapo/clip_high")
QUICK = dict(steps=8, cap=10.0)
#: The runs committed so far (compact): a new invocation skips them, and the report reads them with new raw files.
COMMITTED = REPO / "docs" / "data" / "async_anchor_runs.jsonl.gz"
#: The probe's committed runs (compact), read and skipped the same way.
PROBE_COMMITTED = REPO / "docs" / "data" / "async_anchor_probe_runs.jsonl.gz"


def run_key(run: dict) -> tuple:
    """A study run's key; a probe's run (:func:`probe_plan`) has the probe's name in it too."""
    key = run["trainer"], run["config"], run["task"], run["seed"]
    return key + (run["probe"],) if "probe" in run else key


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def plan(seeds: list[int], tasks: list[str], configs: list[str], trainers: list[str]) -> list[dict]:
    """Runs in the protocol's order: seed by seed, every (task, config) block whole, trainers rotating."""
    todo, block = [], 0
    for seed in seeds:
        for task in tasks:
            for config in configs:
                for name in rotated(trainers, block):
                    todo.append(dict(trainer=name, config=config, task=task, seed=seed))
                block += 1
    return todo


# -- one run (in its own process) -------------------------------------------------------------------------------------

def train_one(spec: dict, url: str | None, steps: int, cap: float) -> dict:
    """One run: the trainer's per-step history with each step's end on the training clock, and its CPU-seconds."""
    import resource

    import torch
    from transformers import AutoTokenizer, TrainerCallback

    trainer_spec = TRAINERS[spec["trainer"]]
    threads = 1 if trainer_spec["server"] else 2
    torch.set_num_threads(threads)
    if trainer_spec["server"]:
        from server_bench import TRAINER_CORE

        os.sched_setaffinity(0, {TRAINER_CORE})
    from study import task_model

    task = TASKS[spec["task"]]
    model_dir = task_model(spec["task"])
    settings = dict(CONFIGS[spec["config"]])
    ends: list[float] = []
    clock = {"start": 0.0, "consumed": 0.0}
    until = spec.get("until_samples")  # a probe's run may end once it has consumed this many samples
    out = tempfile.mkdtemp(prefix="anchor-run-")
    reward = ScoredLog(str(Path(out) / "scored.jsonl")) if spec.get("probe") else None

    class Clock(TrainerCallback):
        """Each step's end on the training clock; stops a capped run at ``cap`` seconds (or a probe's at
        ``until_samples`` consumed, counted as :func:`compact` counts them)."""

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter() - clock["start"])
            if ends[-1] >= cap:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if until and logs and "reward" in logs:
                clock["consumed"] += samples_consumed(logs)
                if clock["consumed"] >= until:
                    control.should_training_stop = True

    max_steps = 100_000 if steps == BUDGET_STEPS else steps  # the study: the clock ends the run
    built = time.perf_counter()
    if trainer_spec["kind"] == "trl-async":
        from trl_async_anchor import apply_glue, async_trainer

        apply_glue()
        trainer = async_trainer(model_dir, url, Path(out), max_steps, trainer_spec["max_staleness"], spec["seed"],
                                TRAINING["per_device_train_batch_size"], TRAINING["num_generations"],
                                task["max_completion_length"], LEARNING_RATE, settings.get("epsilon", 0.2),
                                settings.get("epsilon_high"), digits=task["digits"], callbacks=[Clock()],
                                token_budget=0, reward_func=reward)  # the same 32 samples a step as the others
    else:
        from study import trainer_classes

        from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

        config_cls, trainer_cls = trainer_classes(trainer_spec["kind"])
        if trainer_spec["server"]:
            settings.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=120,
                            **trainer_spec.get("settings", {}))
        training = dict(TRAINING, max_completion_length=task["max_completion_length"])
        args = config_cls(output_dir=out, learning_rate=LEARNING_RATE, seed=spec["seed"], max_steps=max_steps,
                          **training, **settings)
        trainer = trainer_cls(model=model_dir, reward_funcs=reward or reverse_reward, args=args, callbacks=[Clock()],
                              train_dataset=make_reverse_dataset(8192, seed=spec["seed"], digits=task["digits"]),
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
    setup = time.perf_counter() - built
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    clock["start"] = time.perf_counter()  # the user's wait from train(): BAPO's producer starts before on_train_begin
    trainer.train()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    history = [{k: v for k, v in h.items() if k == "step" or k.startswith(KEPT_PREFIXES)}
               for h in trainer.state.log_history if "loss" in h or "reward" in h]
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    scored = {}
    if reward is not None:  # a probe's run
        scored = dict(reward.summary(until=time.time()), **heldout_scores(trainer.model, model_dir, spec))
    return dict(spec, history=history, step_seconds=ends, setup_seconds=setup, trainer_cpu_seconds=cpu,
                threads=threads, steps=trainer.state.global_step, **scored)


class ScoredLog:
    """The task's reward, appending ``[time, digits, reward]`` of every sample it scores to a file: what a trainer
    generated, kept or not (TRL's async trainer scores in its rollout worker's process: this is pickled there)."""

    __name__ = "reverse_reward"

    def __init__(self, path: str):
        self.path = path

    def __call__(self, completions, answer, **kwargs):
        from bapo_trl.recipes.toy import reverse_reward

        scores = reverse_reward(completions, answer, **kwargs)
        with open(self.path, "a") as f:
            f.writelines(json.dumps([time.time(), len(a), r]) + "\n" for a, r in zip(answer, scores))
        return scores

    def summary(self, until: float) -> dict:
        """Mean reward and count of the samples scored by ``until`` (a worker may score more before it stops)."""
        rows = [r for r in read_jsonl(self.path) if r[0] <= until]
        return {"scored_mean": statistics.mean(r[2] for r in rows), "scored_count": len(rows)}


#: The held-out prompts a probe's policy is scored on (the task's test split: digit sums the training split never
#: has), sampled as in training (T = 1, no top-k) and greedy.
HELDOUT_PROMPTS, HELDOUT_SEED = 512, 9_999


def heldout_scores(trained, model_dir: str, spec: dict) -> dict:
    """The trained weights, copied into a fresh model of the task (plain attention, whatever the trainer patched),
    scored on :data:`HELDOUT_PROMPTS` prompts: mean sampled reward, greedy accuracy, and both per number of digits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo_trl.recipes.toy import make_reverse_dataset, score_completions

    task = TASKS[spec["task"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict({k: v.detach().cpu() for k, v in trained.state_dict().items()})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_reverse_dataset(HELDOUT_PROMPTS, seed=HELDOUT_SEED, split="test", digits=task["digits"])
    torch.manual_seed(spec["seed"])
    scores = {mode: score_completions(model, tokenizer, rows, max_new_tokens=task["max_completion_length"],
                                      batch_size=128, **sampling)
              for mode, sampling in (("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
                                     ("greedy", {}))}
    digits = [len(a) for a in rows["answer"]]
    return {"heldout_" + mode: statistics.mean(values) for mode, values in scores.items()} | {
        "heldout_by_digits": {mode: {d: statistics.mean(v for v, n in zip(values, digits) if n == d)
                                     for d in sorted(set(digits))} for mode, values in scores.items()}}


# -- the readings -----------------------------------------------------------------------------------------------------

#: The async producer's timings a compact record keeps (per-step means): the server's generation of a batch, the
#: trainer's wait for it, the weight push (write) and the server's load of it.
ASYNC_TIMINGS = ("async/generate_seconds", "async/wait_seconds", "async/push_seconds", "async/load_seconds")
#: What a compact record keeps per run (besides its spec and :func:`compact`'s own fields).
RUN_FIELDS = ("setup_seconds", "trainer_cpu_seconds", "threads", "steps", "wall_seconds", "load_before", "commit",
              "server_cpu_seconds", "foreign_cpu_seconds", "attempts", "date")
#: What a probe's run adds (:func:`probe_report`).
PROBE_FIELDS = ("probe", "until_samples", "scored_mean", "scored_count", "heldout_sampled", "heldout_greedy",
                "heldout_by_digits")


def samples_consumed(logged: dict) -> float:
    """Samples one logged step consumed: trained, or dropped as too stale (TRL's async trainer counts those in
    ``sample/dropped_stale_total``; a trainer of ours trains 32 a step and drops none)."""
    return (logged.get("batch/samples_per_step", TRAINING["per_device_train_batch_size"])
            + logged.get("sample/dropped_stale_total", 0.0))


def write_compact(path: Path, runs: list[dict]) -> None:
    """The runs, compact, as ``docs/data`` keeps them (gzipped JSON lines)."""
    import gzip

    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(compact(run)) + "\n" for run in runs)


def compact(run: dict) -> dict:
    """A run as the report reads it and ``docs/data`` keeps it: per logged step ``[seconds, samples consumed,
    reward]`` (consumed: trained, or dropped as too stale, which TRL's async trainer counts in
    ``sample/dropped_stale_total``; a trainer of ours trains 32 a step and drops none), the drops, the largest
    staleness, and the per-step means of the async producer's timings. A compact record is returned as it is."""
    if "rows" in run:
        return run
    rows, consumed, dropped = [], 0.0, 0.0
    for h in run["history"]:
        if "reward" not in h:
            continue
        dropped += h.get("sample/dropped_stale_total", 0.0)
        consumed += samples_consumed(h)
        rows.append([round(run["step_seconds"][h["step"] - 1], 4), consumed, round(h["reward"], 5)])
    history = run["history"]
    means = {key: statistics.mean(h[key] for h in history if key in h)
             for key in ASYNC_TIMINGS if any(key in h for h in history)}
    stale = max((h.get("sample/staleness_max", h.get("bapo/staleness_max", 0.0)) for h in history), default=0.0)
    return {**{k: run[k] for k in ("trainer", "config", "task", "seed")}, **{k: run.get(k) for k in RUN_FIELDS},
            **{k: run[k] for k in PROBE_FIELDS if k in run},
            "rows": rows, "seconds": run["step_seconds"][-1], "dropped": dropped, "staleness_max": stale,
            "means": means}


def rewards_by_step(run: dict) -> list[list[float]]:
    """``[seconds, samples consumed, reward]`` of every logged step, in order (:func:`compact`)."""
    return compact(run)["rows"]


def reward_at(run: dict, limit: float, axis: int = 0) -> float:
    """The reward (mean of the last :data:`WINDOW` logged batches) of the steps ended by ``limit`` seconds
    (``axis`` 0) or samples consumed (``axis`` 1); the first logged batch's reward when none had ended (the policy it
    started with)."""
    rows = rewards_by_step(run)
    seen = [r[2] for r in rows if r[axis] <= limit]
    return statistics.mean(seen[-WINDOW:]) if seen else rows[0][2]


def seconds_to_target(run: dict, target: float) -> float | None:
    """The training clock when the running mean of :data:`WINDOW` batches first reaches ``target``; None: never."""
    rows = rewards_by_step(run)
    for j in range(WINDOW - 1, len(rows)):
        if statistics.mean(r[2] for r in rows[j - WINDOW + 1: j + 1]) >= target:
            return rows[j][0]
    return None


def budget_b1(runs: list[dict], config: str, task: str, seed: int) -> float | None:
    """B1: TRL sync's seconds for its first :data:`BUDGET_STEPS` steps on that seed."""
    for run in runs:
        rows = rewards_by_step(run) if run_key(run) == ("TRL sync", config, task, seed) else []
        if len(rows) >= BUDGET_STEPS:
            return rows[BUDGET_STEPS - 1][0]
    return None


#: The readings: name -> what is read of one run, given its block's B1 (None: not readable).
READINGS = {
    "reward at B1/2": lambda run, b1: reward_at(run, b1 / 2) if b1 else None,
    "reward at B1": lambda run, b1: reward_at(run, b1) if b1 else None,
    "reward at 30 s": lambda run, b1: reward_at(run, SECONDS_CAP),
    "reward at 5120 samples": lambda run, b1: reward_at(run, BUDGET_STEPS * TRAINING["per_device_train_batch_size"],
                                                        axis=1),
}
#: The paired comparisons (protocol's claims first): (trainer, reference).
PAIRS = (("BAPO async K=1", "TRL sync"), ("BAPO async K=1", "TRL async"), ("BAPO async K=1", "TRL async matched"),
         ("BAPO async K=1", "BAPO sync server"), ("BAPO async K=2", "BAPO async K=1"), ("BAPO sync", "TRL sync"),
         ("TRL async", "TRL sync"))


def readings(runs: list[dict]) -> dict:
    """``{(config, task): {reading: {trainer: {seed: value}}}}``, the time to target too (censored at the cap)."""
    table: dict = {}
    for run in runs:
        config, task, seed = run["config"], run["task"], run["seed"]
        b1 = budget_b1(runs, config, task, seed)
        block = table.setdefault((config, task), {})
        for name, read in READINGS.items():
            value = read(run, b1)
            if value is not None:
                block.setdefault(name, {}).setdefault(run["trainer"], {})[seed] = value
        reached = seconds_to_target(run, TARGET[task])
        block.setdefault("seconds to target", {}).setdefault(run["trainer"], {})[seed] = \
            reached if reached is not None else SECONDS_CAP
    return table


def paired_cell(values: dict, trainer: str, reference: str, digits: int = 2) -> str:
    seeds = sorted(set(values.get(trainer, {})) & set(values.get(reference, {})))
    if not seeds:
        return "n/a"
    diffs = [values[trainer][s] - values[reference][s] for s in seeds]
    low, high = bootstrap_ci(diffs)
    text = f"{statistics.mean(diffs):+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
    return f"**{text}**" if low > 0 or high < 0 else text


def run_facts(runs: list[dict]) -> list[str]:
    """Per trainer (all blocks): steps in 30 s, samples dropped, largest staleness, CPU-seconds of trainer + server,
    seconds to target reached / never."""
    lines = ["| trainer | steps in 30 s | s a step | dropped (of consumed) | staleness max | trainer CPU-s | "
             "server CPU-s | reached target |", "|---|---|---|---|---|---|---|---|"]
    for trainer in TRAINERS:
        mine = [compact(r) for r in runs if r["trainer"] == trainer]
        if not mine:
            continue
        steps = [r["steps"] for r in mine]
        reached = sum(seconds_to_target(r, TARGET[r["task"]]) is not None for r in mine)
        lines.append(f"| {trainer} | {statistics.median(steps):.0f} [{min(steps)}, {max(steps)}] | "
                     f"{statistics.median(r['seconds'] / r['steps'] for r in mine):.3f} | "
                     f"{statistics.mean(r['dropped'] / r['rows'][-1][1] for r in mine):.0%} | "
                     f"{max(r['staleness_max'] for r in mine):.0f} | "
                     f"{statistics.median(r['trainer_cpu_seconds'] for r in mine):.0f} | "
                     f"{statistics.median(r['server_cpu_seconds'] for r in mine):.0f} | {reached} of {len(mine)} |")
    return lines


def overlap_bound(runs: list[dict]) -> list[str]:
    """K=1 and K=2 beside the ideal overlap: per step, the server's busy time, its generation g
    (``async/generate_seconds``) and its load of each push (``async/load_seconds``: the generation thread applies a
    push between two requests, and the server generates nothing while it loads), and the trainer's own work t (step
    time less ``async/wait_seconds``); synchronous on the server costs about g + t, full overlap max(g + load, t)."""
    lines = []
    for trainer in ("BAPO async K=1", "BAPO async K=2"):
        mine = [compact(r) for r in runs if r["trainer"] == trainer]
        if not mine:
            continue
        g = statistics.median(r["means"]["async/generate_seconds"] for r in mine)
        step = statistics.median(r["seconds"] / r["steps"] for r in mine)
        wait = statistics.median(r["means"].get("async/wait_seconds", 0.0) for r in mine)
        t = step - wait
        push = statistics.median(r["means"].get("async/push_seconds", 0.0) for r in mine)
        load = statistics.median(r["means"].get("async/load_seconds", 0.0) for r in mine)
        lines.append(f"- {trainer}: {step:.3f} s a step (median over runs); the server generates a batch in "
                     f"g = {g:.3f} s and loads each push in {load:.3f} s, one after the other ({g + load:.3f} s of "
                     f"server time a step); the trainer works t = {t:.3f} s of each step (a push takes {push:.3f} s "
                     f"to hand over) and waits {wait:.3f} s: full overlap would give max(g + load, t) = "
                     f"{max(g + load, t):.3f} s a step.")
    server = [compact(r) for r in runs if r["trainer"] == "BAPO sync server"]
    if server:
        lines.append(f"- BAPO sync server: {statistics.median(r['seconds'] / r['steps'] for r in server):.3f}"
                     " s a step (generation and training one after the other).")
    return lines


def report_text(runs: list[dict], seeds: list[int] | None = None) -> str:
    if seeds is not None:
        runs = [r for r in runs if r["seed"] in seeds]
    table = readings(runs)
    seen = sorted({r["seed"] for r in runs})
    parts = [f"# BAPO's async beside TRL's AsyncGRPOTrainer: seeds {fmt_seeds(seen)} ({len(runs)} runs)", "",
             "Paired by seed: mean difference (first trainer - second) with its 95% bootstrap interval; **bold**: the "
             "interval excludes 0. Rewards: mean of the last 10 logged batches; B1: TRL sync's seconds for 160 "
             f"steps on that seed. Seconds to target: running mean of 10 batches reaching {TARGET} (the cap, "
             f"{SECONDS_CAP:.0f} s, where never: a lower bound). Protocol: `docs/data/async_anchor_protocol.md`.", ""]
    for (config, task), block in sorted(table.items()):
        b1 = [budget_b1(runs, config, task, s) for s in seen]
        b1 = [b for b in b1 if b]
        parts += [f"## {task}, {config}" + (f" (B1 {statistics.median(b1):.1f} s, median)" if b1 else ""), "",
                  "| comparison | " + " | ".join([*READINGS, "seconds to target"]) + " |",
                  "|---|" + "---|" * (len(READINGS) + 1)]
        for trainer, reference in PAIRS:
            cells = [paired_cell(block.get(name, {}), trainer, reference) for name in READINGS]
            cells.append(paired_cell(block.get("seconds to target", {}), trainer, reference, 1))
            parts.append(f"| {trainer} - {reference} | " + " | ".join(cells) + " |")
        parts += ["", "| trainer | " + " | ".join([*READINGS, "seconds to target"]) + " |",
                  "|---|" + "---|" * (len(READINGS) + 1)]
        for trainer in TRAINERS:
            cells = []
            for name in [*READINGS, "seconds to target"]:
                values = list(block.get(name, {}).get(trainer, {}).values())
                cells.append(f"{statistics.mean(values):.2f}" if values else "n/a")
            parts.append(f"| {trainer} | " + " | ".join(cells) + " |")
        block_runs = [r for r in runs if (r["config"], r["task"]) == (config, task)]
        parts += ["", *run_facts(block_runs), "", "- Staleness max of TRL's async trainers: their own metric, taken "
                  "when a batch is fetched, one batch before it trains; the samples they train are one version older "
                  "(docs/async.md, `trl_async_anchor.py --steps 30`).", *overlap_bound(block_runs), ""]
    return "\n".join(parts)


#: The README's comparisons (columns) and readings (rows per task), TRL's defaults.
README_PAIRS = (("BAPO async K=1", "TRL sync"), ("BAPO async K=1", "BAPO sync"), ("BAPO async K=1", "TRL async"))
README_READINGS = ("reward at B1", "reward at 30 s", "reward at 5120 samples", "seconds to target")
TASK_NAMES = {"reverse3": "3 digits", "reverse2-8": "2-8 digits"}
#: The results the README quotes: the confirmation seeds (docs/data/async_anchor_protocol.md; development: 100-104).
README_SEEDS = "800-819"


def readme_table(runs: list[dict], seeds: list[int], config: str = "TRL defaults") -> list[str]:
    """The README's table: per task and reading, the paired difference (first trainer - second) over ``seeds`` with
    its 95% interval, bold where it excludes 0 (tests/test_readme.py holds the README to these lines)."""
    runs = [r for r in runs if r["seed"] in seeds and clean(r.get("foreign_cpu_seconds", 0.0), r["wall_seconds"])]
    table = readings(runs)
    lines = ["| task, reading | " + " | ".join(f"{a} - {b}" for a, b in README_PAIRS) + " |",
             "|---" * (len(README_PAIRS) + 1) + "|"]
    for task in TASKS:
        block = table.get((config, task))
        if block is None:
            continue
        for name in README_READINGS:
            digits = 1 if name == "seconds to target" else 2
            cells = [paired_cell(block.get(name, {}), a, b, digits) for a, b in README_PAIRS]
            lines.append(f"| {TASK_NAMES[task]}, {name} | " + " | ".join(cells) + " |")
    return lines


# -- the probe: per sample, or per sample kept? ----------------------------------------------------------------------

#: Not a protocol reading: a question the development runs raised. TRL's async trainer logs the reward of the samples
#: it trains, not of those it drops as too stale, so its readings may read a selection. Each trainer here trains until
#: it has consumed 5120 samples (trained or dropped), or for the 30 s of the study's cap, then its policy is scored on
#: held-out prompts, the same for every trainer; the reward of every sample it generated is logged too.
PROBES = {"heldout-5120": dict(until_samples=BUDGET_STEPS * TRAINING["per_device_train_batch_size"]),
          "heldout-30s": {}}
PROBE_TRAINERS = ("TRL sync", "BAPO async K=1", "TRL async", "TRL async matched")
PROBE_PAIRS = (("TRL async", "TRL sync"), ("TRL async matched", "TRL sync"), ("BAPO async K=1", "TRL sync"),
               ("BAPO async K=1", "TRL async"))


def probe_plan(probe: str, seeds: list[int], tasks: list[str], configs: list[str],
               trainers: list[str] = PROBE_TRAINERS) -> list[dict]:
    return [dict(spec, probe=probe, **PROBES[probe]) for spec in plan(seeds, tasks, configs, list(trainers))]


def probe_values(run: dict) -> dict:
    """A probe run's readings: the logged reward as the study reads it where the run stopped (its last 10 batches),
    the held-out scores, and the mean logged reward of the whole run (samples trained) less that of every sample
    generated."""
    rows = rewards_by_step(run)
    return {"logged at the stop": statistics.mean(r[2] for r in rows[-WINDOW:]),
            "held-out sampled": run["heldout_sampled"], "held-out greedy": run["heldout_greedy"],
            "trained - generated": statistics.mean(r[2] for r in rows) - run["scored_mean"]}


def reached(run: dict) -> bool:
    """Whether a probe run stopped where its probe reads it: a heldout-5120 run that the 30 s cap stopped first
    holds no reading at 5120 samples."""
    return run["rows"][-1][1] >= run.get("until_samples", 0)


def probe_report(runs: list[dict]) -> str:
    runs = [compact(r) for r in runs if r.get("probe") in PROBES]
    short = [r for r in runs if not reached(r)]
    runs = [r for r in runs if reached(r)]
    seen = sorted({r["seed"] for r in runs})
    parts = [f"# What the logged reward reads: seeds {fmt_seeds(seen)} ({len(runs)} runs)", "",
             "heldout-5120: each trainer trains until it has consumed 5120 samples (trained, or dropped as too "
             "stale); heldout-30s: for the study's 30 s. Then its policy is scored on "
             f"{HELDOUT_PROMPTS} held-out prompts (the task's test split; sampled at T = 1 as in training, and "
             "greedy). *logged at the stop*: the study's reading there (mean logged reward of the last 10 batches, "
             "which covers only samples trained; TRL's async trainer logs a batch as it takes it, one batch before "
             "training it). *trained - generated*: the mean logged reward of the run less the mean reward of every "
             "sample the trainer generated by its end (trained, dropped, or still queued). Paired by seed, 95% "
             "bootstrap intervals, **bold** where the interval excludes 0. Command: `python "
             "benchmarks/async_anchor_study.py probe --seeds-read A-B`. Left out: "
             f"{len(short)} heldout-5120 run(s) the 30 s cap stopped before 5120 samples"
             + (" (" + ", ".join(f"{r['trainer']} seed {r['seed']}" for r in short) + ")." if short else "."), ""]
    for probe, config, task in sorted({(r["probe"], r["config"], r["task"]) for r in runs}):
        block = [r for r in runs if (r["probe"], r["config"], r["task"]) == (probe, config, task)]
        values: dict = {}
        for run in block:
            for name, value in probe_values(run).items():
                values.setdefault(name, {}).setdefault(run["trainer"], {})[run["seed"]] = value
        names = list(values)
        parts += [f"## {probe}: {task}, {config}", "", "| trainer | steps | dropped | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for trainer in PROBE_TRAINERS:
            mine = [r for r in block if r["trainer"] == trainer]
            if mine:
                cells = [f"{statistics.mean(values[n][trainer].values()):+.2f}" if n == "trained - generated"
                         else f"{statistics.mean(values[n][trainer].values()):.2f}" for n in names]
                parts.append(f"| {trainer} | {statistics.median(r['steps'] for r in mine):.0f} | "
                             f"{statistics.mean(r['dropped'] / r['rows'][-1][1] for r in mine):.0%} | "
                             + " | ".join(cells) + " |")
        parts += ["", "| comparison | " + " | ".join(names[:3]) + " |", "|---|" + "---|" * 3]
        parts += [f"| {a} - {b} | " + " | ".join(paired_cell(values[n], a, b) for n in names[:3]) + " |"
                  for a, b in PROBE_PAIRS]
        parts.append("")
    return "\n".join(parts)


def figure(runs: list[dict], path: Path) -> None:
    """Reward (mean over seeds of the running mean of 10 batches) against seconds, one panel per (task, config)."""
    import numpy as np
    from study import pyplot, save_png

    plt = pyplot()
    blocks = sorted({(r["task"], r["config"]) for r in runs})
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.2 * len(blocks), 3.4), squeeze=False)
    grid = np.linspace(0, SECONDS_CAP, 121)
    for ax, (task, config) in zip(axes[0], blocks):
        for trainer in ("TRL sync", "BAPO sync", "BAPO sync server", "BAPO async K=1", "BAPO async K=2", "TRL async"):
            curves = [[reward_at(r, t) for t in grid] for r in runs
                      if (r["task"], r["config"], r["trainer"]) == (task, config, trainer)]
            if curves:
                style = "-" if "async" in trainer else "--"
                ax.plot(grid, np.mean(curves, axis=0), style, label=trainer)
        ax.set_title(f"{task}, {config}", fontsize=9)
        ax.set_xlabel("seconds of training (2 CPU cores)")
        ax.set_ylabel("reward (10-batch mean)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, str(path))


# -- the study (parent) -----------------------------------------------------------------------------------------------

def server_cpu_seconds(pid: int) -> float:
    """CPU-seconds of the server's whole process tree (vLLM's engine core is a child process)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            times = process.cpu_times()
            total += times.user + times.system
    except psutil.NoSuchProcess:
        pass
    return total


def run_in_child(spec: dict, url: str | None, steps: int, cap: float, log: Path) -> tuple[dict, float]:
    """One run in a child process; also returns the child's CPU-seconds (its whole process, startup included)."""
    import resource

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "run.json"
        cmd = [sys.executable, str(Path(__file__)), "one", "--spec", json.dumps(spec), "--steps", str(steps),
               "--cap", str(cap), "--result", str(result)] + (["--url", url] if url else [])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log, "ab") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"run {spec} failed (rc {done.returncode}); its output is in {log}")
        child = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return json.loads(result.read_text()), child


def machine_busy_seconds() -> float:
    """CPU-seconds every process on the machine has spent (all cores), from /proc/stat."""
    import psutil

    times = psutil.cpu_times()
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))


#: A run during which other processes took more CPU than this (seconds, or this share of its wall-clock) is run again:
#: a trainer measured beside someone else's work would be compared with one that had the machine.
FOREIGN_LIMIT, FOREIGN_SHARE, TRIES = 5.0, 0.05, 3


def clean(foreign: float, wall: float) -> bool:
    """Whether a run had the machine to itself (the server and the trainer aside): :data:`FOREIGN_LIMIT`."""
    return foreign <= max(FOREIGN_LIMIT, FOREIGN_SHARE * wall)


def wait_while_paused(pause: Path) -> None:
    announced = False
    while pause.exists():
        if not announced:
            print(f"paused: {pause} exists; remove it to go on", flush=True)
            announced = True
        time.sleep(5)


def study(todo: list[dict], results: Path, steps: int, cap: float, committed: Path | None = COMMITTED) -> None:
    """Run ``todo``'s runs not yet in ``results`` nor in ``committed`` (None: run them again, to reproduce them)."""
    from server_bench import Server
    from study import task_model

    done = {run_key(r) for r in [*read_jsonl(str(results)), *(read_jsonl(str(committed)) if committed else [])]}
    todo = [spec for spec in todo if run_key(spec) not in done]
    print(f"{len(done)} runs done ({results}" + (f" and {committed.name}" if committed else "") +
          f"); {len(todo)} to run", flush=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    log = results.with_suffix(".log")
    pause = Path(str(results) + ".pause")
    server, served = None, None
    try:
        for i, spec in enumerate(todo):
            wait_while_paused(pause)
            block = spec["seed"], spec["task"]
            if TRAINERS[spec["trainer"]]["server"] and served != block:
                if server is not None:
                    server.stop()
                server = Server(task_model(spec["task"]), log.with_suffix(".server.log"))
                served = block
            url = server.url if server is not None and served == block else None
            for attempt in range(1, TRIES + 1):
                wait_while_paused(pause)
                server_cpu = server_cpu_seconds(server.proc.pid) if url else 0.0
                busy, load, started = machine_busy_seconds(), os.getloadavg()[0], time.time()
                run, child_cpu = run_in_child(spec, url if TRAINERS[spec["trainer"]]["server"] else None, steps,
                                              cap, log)
                wall = time.time() - started
                served_cpu = (server_cpu_seconds(server.proc.pid) - server_cpu) if url else 0.0
                foreign = machine_busy_seconds() - busy - child_cpu - served_cpu
                if clean(foreign, wall):
                    break
                print(f"  other processes took {foreign:.1f} CPU-s during the run: running it again "
                      f"({attempt} of {TRIES})", flush=True)
            if not clean(foreign, wall):
                print(f"  left for a later invocation: {TRIES} tries shared the machine", flush=True)
                continue
            run.update(wall_seconds=wall, load_before=load, commit=commit(), server_cpu_seconds=served_cpu,
                       foreign_cpu_seconds=foreign, attempts=attempt, date=time.strftime("%Y-%m-%dT%H:%M:%S"))
            append_jsonl(str(results), run)
            rewards = [h["reward"] for h in run["history"] if "reward" in h]
            print(f"[{i + 1}/{len(todo)}] seed {spec['seed']} {spec['task']} {spec['config']} {spec['trainer']}: "
                  f"{run['steps']} steps in {run['step_seconds'][-1]:.0f} s, reward {statistics.mean(rewards[:5]):.2f}"
                  f" -> {statistics.mean(rewards[-WINDOW:]):.2f}", flush=True)
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the study's runs not yet in the results file")
    run.add_argument("--seeds", required=True, help="A-B (development: 100-104; confirmation: 800-819)")
    run.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: reverse3, reverse2-8")
    run.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names")
    run.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated trainer names")
    run.add_argument("--again", action="store_true", help="run the committed runs again too (to reproduce them; "
                     "read yours with report --results YOURS)")
    run.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps or {QUICK['cap']:.0f} s, "
                     "whichever comes first")
    run.add_argument("--results", type=Path, default=None, help="the raw runs file (default: "
                     "outputs/async_anchor/runs.jsonl; runs already committed are skipped)")
    report = sub.add_parser("report", help="the readings of a results file (markdown on stdout)")
    report.add_argument("--results", type=Path, nargs="+", default=[COMMITTED],
                        help="runs files, raw or compact (default: the committed runs)")
    report.add_argument("--seeds", default=None, help="only these seeds (A-B)")
    report.add_argument("--write", type=Path, default=None, help="also write the report here, its figure beside it")
    report.add_argument("--readme", action="store_true", help="print the README's table (README_SEEDS) instead")
    report.add_argument("--compact", type=Path, default=None, help="also write the runs, compact, to this .jsonl.gz "
                        "(what docs/data keeps)")
    probe = sub.add_parser("probe", help="the held-out probe (PROBE_TRAINERS); the report of every probe run")
    probe.add_argument("--seeds", default=None, help="A-B: run these seeds' probe runs not yet in the results file")
    probe.add_argument("--probe", default="heldout-5120", choices=list(PROBES), help="where each run stops")
    probe.add_argument("--tasks", default="reverse2-8", help="comma-separated: reverse3, reverse2-8")
    probe.add_argument("--configs", default="TRL defaults", help="comma-separated config names")
    probe.add_argument("--trainers", default=",".join(PROBE_TRAINERS), help="comma-separated trainer names")
    probe.add_argument("--again", action="store_true", help="run the committed probe runs again too (to reproduce "
                       "them; the report then reads your file alone)")
    probe.add_argument("--results", type=Path, default=REPO / "outputs" / "async_anchor" / "probe.jsonl",
                       help="the raw probe runs (runs already committed are skipped, and read with these)")
    probe.add_argument("--seeds-read", default=None, help="the report reads only these seeds (A-B; default: --seeds, "
                       "else every seed in the files, the committed development seeds 100-104 too)")
    probe.add_argument("--write", type=Path, default=None, help="write the report here (default: stdout only)")
    probe.add_argument("--compact", type=Path, default=None, help="also write every probe run, compact, here")
    one = sub.add_parser("one", help="(internal) one run in this process")
    one.add_argument("--spec", required=True)
    one.add_argument("--url", default=None)
    one.add_argument("--steps", type=int, required=True)
    one.add_argument("--cap", type=float, required=True)
    one.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "one":
        result = train_one(json.loads(args.spec), args.url, args.steps, args.cap)
        args.result.write_text(json.dumps(result))
        return 0
    if args.command == "report":
        found = {run_key(r): r for path in args.results for r in read_jsonl(str(path))  # a later file's run wins
                 if "probe" not in r}  # a probe's runs have a report of their own
        runs = [compact(r) for r in found.values()  # runs that shared the machine are left out
                if clean(r.get("foreign_cpu_seconds", 0.0), r["wall_seconds"])]
        if args.compact:
            write_compact(args.compact, runs)
        if args.readme:
            print("\n".join(readme_table(runs, parse_seeds(args.seeds or README_SEEDS, count=False))))
            return 0
        text = report_text(runs, parse_seeds(args.seeds, count=False) if args.seeds else None)
        print(text)
        if args.write:
            args.write.write_text(text + "\n")
            figure([r for r in runs if args.seeds is None or r["seed"] in parse_seeds(args.seeds, count=False)],
                   args.write.with_suffix(".png"))
        return 0
    names = dict(tasks=args.tasks.split(","), configs=args.configs.split(","), trainers=args.trainers.split(","))
    for field, known in (("tasks", TASKS), ("configs", CONFIGS), ("trainers", TRAINERS)):
        unknown = [n for n in names[field] if n not in known]
        if unknown:
            parser.error(f"--{field}: unknown {unknown}; expected some of {list(known)}")
    if args.command == "probe":
        if args.seeds:
            study(probe_plan(args.probe, parse_seeds(args.seeds, count=False), **names), args.results, BUDGET_STEPS,
                  SECONDS_CAP, committed=None if args.again else PROBE_COMMITTED)
        files = (args.results,) if args.again else (PROBE_COMMITTED, args.results)
        found = {run_key(r): compact(r) for path in files for r in read_jsonl(str(path))}
        runs = sorted(found.values(), key=lambda r: (r["probe"], r["task"], r["config"], r["seed"], r["trainer"]))
        if args.compact:
            write_compact(args.compact, runs)
        read = args.seeds_read or args.seeds  # the seeds just run, unless told otherwise
        seeds = parse_seeds(read, count=False) if read else None
        text = probe_report([r for r in runs if seeds is None or r["seed"] in seeds])
        print(text)
        if args.write:
            args.write.write_text(text + "\n")
        return 0
    results = args.results or REPO / "outputs" / "async_anchor" / "runs.jsonl"  # raw; report --compact commits them
    steps, cap = (QUICK["steps"], QUICK["cap"]) if args.quick else (BUDGET_STEPS, SECONDS_CAP)
    study(plan(parse_seeds(args.seeds, count=False), **names), results, steps, cap,
          committed=None if args.again else COMMITTED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
