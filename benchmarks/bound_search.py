"""Time BAPO's vectorised bound search against the plain loops and against a one-candidate floor.

Why: the search replaces a Python loop (one reduction and one host sync per candidate, as in the official verl
recipe) by one pass over the tokens and ONE collective. This script measures both claims on CPU:

* time per search at 16k / 256k / 1M tokens (B x T shaped like real batches), float32 inputs, a prefix mask of
  random completion lengths, advantages per row, all in one process; warm-up, then contenders interleaved in
  each repeat (so background load hits them alike), medians reported;
* the data is adversarial: negatives dominate, so no candidate meets the target and both loops walk the whole
  path (52 candidates); the table reports how many each loop scored;
* "floor": the positive / negative sums for ONE candidate with torch ops, masked with ``where`` (NaN-safe, as
  any search must be); "floor*": the same with the mask as a float factor (not NaN-safe), the least any pass over
  these tensors can cost;
* collectives per search: a real 2-process gloo run (``accelerate launch --multi_gpu --num_processes 2``) counts
  calls of the reduce function per search;
* the heap is warmed first (see :func:`warm_heap`), so page faults on fresh memory, very costly on these VMs, do
  not decide the comparison; ``--cold-heap`` shows them (the table counts page faults per call either way).

Usage: ``python benchmarks/bound_search.py [--quick] [--no-collectives] [--cold-heap] [--baseline FILE]``.
The last line is machine-readable:
``speedup_vs_loop=<verl loop / ours at 256k> floor_ratio=<ours / floor at 256k> collectives_per_search=<n>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bapo_trl import search_clip_bounds
from bapo_trl.core.clipping import BAPOSettings, search_path
from bapo_trl.core.clipping_reference import paper_loop_search, verl_loop_search

REPO = Path(__file__).resolve().parent.parent
#: (B, T): 16k, 256k and 1M tokens.
SHAPES = [(64, 256), (512, 512), (1024, 1024)]
SUMMARY_SHAPE = (512, 512)


def make_batch(batch: int, length: int, seed: int = 0, device: str = "cpu"):
    """A stale batch where negatives dominate: ratios log-normal around 1, completions of random lengths (prefix
    mask), per-row advantages mostly negative, so the share target 0.5 is never met. Made on CPU (the same data
    whatever the device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    ratio = torch.exp(0.3 * torch.randn(batch, length, generator=gen))
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    ratio = torch.where(mask == 0, torch.nan, ratio)  # padding holds garbage, as it may in a real batch
    advantages = torch.randn(batch, generator=gen) - 0.8
    return ratio.to(device), advantages.to(device), mask.to(device)


class CountingReduce:
    """A reduce function that counts its calls (identity in one process, an all-reduce across processes)."""

    def __init__(self, reduce=None):
        self.calls = 0
        self.reduce = reduce

    def __call__(self, tensor):
        self.calls += 1
        return tensor if self.reduce is None else self.reduce(tensor)


def floor_where(ratio, advantages, mask, c_low=0.6, c_high=1.2):
    """One candidate's sums, NaN-safe: what a search that scores a single candidate at least costs."""
    a = advantages[:, None]
    real = mask != 0
    pos = torch.where(real & (a > 0), ratio.clamp(max=c_high) * a, 0.0).sum()
    neg = torch.where(real & (a < 0), ratio.clamp(min=c_low) * -a, 0.0).sum()
    return torch.stack([pos, neg])


def floor_multiply(ratio, advantages, mask, c_low=0.6, c_high=1.2):
    """One candidate's sums with the mask as a float factor: fewest passes, but NaN padding would leak."""
    a = advantages[:, None]
    pos = (ratio.clamp(max=c_high) * (a.clamp(min=0.0) * mask)).sum()
    neg = (ratio.clamp(min=c_low) * (a.clamp(max=0.0) * -mask)).sum()
    return torch.stack([pos, neg])


def warm_heap(megabytes: int = 30) -> None:
    """Allocate and free one large buffer, as any process that has already run a model has done.

    glibc then serves buffers up to that size from its heap instead of fresh ``mmap`` pages (it raises its mmap and
    trim thresholds after freeing a large block, up to 32 MiB). Without this, every contender pays a page fault per
    fresh 4 KiB page of its temporaries (about 4 us each on these VMs), which dominates whichever allocates most.
    ``--cold-heap`` skips it.
    """
    torch.empty(megabytes << 20, dtype=torch.uint8).fill_(0)


def minor_faults() -> int:
    """Page faults so far (fresh memory the kernel must map and zero: costly on these VMs)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_interleaved(fns: dict, rounds: int, calls: dict | None = None, warmup: int = 1,
                     sync=None) -> tuple[dict, dict]:
    """Seconds per call for every function, taken in rounds (each round calls every function ``calls[name]``
    times, default once, alternating), and the mean number of page faults per call. Slow and fast contenders
    share the same rounds, so background load drifting over time hits them alike. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs before and after each timed call, so a call's device work counts."""
    calls = calls or {}
    sync = sync or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    faults = dict.fromkeys(fns, 0)
    for _ in range(rounds):
        for i in range(max(calls.values(), default=1)):
            for name, fn in fns.items():
                if i >= calls.get(name, 1):
                    continue
                sync()
                before = minor_faults()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
                faults[name] += minor_faults() - before
    return times, {name: faults[name] / len(times[name]) for name in fns}


def load_baseline(path: str):
    """``search_clip_bounds`` from another version of ``clipping.py`` (to time a change before and after)."""
    spec = importlib.util.spec_from_file_location("baseline_clipping", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.search_clip_bounds


def bench_shape(batch: int, length: int, repeats: int, loop_repeats: int, baseline=None, device: str = "cpu") -> dict:
    """Time ours, both loops and the floors on one (B, T) batch on ``device``; check that all choose alike."""
    ratio, advantages, mask = make_batch(batch, length, device=device)
    counters = {"ours": CountingReduce(), "verl": CountingReduce(), "paper": CountingReduce()}

    def ours():
        return search_clip_bounds(ratio, advantages, mask, reduce_fn=counters["ours"]).clip_high

    def verl():
        return verl_loop_search(ratio, advantages, mask, reduce_fn=counters["verl"], bapo_variant="verl")

    def paper():
        return paper_loop_search(ratio, advantages, mask, reduce_fn=counters["paper"])

    fns = {"ours": ours, "floor": lambda: floor_where(ratio, advantages, mask),
           "floor_mul": lambda: floor_multiply(ratio, advantages, mask), "verl": verl, "paper": paper}
    if baseline is not None:
        fns["baseline"] = lambda: baseline(ratio, advantages, mask).clip_high
    # one call each to count the reduce calls (= candidates scored; ours: always 1)
    visited = {}
    for name in counters:
        counters[name].calls = 0
        fns[name]()
        visited[name] = counters[name].calls
    per_round = -(-repeats // loop_repeats)  # fast contenders: several calls per round, loops one
    fast_calls = {name: per_round for name in fns if name not in ("verl", "paper")}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    times, faults = time_interleaved(fns, rounds=loop_repeats, calls=fast_calls, warmup=1, sync=sync)

    # the choice is the same as the loops' (both variants), so the timings compare equal work
    mine = {v: search_clip_bounds(ratio, advantages, mask, bapo_variant=v).as_floats() for v in ("paper", "verl")}
    agree = all(
        abs(mine[v]["clip_low"] - ref["clip_low"]) < 1e-9 and abs(mine[v]["clip_high"] - ref["clip_high"]) < 1e-9
        for v, ref in (("paper", paper()), ("verl", verl()))
    )
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "shape": (batch, length),
        "tokens": batch * length,
        "valid": int(mask.sum()),
        "ms": {name: 1e3 * value for name, value in med.items()},
        "visited": visited,
        "faults": faults,
        "agree": agree,
        "path_length": len(search_path(BAPOSettings())),
    }


# -- collectives in a real 2-process run ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count_collectives(timeout: float = 300.0) -> dict:
    """Launch this script on 2 gloo processes; every rank counts reduce calls per search."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(Path(__file__).resolve()), "--worker", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"2-process launch failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
    for info in ranks:
        if info["world_size"] != 2 or info["backend"] != "gloo":
            raise RuntimeError(f"expected 2 gloo processes, got {info['world_size']} ({info['backend']})")
    if ranks[0]["choices"] != ranks[1]["choices"]:
        raise RuntimeError("the two ranks chose different bounds")
    return ranks[0]


def worker(out_dir: str) -> None:
    """Runs under ``accelerate launch``: different data per rank, each method searched with a counting all-reduce."""
    import torch.distributed as dist
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    ratio, advantages, mask = make_batch(64, 256, seed=100 + rank)  # 16k tokens per rank
    methods = {
        "ours": lambda fn: search_clip_bounds(ratio, advantages, mask, reduce_fn=fn).as_floats(),
        "ours_verl": lambda fn: search_clip_bounds(ratio, advantages, mask, reduce_fn=fn, bapo_variant="verl")
        .as_floats(),
        "verl_loop": lambda fn: verl_loop_search(ratio, advantages, mask, reduce_fn=fn, bapo_variant="verl"),
        "paper_loop": lambda fn: paper_loop_search(ratio, advantages, mask, reduce_fn=fn),
    }
    calls, choices, ms = {}, {}, {}
    for name, method in methods.items():
        counter = CountingReduce(lambda t: accelerator.reduce(t, reduction="sum"))
        per_search, times = [], []
        method(counter)  # warm-up (the first collectives set up gloo's buffers)
        method(counter)
        for _ in range(3):
            before = counter.calls
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            result = method(counter)
            times.append(time.perf_counter() - start)
            per_search.append(counter.calls - before)
        calls[name] = per_search
        choices[name] = [result["clip_low"], result["clip_high"]]
        ms[name] = 1e3 * statistics.median(times)
    info = {"rank": rank, "world_size": accelerator.num_processes,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "calls": calls, "choices": choices, "ms": ms}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(info))
    accelerator.wait_for_everyone()


# -- report ---------------------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} torch thread, "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M %Z')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16k and 256k only, fewer repeats (< 1 minute)")
    parser.add_argument("--no-collectives", action="store_true", help="skip the 2-process collective count")
    parser.add_argument("--cold-heap", action="store_true",
                        help="skip the heap warm-up: fresh pages (page faults) then count against every contender")
    parser.add_argument("--baseline", metavar="CLIPPING_PY",
                        help="also time search_clip_bounds from this file, e.g. an older bapo_trl/clipping.py")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        from bapo_trl.cli.train import exit_past_gloo_teardown

        exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (its docstring)

    torch.set_num_threads(1)  # the machines are shared 2-core boxes: one thread gives stable numbers
    baseline = load_baseline(args.baseline) if args.baseline else None
    if not args.cold_heap:
        warm_heap()
    shapes = SHAPES[:2] if args.quick else SHAPES
    repeats, loop_repeats = (9, 3) if args.quick else (35, 7)
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    heap = "cold (fresh pages fault)" if args.cold_heap else "warmed by one 30 MiB allocation"
    print(f"# bound search: {machine()}; glibc malloc settings: {malloc or 'defaults'}; heap {heap}")
    print(f"# {loop_repeats} rounds after warm-up, each calling the loops once and the others "
          f"{repeats // loop_repeats} times, interleaved; medians; "
          "negatives dominate, so no candidate meets the target")
    print()
    print("| B x T | tokens | real tokens | ours ms | verl loop ms | paper loop ms | floor ms | floor* ms "
          "| candidates verl / paper | verl / ours | paper / ours | ours / floor | ours / floor* "
          "| page faults per call: ours / floor / verl | same choice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for batch, length in shapes:
        row = bench_shape(batch, length, repeats, loop_repeats, baseline)
        rows[(batch, length)] = row
        ms, faults = row["ms"], row["faults"]
        print(f"| {batch} x {length} | {row['tokens']} | {row['valid']} | {ms['ours']:.2f} | {ms['verl']:.1f} "
              f"| {ms['paper']:.1f} | {ms['floor']:.2f} | {ms['floor_mul']:.2f} "
              f"| {row['visited']['verl']} / {row['visited']['paper']} "
              f"| {ms['verl'] / ms['ours']:.1f}x | {ms['paper'] / ms['ours']:.1f}x "
              f"| {ms['ours'] / ms['floor']:.2f}x | {ms['ours'] / ms['floor_mul']:.2f}x "
              f"| {faults['ours']:.0f} / {faults['floor']:.0f} / {faults['verl']:.0f} | {row['agree']} |", flush=True)
    if baseline is not None:
        print()
        print(f"| B x T | baseline ms ({args.baseline}) | ours ms | baseline / ours | baseline / floor |")
        print("|---|---|---|---|---|")
        for (batch, length), row in rows.items():
            ms = row["ms"]
            print(f"| {batch} x {length} | {ms['baseline']:.2f} | {ms['ours']:.2f} "
                  f"| {ms['baseline'] / ms['ours']:.2f}x | {ms['baseline'] / ms['floor']:.2f}x |")
    print()
    print("# floor: one candidate's pos/neg sums, masked with torch.where (NaN-safe); floor*: mask as a float "
          "factor (NaN padding would leak); candidates = reduce calls of one search")
    collectives = "skipped"
    if not args.no_collectives:
        info = count_collectives()
        print()
        print("| 2 processes, gloo, 16k tokens per rank | reduce calls per search (3 searches) | ms per search |")
        print("|---|---|---|")
        for name, calls in info["calls"].items():
            print(f"| {name} | {calls} | {info['ms'][name]:.2f} |")
        print()
        collectives = info["calls"]["ours"][-1]
    summary = rows[SUMMARY_SHAPE]["ms"]
    print(f"speedup_vs_loop={summary['verl'] / summary['ours']:.1f} "
          f"floor_ratio={summary['ours'] / summary['floor']:.2f} collectives_per_search={collectives}")


if __name__ == "__main__":
    main()
