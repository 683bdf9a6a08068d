"""A LoRA run's weight push: the adapter alone (``vllm_lora_sync="adapter"``) against the merged full model
(``"merged"``, TRL's way), on SmolLM2-135M-Instruct with a rank-16 adapter on q_proj and v_proj.

    python benchmarks/lora_push.py                 # SmolLM2, rank 16, 3 pairs of runs, then the ZeRO-3 memory part
    python benchmarks/lora_push.py --no-zero3      # without the ZeRO-3 part
    python benchmarks/lora_push.py --quick         # the tiny model, rank 8, 1 pair, no ZeRO-3 (a smoke run)

Part 1. One real vLLM CPU server (``bapo serve MODEL --lora-rank R``) pinned to core 1, this process on core 0. For
each of ``--pairs`` pairs, a synchronous run in each mode, then an async K=1 run in each mode (the order of the modes
alternates between pairs), ``--steps`` steps with a push before every generation (``steps_per_generation=1``). Per
run: the logged
``weight_sync/pushed_bytes`` and ``weight_sync/seconds`` (median over the pushes after the first: the adapter push's
first also reloads the base weights once), seconds per step (median, after the first), and for synchronous runs TRL's
``sampling/sampling_logp_difference/max`` (the server's log-probs against the trainer's recomputation with the same
weights). Per pair: merged / adapter. Printed as median [min, max]; the last line's ``pair_*=`` are the ratios'
medians (``async_pair_step_seconds``: the async runs').

Part 2 (``--zero3``, the default without ``--quick``): ``accelerate launch`` of this script's worker on 2 processes
with DeepSpeed ZeRO-3 per mode (3 steps, a push before each): every rank samples its resident memory during each push
and reports how far above its level before the push it went (the gather of the whole model under ZeRO-3 in the merged
push; the adapter's parameters only in the adapter push). Rank 1's figure is the gather alone (rank 0 also holds the
copies it writes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_bench import REPO, TRAINER_CORE, Server, digit_count, spread  # noqa: E402

LOGP_DIFF = "sampling/sampling_logp_difference/max"
TARGETS = ["q_proj", "v_proj"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Resident memory sampled every 2 ms while a push runs: the peak above the level before it."""

    def __init__(self):
        self.deltas: list[int] = []

    def around(self, push):
        def measured(*args, **kwargs):
            before, peak, done = rss_bytes(), [0], threading.Event()

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], rss_bytes())
                    time.sleep(0.002)

            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            try:
                return push(*args, **kwargs)
            finally:
                done.set()
                thread.join()
                self.deltas.append(max(peak[0], rss_bytes()) - before)

        return measured


def config(out: str, url: str, mode: str, steps: int, batch: int, length: int, **overrides):
    from bapo_trl import BAPOConfig

    return BAPOConfig(
        output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=batch, num_generations=4, max_completion_length=length, logging_steps=1, seed=0,
        max_steps=steps, learning_rate=1e-4, steps_per_generation=1, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=url, vllm_server_timeout=300, vllm_lora_sync=mode, disable_tqdm=True, **overrides)


