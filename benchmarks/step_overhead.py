"""Wall-clock cost of BAPO (and of its replay queue) per full training step, against TRL's GRPOTrainer.

Why: BAPO claims to add only a search and a few metrics to a GRPO step. This measures whole steps (generation,
old log-probs, forward, loss, backward, optimizer, logging) on the embedded tiny model, four trainers built once
in one process:

* ``grpo``: TRL's ``GRPOTrainer``; ``bapo``: ``BAPOTrainer``; ``replay``: ``BAPOTrainer`` with
  ``replay_buffer_size=16, replay_ratio=0.25``; ``decoupled``: ``DecoupledBAPOTrainer``
  (``bapo_trl.experimental.decoupled``) (one more forward pass over each generation batch). Same aggregation
  (``dapo``), seed, model, data and batch; stale micro-batches (``steps_per_generation=4``), so old log-probs are
  computed and the search runs on every step.
* Learning rate 0: every trainer then generates the same completions from the same seed, so the runs do the same
  work and only the method's own machinery differs (the search always scores the whole path in one pass, so its
  cost does not depend on where it stops).
* Interleaved: each round runs one block of ``--steps`` steps per trainer (a short ``train()`` call, reseeded
  identically), the order rotating between rounds; a block's time runs from its first step's start to its last
  step's end (setup excluded). Overheads are medians over rounds of the paired ratios ``bapo / grpo - 1`` and
  ``replay / bapo - 1`` and ``decoupled / bapo - 1``.

Usage: ``python benchmarks/step_overhead.py [--quick] [--rounds N] [--steps N] [--variant NAME]``. The last line is
``bapo_overhead=<ratio-1> replay_overhead=<ratio-1> decoupled_overhead=<ratio-1>``.

``--variant gspo-scale-x10`` adds a fifth trainer, BAPOTrainer with issue 53's chosen settings (``gspo_balanced()``,
the studies' "BAPO GSPO-scale x10": BAPO's balance of the sequence-level ratio on a path around TRL's documented GSPO
window), and appends ``variant_over_bapo=<ratio-1> variant_own_ms=<ms> bapo_own_ms=<ms>`` to the last line: its
search and metrics per step (timed inside BAPO's own code) against the default's, the issue's "costs no more than
today's". ``--variant length-fair``: the same for the length-fair window (``gspo_length_fair()``, the studies' "BAPO
length-fair narrow"); ``--variant gmpo``: BAPO on TRL's GMPO loss (``BAPOGMPOTrainer`` with ``gmpo_balanced()``;
its loss is GMPO's, so compare its own-code time, not its step); ``--variant ratio-fields-set``: the paper's path
written out in the ``ratio_*`` fields against the default config, whose identical path the window rule derives when
the config is built (issue 64: the rule costs nothing per step).

``--model smollm2-135m-instruct`` (a registry name of :mod:`bapo_trl.recipes.models`, or a model directory) measures
GRPO against BAPO on that model instead, on the shipped chat arithmetic task with its math-verify reward (replay is
left out to keep the run short), and adds each trainer's peak process memory (RSS high-water mark, reset before every
block; both trainers stay resident, so compare the two, not the absolute values). The last line is then
``model=<name> bapo_overhead=<ratio-1> own_code_share=<BAPO's own code / GRPO step>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from bapo_trl import BAPOConfig, BAPOTrainer, gspo_balanced  # noqa: E402
from bapo_trl.core.window_rule import PAPER_PATH  # noqa: E402
from bapo_trl.experimental.decoupled import DecoupledBAPOConfig, DecoupledBAPOTrainer  # noqa: E402
from bapo_trl.experimental.gmpo import BAPOGMPOTrainer, GMPOBAPOConfig, gmpo_balanced  # noqa: E402
from bapo_trl.experimental.length_fair import LengthFairBAPOConfig, LengthFairBAPOTrainer, gspo_length_fair  # noqa: E402,E501
from bapo_trl.recipes.toy import build_tiny_model, make_reverse_dataset, reverse_reward  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEED = 0
#: ``--variant``: BAPO settings timed beside the default (the named setting the studies run as "BAPO GSPO-scale x10").
VARIANTS = {"gspo-scale-x10": gspo_balanced,
            # issue 64's window rule: the same path written out in ratio_* fields (the rule then derives nothing)
            # against the default config, whose path the rule derives: the rule runs once, when the config is built
            "ratio-fields-set": lambda: dict(PAPER_PATH),
            "length-fair": gspo_length_fair,  # issue 53's second-round candidate: a window per sequence
            "gmpo": gmpo_balanced}  # its third: BAPO on TRL's GMPO loss
#: Kinds and variants that run on a config and trainer of their own (the rest on BAPOConfig / BAPOTrainer).
CLASSES = {"decoupled": (DecoupledBAPOConfig, DecoupledBAPOTrainer),
           "length-fair": (LengthFairBAPOConfig, LengthFairBAPOTrainer), "gmpo": (GMPOBAPOConfig, BAPOGMPOTrainer)}
#: BAPOTrainer methods timed from inside (what BAPO adds to a GRPO step, free of background noise).
LABELS = {"_adapt_clip_window": "search + metrics", "mix": "replay mixing"}


class BlockTimer(TrainerCallback):
    """Time from the first step's start to the last step's end of a ``train()`` call (setup excluded)."""

    def __init__(self, sync=None):
        self.first = self.last = None
        self.inside: dict[str, float] = {}  # seconds inside wrapped methods, over all timed blocks
        self.sync = sync or (lambda: None)  # torch.cuda.synchronize on a GPU: a step's kernels end before its clock

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first is None:
            self.sync()
            self.first = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        self.last = time.perf_counter()

    def pop(self) -> float:
        elapsed, self.first, self.last = self.last - self.first, None, None
        return elapsed


def common_args(output_dir: str, steps: int, device: str = "cpu", **overrides) -> dict:
    """Training arguments shared by every trainer; ``device="cuda"`` trains in bf16 on the GPU, ``overrides``
    replace any of them (batch shape, completion length, ...)."""
    on_cpu = device == "cpu"
    return dict(
        output_dir=output_dir, use_cpu=on_cpu, bf16=not on_cpu, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=SEED, data_seed=SEED,
        per_device_train_batch_size=8, num_generations=4, steps_per_generation=4, max_completion_length=12,
        temperature=1.0, learning_rate=0.0, loss_type="dapo", max_steps=steps,
    ) | overrides


def build(kind: str, model_dir: str, output_dir: str, steps: int, device: str = "cpu", overrides=None,
          bapo_extra=None, task=None, classes=None):
    """One trainer: ``grpo``, ``bapo`` or ``replay``; each has its own copy of the same model. ``overrides``
    change the shared training arguments, ``bapo_extra`` adds BAPO settings (replay, partial rollout, ...),
    ``classes``: ``(config class, trainer class)`` replacing BAPOConfig / BAPOTrainer (a research candidate)."""
    args = common_args(output_dir, steps, device, **(overrides or {}))
    if kind == "grpo":
        config = GRPOConfig(**args)
        cls = GRPOTrainer
    else:
        extra = {"replay": dict(replay_buffer_size=16, replay_ratio=0.25)}.get(kind, {})
        config_cls, cls = classes or CLASSES.get(kind, (BAPOConfig, BAPOTrainer))
        config = config_cls(**(args | extra | (bapo_extra or {})))  # a variant's settings win (its loss type)
    timer = BlockTimer(torch.cuda.synchronize if device != "cpu" else None)
    reward, dataset = task or (reverse_reward, make_reverse_dataset(64, seed=SEED))
    trainer = cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # no log dict printed per step
    if kind != "grpo":  # time spent inside BAPO's own code, a noise-free part of the overhead
        for name in LABELS:
            owner = trainer.rollout_source if name == "mix" else trainer  # replay mixing: the replay source
            if hasattr(owner, name):
                setattr(owner, name, timed(getattr(owner, name), timer.inside, name))
    return trainer, timer


def timed(method, totals: dict, name: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def run_block(trainer, timer, round_index: int) -> float:
    set_seed(SEED + 1 + round_index)  # the same sampling noise for every trainer within a round
    trainer.train()
    return timer.pop()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def resident_bytes(trainer) -> int:
    """What a trainer itself holds on its device between steps: weights, buffers, optimizer state."""
    model = trainer.model
    held = tensor_bytes(model.parameters()) + tensor_bytes(model.buffers())
    optimizer = getattr(trainer, "optimizer", None)
    for state in (getattr(optimizer, "state", None) or {}).values():
        held += tensor_bytes(state.values())
    return held


def chat_arithmetic_task():
    """The shipped chat arithmetic task (bapo_trl.recipes.math_reasoning.chat_arithmetic) and its math-verify reward,
    for real models."""
    from datasets import Dataset

    from bapo_trl.recipes.math_reasoning.chat_arithmetic import splits
    from bapo_trl.recipes.math_reasoning.rewards import boxed_accuracy

    rows = splits()["train"]
    return boxed_accuracy, Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def _rss_high_water() -> int | None:
    """This process's peak resident memory in bytes since the last reset (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _reset_rss_high_water() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def measure(model_dir: str, kinds=("grpo", "bapo", "replay"), rounds: int = 12, steps: int = 8, device: str = "cpu",
            overrides=None, task=None, settings=None, classes=None) -> dict:
    """Build one trainer per kind on ``device``, run a warm-up block each, then ``rounds`` interleaved blocks of
    ``steps`` steps (order rotating). Returns seconds per block (``times``), the completion tokens per logged step
    of the last block (``tokens``), seconds inside BAPO's own methods (``inside``) and, on CUDA, each trainer's
    peak memory in bytes (``peak``): what it holds itself (weights, optimizer state) plus the most its steps
    allocated on top, so the other trainers resident on the same GPU do not count. On CPU, ``rss_peak``: the
    process's peak RSS in bytes during each trainer's blocks (all trainers resident; compare, do not add)."""
    cuda = device != "cpu"
    peak = dict.fromkeys(kinds, 0)
    rss_peak = dict.fromkeys(kinds, 0)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {kind: build(kind, model_dir, os.path.join(tmp, kind), steps, device, overrides,
                                bapo_extra=(settings or {}).get(kind), task=task,
                                classes=(classes or {}).get(kind))
                    for kind in kinds}

        def block(kind, round_index):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                own = resident_bytes(trainers[kind][0])
            else:
                _reset_rss_high_water()
            elapsed = run_block(*trainers[kind], round_index=round_index)
            if cuda:
                peak[kind] = max(peak[kind], own + torch.cuda.max_memory_allocated() - before)
            else:
                rss_peak[kind] = max(rss_peak[kind], _rss_high_water() or 0)
            return elapsed

        for kind in kinds:  # warm-up block, not timed
            block(kind, -1)
            trainers[kind][1].inside.clear()
        times = {kind: [] for kind in kinds}
        for r in range(rounds):
            order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
            for kind in order:
                times[kind].append(block(kind, r))
        # the work done: completion tokens of the last block (equal for grpo and bapo when generation matches)
        tokens = {kind: [h["num_tokens"] for h in trainers[kind][0].state.log_history if "num_tokens" in h]
                  for kind in kinds}
        inside = {kind: trainers[kind][1].inside for kind in kinds}
        trainers.clear()  # free the models before the next measurement
    return {"times": times, "tokens": tokens, "inside": inside, "peak": peak if cuda else None,
            "rss_peak": None if cuda else rss_peak}


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return f"{head}{' + uncommitted changes' if dirty else ''}"
    except OSError:
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps (< 1 minute)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 12; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block, a multiple of 4 (default 8)")
    parser.add_argument("--model", default=None,
                        help="a real model (bapo_trl.recipes.models registry name or directory): "
                             "GRPO vs BAPO on the chat arithmetic task, with peak memory")
    parser.add_argument("--variant", default=None, choices=sorted(VARIANTS),
                        help="also time BAPOTrainer with these settings (issue 53's candidate) against the default")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.steps is not None and (args.steps < 4 or args.steps % 4):
        parser.error("--steps must be a positive multiple of 4 (whole generation batches of 4 steps), "
                     f"got {args.steps}")
    if args.model:
        return main_model(args)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 12)
    steps = args.steps if args.steps is not None else (4 if args.quick else 8)

    torch.set_num_threads(1)  # measured several times faster than 2 threads for a model this small
    model_dir = build_tiny_model()
    kinds = ("grpo", "bapo", "replay", "decoupled") + (("variant",) if args.variant else ())
    variant_cls = CLASSES.get(args.variant)
    result = measure(model_dir, kinds, rounds, steps, settings={"variant": VARIANTS[args.variant]()} if args.variant
                     else None, classes={"variant": variant_cls})
    times, tokens, inside = result["times"], result["tokens"], result["inside"]

    bapo_ratios = [b / g for b, g in zip(times["bapo"], times["grpo"])]
    replay_ratios = [rp / b for rp, b in zip(times["replay"], times["bapo"])]
    decoupled_ratios = [d / b for d, b in zip(times["decoupled"], times["bapo"])]
    cpu = platform.processor() or platform.machine()
    print(f"# step overhead: embedded tiny model, batch 8 (2 groups of 4 per step), completions <= "
          f"{common_args('', 0)['max_completion_length']} tokens, steps_per_generation=4, loss dapo, lr 0; "
          f"{steps} steps per block, {rounds} interleaved rounds; {os.cpu_count()} cores ({cpu}), "
          f"torch {torch.__version__}, 1 thread; repo {git_state()}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print()
    print("| trainer | median ms per step | min ms per step | paired ratio, median over rounds "
          "| ms per step inside BAPO's own code |")
    print("|---|---|---|---|---|")
    paired = {"bapo": ("bapo / grpo", bapo_ratios), "replay": ("replay / bapo", replay_ratios),
              "decoupled": ("decoupled / bapo", decoupled_ratios)}
    if args.variant:
        paired["variant"] = (f"{args.variant} / bapo", [v / b for v, b in zip(times["variant"], times["bapo"])])
    total_steps = rounds * steps
    for kind in kinds:
        per_step = [1e3 * t / steps for t in times[kind]]
        cell = f"{paired[kind][0]} = {statistics.median(paired[kind][1]):.3f}" if kind in paired else "-"
        own = "; ".join(f"{LABELS[name]} {1e3 * inside[kind][name] / total_steps:.2f}"
                        for name in LABELS if name in inside[kind]) or "-"
        print(f"| {kind} | {statistics.median(per_step):.1f} | {min(per_step):.1f} | {cell} | {own} |")
    print()
    print(f"# per-round ratios bapo/grpo: {' '.join(f'{x:.3f}' for x in bapo_ratios)}")
    print(f"# per-round ratios replay/bapo: {' '.join(f'{x:.3f}' for x in replay_ratios)}")
    print(f"# per-round ratios decoupled/bapo: {' '.join(f'{x:.3f}' for x in decoupled_ratios)}")
    print(f"# completion tokens per generation in the last block: {tokens}")
    # lower-noise estimates: time measured inside BAPO's own code, against the median step
    median_ms = {kind: statistics.median(1e3 * t / steps for t in times[kind]) for kind in kinds}
    own = {kind: 1e3 * sum(inside[kind].values()) / total_steps for kind in kinds if kind != "grpo"}
    print(f"# BAPO's own code: {own['bapo']:.2f} ms per step = {100 * own['bapo'] / median_ms['grpo']:.1f}% of a "
          f"median GRPO step; replay adds {own['replay'] - own['bapo']:.2f} ms = "
          f"{100 * (own['replay'] - own['bapo']) / median_ms['bapo']:.1f}% of a median BAPO step")
    last = (f"bapo_overhead={statistics.median(bapo_ratios) - 1:.4f} "
            f"replay_overhead={statistics.median(replay_ratios) - 1:.4f} "
            f"decoupled_overhead={statistics.median(decoupled_ratios) - 1:.4f}")
    if args.variant:
        print(f"# per-round ratios {args.variant}/bapo: {' '.join(f'{x:.3f}' for x in paired['variant'][1])}")
        last += (f" variant_over_bapo={statistics.median(paired['variant'][1]) - 1:.4f} "
                 f"variant_own_ms={own['variant']:.2f} bapo_own_ms={own['bapo']:.2f}")
    print(last)


def main_model(args) -> None:
    """GRPO vs BAPO on a real model: step time, BAPO's own code per step, peak process memory."""
    from bapo_trl.recipes.models import resolve_model

    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    steps = args.steps if args.steps is not None else 4
    torch.set_num_threads(1)  # the machine's other core is left to the rest of the load (measured faster too)
    model_dir = resolve_model(args.model)
    kinds = ("grpo", "bapo")
    shape = dict(max_completion_length=16)
    result = measure(model_dir, kinds, rounds, steps, overrides=shape, task=chat_arithmetic_task())
    times, inside, rss = result["times"], result["inside"], result["rss_peak"]
    ratios = [b / g for b, g in zip(times["bapo"], times["grpo"])]
    median_ms = {kind: statistics.median(1e3 * t / steps for t in times[kind]) for kind in kinds}
    own_ms = 1e3 * sum(inside["bapo"].values()) / (rounds * steps)
    cpu = platform.processor() or platform.machine()
    print(f"# step overhead on {args.model} ({model_dir}): chat arithmetic task, batch 8 (2 groups of 4 per step), "
          f"completions <= {shape['max_completion_length']} tokens, steps_per_generation=4, loss dapo, lr 0; "
          f"{steps} steps per block, {rounds} interleaved rounds; {os.cpu_count()} cores ({cpu}), torch "
          f"{torch.__version__}, 1 thread; repo {git_state()}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print()
    print("| trainer | median s per step | min s per step | paired ratio, median over rounds "
          "| ms per step inside BAPO's own code | peak process RSS (GiB) |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        per_step = [t / steps for t in times[kind]]
        cell = f"bapo / grpo = {statistics.median(ratios):.3f}" if kind == "bapo" else "-"
        own = f"{own_ms:.2f}" if kind == "bapo" else "-"
        print(f"| {kind} | {statistics.median(per_step):.2f} | {min(per_step):.2f} | {cell} | {own} | "
              f"{rss[kind] / 2**30:.2f} |")
    print()
    print(f"# per-round ratios bapo/grpo: {' '.join(f'{x:.3f}' for x in ratios)}")
    print(f"# BAPO's own code: {own_ms:.2f} ms per step = {100 * own_ms / median_ms['grpo']:.3f}% of a median GRPO "
          f"step ({median_ms['grpo'] / 1e3:.2f} s)")
    print(f"model={args.model} bapo_overhead={statistics.median(ratios) - 1:.4f} "
          f"own_code_share={own_ms / median_ms['grpo']:.5f}")


if __name__ == "__main__":
    main()
