"""BAPO's async generation beside TRL's own ``AsyncGRPOTrainer`` and both synchronous trainers, at equal wall-clock
and equal samples (issue 76; the protocol, written first: ``docs/data/async_anchor_protocol.md``).

Every run is its own process (a clean clock, its own CPU-seconds, nothing left over from the last trainer), against
one vLLM CPU server per (seed, task) block (every trainer pushes its own initial weights when training starts: TRL's
async trainer in its cold sync, BAPO's in its first push). Runs are interleaved: for each seed every trainer runs
before the next seed starts, in an order that rotates from block to block. Each run appends one line to the results
file as it ends, so the study resumes where it stopped; ``touch <results>.pause`` pauses it between two runs (remove
the file to go on), so a machine that must do something else for a while does not skew a run.

    python benchmarks/async_anchor_study.py run --seeds 100-104              # development seeds, both tasks/configs
    python benchmarks/async_anchor_study.py run --seeds 100-100 --tasks reverse3 --configs "TRL defaults" --quick

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

from study import TASKS, TRAINING, append_jsonl, commit, parse_seeds, read_jsonl  # noqa: E402

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


def run_key(run: dict) -> tuple:
    return run["trainer"], run["config"], run["task"], run["seed"]


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
    clock = {"start": 0.0}

    class Clock(TrainerCallback):
        """Each step's end on the training clock; stops a capped run at ``cap`` seconds."""

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter() - clock["start"])
            if ends[-1] >= cap:
                control.should_training_stop = True

    max_steps = 100_000 if steps == BUDGET_STEPS else steps  # the study: the clock ends the run
    out = tempfile.mkdtemp(prefix="anchor-run-")
    built = time.perf_counter()
    if trainer_spec["kind"] == "trl-async":
        from trl_async_anchor import apply_glue, async_trainer

        apply_glue()
        trainer = async_trainer(model_dir, url, Path(out), max_steps, trainer_spec["max_staleness"], spec["seed"],
                                TRAINING["per_device_train_batch_size"], TRAINING["num_generations"],
                                task["max_completion_length"], LEARNING_RATE, settings.get("epsilon", 0.2),
                                settings.get("epsilon_high"), digits=task["digits"], callbacks=[Clock()],
                                token_budget=0)  # the same 32 samples a step as every other trainer
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
        trainer = trainer_cls(model=model_dir, reward_funcs=reverse_reward, args=args, callbacks=[Clock()],
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
    return dict(spec, history=history, step_seconds=ends, setup_seconds=setup, trainer_cpu_seconds=cpu,
                threads=threads, steps=trainer.state.global_step)


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


def run_in_child(spec: dict, url: str | None, steps: int, cap: float, log: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "run.json"
        cmd = [sys.executable, str(Path(__file__)), "one", "--spec", json.dumps(spec), "--steps", str(steps),
               "--cap", str(cap), "--result", str(result)] + (["--url", url] if url else [])
        with open(log, "ab") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"run {spec} failed (rc {done.returncode}); its output is in {log}")
        return json.loads(result.read_text())


def wait_while_paused(pause: Path) -> None:
    announced = False
    while pause.exists():
        if not announced:
            print(f"paused: {pause} exists; remove it to go on", flush=True)
            announced = True
        time.sleep(5)


def study(todo: list[dict], results: Path, steps: int, cap: float) -> None:
    from server_bench import Server
    from study import task_model

    done = {run_key(r) for r in read_jsonl(str(results))}
    todo = [spec for spec in todo if run_key(spec) not in done]
    print(f"{len(done)} runs in {results}; {len(todo)} to run", flush=True)
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
            server_cpu = server_cpu_seconds(server.proc.pid) if url else 0.0
            load = os.getloadavg()[0]
            started = time.time()
            run = run_in_child(spec, url if TRAINERS[spec["trainer"]]["server"] else None, steps, cap, log)
            run.update(wall_seconds=time.time() - started, load_before=load, commit=commit(),
                       server_cpu_seconds=(server_cpu_seconds(server.proc.pid) - server_cpu) if url else 0.0,
                       date=time.strftime("%Y-%m-%dT%H:%M:%S"))
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
    run.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps or {QUICK['cap']:.0f} s, "
                     "whichever comes first")
    run.add_argument("--results", type=Path, default=None, help="default: docs/data/async_anchor_runs.jsonl")
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
    names = dict(tasks=args.tasks.split(","), configs=args.configs.split(","), trainers=args.trainers.split(","))
    for field, known in (("tasks", TASKS), ("configs", CONFIGS), ("trainers", TRAINERS)):
        unknown = [n for n in names[field] if n not in known]
        if unknown:
            parser.error(f"--{field}: unknown {unknown}; expected some of {list(known)}")
    results = args.results or REPO / "docs" / "data" / "async_anchor_runs.jsonl"
    steps, cap = (QUICK["steps"], QUICK["cap"]) if args.quick else (BUDGET_STEPS, SECONDS_CAP)
    study(plan(parse_seeds(args.seeds, count=False), **names), results, steps, cap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