def trainer_for(model_dir: str, args, rank: int):
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from bapo_trl import BAPOTrainer
    from bapo_trl.recipes.toy import make_reverse_dataset

    trainer = BAPOTrainer(model=model_dir, reward_funcs=digit_count, args=args,
                          train_dataset=make_reverse_dataset(512, seed=0),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          peft_config=LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    trainer.remove_callback(PrinterCallback)
    return trainer


def one_run(model_dir: str, url: str, mode: str, opts, tmp: Path, **overrides) -> dict:
    from server_bench import StepClock

    clock = StepClock()
    args = config(str(tmp / f"run-{mode}"), url, mode, opts.steps, opts.batch, opts.length, **overrides)
    trainer = trainer_for(model_dir, args, opts.rank)
    trainer.add_callback(clock)
    trainer.train()
    trainer.rollout_source.close()
    logs = trainer.state.log_history
    pushed = [h["weight_sync/pushed_bytes"] for h in logs if "weight_sync/pushed_bytes" in h]
    seconds = [h["weight_sync/seconds"] for h in logs if "weight_sync/seconds" in h]
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    model_bytes = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    result = {"mode": mode, "first_push_bytes": pushed[0], "push_bytes": statistics.median(pushed[1:]),
              "push_seconds": statistics.median(seconds[1:]), "step_seconds": statistics.median(steps),
              "model_bytes": model_bytes, "pushes": len(pushed)}
    diffs = [h[LOGP_DIFF] for h in logs if LOGP_DIFF in h]
    if diffs and not overrides.get("async_generation"):
        result["logp_diff_max"] = max(diffs)
    staleness = [h["async/staleness_max"] for h in logs if "async/staleness_max" in h]
    if staleness:
        result["staleness_max"] = max(staleness)
    del trainer
    return result


def zero3_worker(opts) -> None:
    """One rank of the ZeRO-3 launch: a run whose every push is measured (:class:`PeakMemory`); writes its row."""
    import torch.distributed as dist

    args = config(opts.out, opts.url, opts.worker, 3, opts.batch, opts.length)
    trainer = trainer_for(opts.model, args, opts.rank)
    peak = PeakMemory()
    backend = trainer.vllm_generation
    backend.sync_weights = peak.around(backend.sync_weights)
    trainer.train()
    row = {"rank": dist.get_rank(), "mode": opts.worker, "push_peak_delta": peak.deltas,
           "pushed_bytes": [h["weight_sync/pushed_bytes"] for h in trainer.state.log_history
                            if "weight_sync/pushed_bytes" in h]}
    Path(opts.out, f"zero3-rank{row['rank']}.json").write_text(json.dumps(row))  # one file per rank: no interleaving


def zero3_part(model_dir: str, url: str, opts, tmp: Path) -> list[dict]:
    rows = []
    for mode in ("merged", "adapter"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
               "--config_file", str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml"), "--mixed_precision", "no",
               __file__, "--worker", mode, "--model", model_dir, "--url", url, "--out", str(tmp / f"z3-{mode}"),
               "--rank", str(opts.rank), "--batch", str(opts.batch), "--length", str(opts.length)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"ZeRO-3 launch ({mode}) failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        rows += [json.loads(path.read_text()) for path in sorted((tmp / f"z3-{mode}").glob("zero3-rank*.json"))]
        if len([r for r in rows if r["mode"] == mode]) != 2:
            raise SystemExit(f"ZeRO-3 launch ({mode}): not every rank reported:\n{proc.stdout[-3000:]}")
    return rows


def mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model directory or registry name (default smollm2)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--zero3", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure ZeRO-3's memory during a push (default: on, off with --quick)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, rank 8, 1 pair, 3 steps, no ZeRO-3")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--worker", choices=["merged", "adapter"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return zero3_worker(opts)
    if opts.quick:
        parser.set_defaults(rank=8, pairs=1, steps=3, model="tiny", zero3=False)
        opts = parser.parse_args()
    for name in ("rank", "pairs", "steps", "batch", "length"):
        if getattr(opts, name) < (2 if name == "steps" else 1):
            raise SystemExit(f"--{name} must be >= {2 if name == 'steps' else 1}, got {getattr(opts, name)}")
    zero3 = opts.zero3 if opts.zero3 is not None else not opts.quick
    import torch

    from bapo_trl.cli.serve import lora_rank
    from bapo_trl.recipes.models import resolve_model
    from bapo_trl.recipes.toy import build_tiny_model

    model_dir = build_tiny_model() if opts.model == "tiny" else resolve_model(opts.model)
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = Server(model_dir, tmp / "server.log", extra=("--lora-rank", str(lora_rank(str(opts.rank)))))
        try:
            for pair in range(opts.pairs):
                modes = ("merged", "adapter") if pair % 2 == 0 else ("adapter", "merged")
                for kind, extra in (("sync", {}), ("async_k1", dict(async_generation=True, max_staleness=1))):
                    for mode in modes:
                        rows.append({"kind": kind, "pair": pair,
                                     **one_run(model_dir, server.url, mode, opts, tmp, **extra)})
                        print(json.dumps(rows[-1]), flush=True)
            if zero3:
                for row in zero3_part(model_dir, server.url, opts, tmp):
                    rows.append({"kind": "zero3", **row})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    report(rows)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1) + "\n")


def report(rows: list[dict]) -> None:
    sync = [r for r in rows if r["kind"] == "sync"]
    model = sync[0]["model_bytes"]
    print(f"\nmodel weights: {mib(model)}; pushes per run: {sync[0]['pushes']}")
    for mode in ("merged", "adapter"):
        runs = [r for r in sync if r["mode"] == mode]
        print(f"sync {mode:7s}: pushed {mib(statistics.median(r['push_bytes'] for r in runs))} "
              f"({100 * statistics.median(r['push_bytes'] for r in runs) / model:.2f}% of the model), "
              f"first push {mib(runs[0]['first_push_bytes'])}; push s {spread([r['push_seconds'] for r in runs])}; "
              f"step s {spread([r['step_seconds'] for r in runs])}; sampler logp diff max "
              f"{max(r.get('logp_diff_max', float('nan')) for r in runs):.2g}")
    pairs = sorted({r["pair"] for r in sync})

    def ratios(kind: str, key: str) -> list[float]:
        runs = [r for r in rows if r["kind"] == kind]
        return [next(r[key] for r in runs if r["pair"] == p and r["mode"] == "merged")
                / next(r[key] for r in runs if r["pair"] == p and r["mode"] == "adapter") for p in pairs]

    ratio = {key: ratios("sync", key) for key in ("push_bytes", "push_seconds", "step_seconds")}
    for mode in ("merged", "adapter"):
        runs = [r for r in rows if r["kind"] == "async_k1" and r["mode"] == mode]
        print(f"async K=1 {mode:7s}: pushed {mib(runs[0]['push_bytes'])}, push s "
              f"{spread([r['push_seconds'] for r in runs])}, step s {spread([r['step_seconds'] for r in runs])}, "
              f"staleness max {max(r.get('staleness_max', 0) for r in runs)}")
    ratio["async_pair_step_seconds"] = ratios("async_k1", "step_seconds")
    for key, values in ratio.items():
        print(f"merged / adapter, {key}: {spread(values)}")
    for row in (r for r in rows if r["kind"] == "zero3"):
        print(f"ZeRO-3 rank {row['rank']} {row['mode']:7s}: memory above the level before each push "
              f"{[mib(d) for d in row['push_peak_delta']]}; pushed {[mib(b) for b in row['pushed_bytes']]}")
    print(" ".join(f"{'' if key.startswith('async') else 'pair_'}{key}={statistics.median(values):.3g}"
                   for key, values in ratio.items()) + "  (merged / adapter, median over pairs)")


if __name__ == "__main__":
    main()
