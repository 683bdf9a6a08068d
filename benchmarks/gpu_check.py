"""The GPU check: everything of bapo_trl that can run on one GPU, in one command, with a summary table.

Users run bapo_trl on GPUs; the machines that build and test it have none. When a GPU machine is at hand (one
H100 or H200, no internet, CUDA PyTorch, transformers, accelerate and peft installed, but no trl, datasets or
deepspeed), this script checks, on ``--device cuda``:

1. **bound search** at 256k, 1M and 4M tokens: ours vs the plain loops (official-code port and paper Algorithm 1)
   vs the one-candidate floor, same choice as the loops (``benchmarks/bound_search.py``'s ``bench_shape``);
2. **no host sync**: the search (both variants x both modes, and the length-fair window's search in both modes) runs
   under ``torch.cuda.set_sync_debug_mode("error")``
   and under :class:`HostSyncGuard`, which fails on any op that reads device values on the host (``.item()``,
   ``.tolist()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing, host data copied to the device, ...);
3. **BAPO vs TRL GRPO steps** in bf16 on a randomly initialised model of Qwen2.5-0.5B's shape (Llama
   architecture, 24 layers, hidden 896, vocabulary 151,936: 494M parameters, built locally, no hub), at two batch
   sizes, same batch, learning rate 0 so both do identical work: step-time ratio and peak-memory ratio (and BAPO
   ``DecoupledBAPOTrainer`` against BAPO: the cost of its extra forward pass)
   (``benchmarks/step_overhead.py``'s ``measure``; target: BAPO within 1% of GRPO); then, per batch size, one block
   of BAPO steps under ``torch.profiler``: the search's and BAPO's whole adaptation's (search + metrics) share of
   the block's device time and host time, and the host syncs the search makes inside those real training steps;
   **sequence-level settings**: ``gspo_balanced()`` (one window) and ``gspo_length_fair()`` (a window per
   sequence) against the default, interleaved at the largest batch: whole steps and each one's own code per step;
4. **TRL as the oracle** on the device: ``tests/test_trl_oracle.py`` (BAPO(C) trains TRL(C)'s loss and gradient on
   on-policy data, and with the path pinned to TRL's window on stale data, every loss type, both ratio levels, TRL's
   other loss settings, LoRA; the end-to-end rows stay on the CPU) run by pytest with its trainers on ``--device``,
   the model in float32 and in bfloat16 (``BAPO_TEST_DEVICE`` / ``BAPO_TEST_DTYPE``, ``tests/support/trainers.py``);
   on CPU in bfloat16 only, at the documented windows (CI's fast tier runs it all in float32);
5. **replay queue** and **partial rollout**, a few BAPO steps each, on the device;
   **LoRA adapter push**: a LoRA run in server mode pushing its adapter from the device (gather, peft's files, the
   bytes and seconds of each push) to the stand-in server of ``tests/support/policy_server.py`` (no vLLM GPU wheel
   travels);
6. **DeepSpeed**: a 1-process ZeRO-3 launch of ``train_bapo.py`` (``accelerate_configs/deepspeed_zero3.yaml``),
   and, on CUDA, a JIT build of DeepSpeed's FusedAdam op with the machine's nvcc, then one step of it (last: the
   longest, and what a short lease can lose).

On CPU (``--device cpu --quick``, ``make test-on-demand``: run it before a GPU session) the same code runs small:
16k-token search, a 2-layer random model, the tiny default in the launch; no memory figures, no op build.

On the GPU machine (Python 3.12, x86_64). Here, first, with internet::

    bash scripts/gpu_wheels.sh            # trl, datasets, deepspeed, bapo_trl and their missing deps -> .gpu_wheels/

then send the working tree with ``.gpu_wheels`` (ignored by git, under 64 MiB) and run there, from the repo root::

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_site .gpu_wheels/*.whl
    export PYTHONPATH=$PWD:/tmp/gpu_site HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_check.py --device cuda 2>&1 | tee gpu_check.log

(``$PWD`` first: the checkout's ``bapo_trl`` is what gets checked; the wheel of it is there for installing without
the checkout.) About 6.5 minutes on an H200 (2026-11-26: 342 s with the op build failing at once; the step timing
293 s, a passing DeepSpeed section 57-80 s with the op's build 32-39 s; 2026-11-27: the sequence-level settings 95
s; 2026-11-29: the oracle 2 x 43 s). ``--skip`` leaves sections out
(``search,steps,variants,oracle,replay,lora,deepspeed``); ``--batches`` and ``--rounds`` set the step comparison's
micro-batch sizes and rounds (a repeat of it alone: ``--skip search,variants,oracle,replay,lora,deepspeed``).

Output: one table row per check, then one machine-readable line::

    device=<cpu|cuda> checks=<n> failed=<n> search_tokens=<n> speedup_vs_loop=<x> floor_ratio=<x> host_syncs=<n>
    step_time_ratio=<bapo/grpo> peak_memory_ratio=<bapo/grpo or nan> search_device_share=<x or nan>
    adapt_host_share=<x> step_syncs=<n> decoupled_step_ratio=<decoupled/bapo>
    length_fair_step_ratio=<length-fair/gspo-scale-x10> length_fair_own_ms=<ms> balanced_own_ms=<ms>
    zero3=<pass|fail|skip> oracle=<...>
    replay=<...> partial_rollout=<...> lora_push=<...>

(all on one line; over the batch sizes of the step comparison, the ratios and shares are the largest and
``step_syncs`` the sum). Exit code 1 if any check failed. Timings are reported, never judged: only wrong results
(different choices than the loops, a host sync, a launch that did not run ZeRO-3, replay or partial rollout that
did nothing) fail a check.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, also when imported by tests

import bound_search  # noqa: E402
import step_overhead  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bapo_trl import search_clip_bounds  # noqa: E402
from bapo_trl.experimental.length_fair.search import length_fair_search  # noqa: E402
from bapo_trl.recipes.toy import build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: (B, T) of the search: 256k, 1M, 4M tokens on CUDA; 16k on CPU with --quick (16k, 256k without).
CUDA_SHAPES = [(512, 512), (1024, 1024), (2048, 2048)]
CPU_SHAPES = [(64, 256), (512, 512)]
#: Qwen2.5-0.5B's shape (Llama architecture: see bapo_trl.recipes.toy on qwen2 configs and this tokenizer):
#: 494M parameters.
GPU_MODEL = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
                 rope_theta=1e6)
#: The same builder on CPU, small: a vocabulary larger than the tokenizer's, as in the GPU model.
CPU_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=256)
#: The step comparison's batch on CUDA: 2 groups of 8 per micro-batch, completions of 128 tokens, stale data.
GPU_STEP_ARGS = dict(per_device_train_batch_size=16, num_generations=8, steps_per_generation=4,
                     max_completion_length=128)
#: The micro-batch sizes the step comparison runs at on CUDA (8 completions per group): 2 and 8 groups.
GPU_STEP_BATCHES = (16, 64)
#: The sections, in the order they run (``--skip`` names some of them).
SECTIONS = ("search", "steps", "variants", "oracle", "replay", "lora", "deepspeed")
#: The LoRA push's adapter: rank 16 on q_proj and v_proj, as benchmarks/lora_push.py measures it on SmolLM2.
LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])


# -- host synchronisation -------------------------------------------------------------------------------------------


class HostSyncError(RuntimeError):
    pass


#: aten ops that read device values on the host or whose output size depends on the data (a sync on CUDA).
SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
            "unique_dim", "unique_consecutive", "repeat_interleave", "lift_fresh", "lift_fresh_copy", "equal"}
#: Tensor methods that hand device values to Python.
SYNC_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}


class _SyncFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            raise HostSyncError(f"host sync: Tensor.{name}()")
        return func(*args, **(kwargs or {}))


class _SyncOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            why = "host data to the device" if "lift" in name else "reads device values or has a data-dependent size"
            raise HostSyncError(f"host sync: aten.{name} ({why})")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean-mask indexing: nonzero
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise HostSyncError(f"host sync: aten.{name} with a boolean mask (data-dependent size)")
        if name in ("_to_copy", "copy_"):
            devices = {a.device for a in args if isinstance(a, torch.Tensor)}
            if "device" in kwargs and kwargs["device"] is not None:
                devices.add(torch.device(kwargs["device"]))
            if len(devices) > 1:
                raise HostSyncError(f"host sync: aten.{name} between {sorted(map(str, devices))}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_sync_guard(device: str | torch.device = "cpu"):
    """Fail on anything that would make the host wait for the device: on CUDA, PyTorch's own sync debug mode set to
    ``"error"``; on every device, function- and dispatch-level hooks that refuse ``.item()``, ``.tolist()``,
    ``bool(t)``, ``nonzero``, boolean-mask indexing, data-dependent shapes and copies between host and device. On
    CPU nothing synchronises, so the hooks are what proves the code would not on CUDA."""
    cuda = torch.device(device).type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    with _SyncFunctions(), _SyncOps():
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)


def guarded(device: str, call):
    """``(call(), None)``, or ``(None, error)`` where the call made a host sync under :func:`host_sync_guard`."""
    try:
        with host_sync_guard(device):
            return call(), None
    except (HostSyncError, RuntimeError) as err:  # CUDA's sync debug mode raises a RuntimeError
        return None, err


def check_no_host_sync(device: str, shape=(64, 256)) -> dict:
    """Run the search for both variants and both modes, and the length-fair window's search for both modes, under
    :func:`host_sync_guard`, after one unguarded call each (the first call for a path on a device uploads the
    path's constants once; they are cached)."""
    ratio, advantages, mask = bound_search.make_batch(*shape, seed=1, device=device)
    combos = [(v, m) for v in ("paper", "verl") for m in ("value", "gradient")]
    log_ratio = torch.where(mask != 0, ratio.log(), 0.0)  # the length-fair window's search reads log-ratios
    results, errors = {}, []
    calls = [(f"{variant}/{mode}", lambda v=variant, m=mode: search_clip_bounds(
        ratio, advantages, mask, bapo_variant=v, positive_contribution_mode=m)) for variant, mode in combos]
    calls += [(f"length-fair/{mode}", lambda m=mode: length_fair_search(log_ratio, advantages, mask,
                                                                        positive_contribution_mode=m))
              for mode in ("value", "gradient")]
    for _, call in calls:  # unguarded first: each path's constants are uploaded once, then cached
        call()
    for name, call in calls:
        result, err = guarded(device, call)
        if err is None:
            results[name] = result.as_floats()  # read after the guard: ONE transfer
        else:
            errors.append(f"{name}: {err}")
    return {"searches": len(calls), "host_syncs": len(errors), "errors": errors, "results": results,
            "guard": "dispatch/function hooks" + (" + torch.cuda.set_sync_debug_mode('error')"
                                                  if torch.device(device).type == "cuda" else "")}


# -- models ---------------------------------------------------------------------------------------------------------


def build_random_model(output_dir: str, device: str = "cpu", dtype=torch.bfloat16, **shape) -> str:
    """A randomly initialised Llama-architecture model of the given shape, saved with the embedded tokenizer.

    The vocabulary may be larger than the tokenizer's (as a real model's shape needs): ids the tokenizer does not
    know decode to nothing, so rewards see short strings, while training sees every sampled token.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = LlamaConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **shape)
    torch.manual_seed(0)
    with torch.device(device):  # initialise where it is fast (the GPU for 0.5B)
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    model.generation_config.save_pretrained(output_dir)
    return output_dir


# -- sections -------------------------------------------------------------------------------------------------------


def section_search(device: str, quick: bool) -> list[dict]:
    cuda = device == "cuda"
    shapes = CUDA_SHAPES if cuda else (CPU_SHAPES[:1] if quick else CPU_SHAPES)
    repeats, loop_repeats = ((10, 2) if quick else (35, 7)) if cuda else ((4, 2) if quick else (9, 3))
    rows = []
    for batch, length in shapes:
        row = bound_search.bench_shape(batch, length, repeats, loop_repeats, device=device)
        ms = row["ms"]
        rows.append({
            "check": f"bound search {batch}x{length} ({row['tokens'] // 1024}k tokens)",
            "ok": row["agree"] and row["visited"]["ours"] == 1,
            "detail": (f"ours {ms['ours']:.3f} ms; verl loop {ms['verl']:.2f} ms ({ms['verl'] / ms['ours']:.1f}x), "
                       f"paper loop {ms['paper']:.2f} ms ({ms['paper'] / ms['ours']:.1f}x); floor {ms['floor']:.3f} "
                       f"ms (ours/floor {ms['ours'] / ms['floor']:.2f}x; floor* {ms['floor_mul']:.3f} ms); "
                       f"{row['visited']['verl']}/{row['visited']['paper']} candidates in the loops; "
                       f"same choice as the loops: {row['agree']}"),
            "tokens": row["tokens"], "speedup": ms["verl"] / ms["ours"], "floor_ratio": ms["ours"] / ms["floor"],
        })
    sync = check_no_host_sync(device)
    rows.append({
        "check": "bound search: no host sync",
        "ok": sync["host_syncs"] == 0,
        "detail": (f"{sync['searches']} searches (paper/verl x value/gradient, length-fair x value/gradient), "
                   f"{sync['host_syncs']} with a host "
                   f"sync; guard: {sync['guard']}" + ("; " + "; ".join(sync["errors"]) if sync["errors"] else "")),
        "host_syncs": sync["host_syncs"],
    })
    return rows


def section_steps(device: str, quick: bool, tmp: str, batches=GPU_STEP_BATCHES, rounds: int | None = None
                  ) -> list[dict]:
    cuda = device == "cuda"
    start = time.perf_counter()
    model_dir = build_random_model(os.path.join(tmp, "random-model"), device=device,
                                   dtype=torch.bfloat16 if cuda else torch.float32,
                                   **(GPU_MODEL if cuda else CPU_MODEL))
    params = sum(p.numel() for p in _load_config_model(model_dir).parameters())
    build_s = time.perf_counter() - start
    default_rounds, steps = ((2, 4) if quick else (5, 4)) if cuda else ((2, 4) if quick else (4, 4))
    rounds = rounds or default_rounds
    batches = batches if cuda else (None,)  # on CPU the small model's own batch
    rows = []
    for batch in batches:
        overrides = (GPU_STEP_ARGS | {"per_device_train_batch_size": batch}) if cuda else {}
        rows.append(step_row(model_dir, device, overrides, rounds, steps, params, build_s))
        rows.append(profile_row(model_dir, device, overrides, steps, tmp))
    return rows


def section_variants(device: str, quick: bool, tmp: str, rounds: int | None = None) -> list[dict]:
    """Issue 53's two sequence-level settings timed against each other and the default, interleaved on one model:
    ``gspo_balanced()`` (the studies' "BAPO GSPO-scale x10": one window for every sequence) and
    ``gspo_length_fair()`` (a window per sequence); on CUDA at the largest batch of the step comparison."""
    cuda = device == "cuda"
    model_dir = os.path.join(tmp, "random-model")
    if not os.path.isdir(model_dir):  # built by the steps section unless it was skipped
        build_random_model(model_dir, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                           **(GPU_MODEL if cuda else CPU_MODEL))
    rounds = rounds or (2 if quick else 5 if cuda else 4)
    steps = 4
    overrides = (GPU_STEP_ARGS | {"per_device_train_batch_size": max(GPU_STEP_BATCHES)}) if cuda else {}
    kinds = ("bapo",) + tuple(step_overhead.VARIANTS)
    result = step_overhead.measure(model_dir, kinds, rounds=rounds, steps=steps, device=device,
                                   overrides=overrides or None,
                                   settings={name: make() for name, make in step_overhead.VARIANTS.items()})
    times, tokens = result["times"], result["tokens"]
    ms = {k: 1e3 * statistics.median(t) / steps for k, t in times.items()}
    own = {k: 1e3 * sum(result["inside"][k].values()) / (rounds * steps) for k in kinds}
    paired = [f / x for f, x in zip(times["length-fair"], times["gspo-scale-x10"])]
    same_work = all(tokens[k] == tokens["bapo"] for k in kinds)
    batch = step_overhead.common_args("", steps, device, **overrides)["per_device_train_batch_size"]
    return [{
        "check": f"sequence-level settings' steps, batch {batch}",
        "ok": same_work,
        "detail": (f"{rounds} interleaved rounds of {steps} steps, lr 0: "
                   + ", ".join(f"{k} {ms[k]:.1f} ms/step (own code {own[k]:.2f} ms)" for k in kinds)
                   + f"; paired length-fair/gspo-scale-x10 {statistics.median(paired):.4f} (per round "
                   f"{' '.join(f'{r:.3f}' for r in paired)}); same completion tokens: {same_work}"),
        "length_fair_ratio": statistics.median(paired), "length_fair_own_ms": own["length-fair"],
        "balanced_own_ms": own["gspo-scale-x10"],
    }]


def step_row(model_dir: str, device: str, overrides: dict, rounds: int, steps: int, params: int,
             build_s: float) -> dict:
    """BAPO vs GRPO, interleaved blocks of ``steps`` steps: the paired step-time ratio and the peak-memory ratio; and
    ``DecoupledBAPOTrainer`` (one more forward pass per generation batch) against BAPO."""
    cuda = device == "cuda"
    result = step_overhead.measure(model_dir, ("grpo", "bapo", "decoupled"), rounds=rounds, steps=steps,
                                   device=device, overrides=overrides or None)
    times = result["times"]
    ratios = [b / g for b, g in zip(times["bapo"], times["grpo"])]
    step_ratio = statistics.median(ratios)
    decoupled = [d / b for d, b in zip(times["decoupled"], times["bapo"])]
    ms = {k: 1e3 * statistics.median(t) / steps for k, t in times.items()}
    tokens = result["tokens"]
    same_work = tokens["grpo"] == tokens["bapo"] == tokens["decoupled"]
    peak = result["peak"]
    memory_ratio = peak["bapo"] / peak["grpo"] if peak else math.nan
    inside = 1e3 * sum(result["inside"]["bapo"].values()) / (rounds * steps)
    args = step_overhead.common_args("", steps, device, **overrides)
    memory = (f"; peak memory grpo {peak['grpo'] / 2**30:.2f} GiB, bapo {peak['bapo'] / 2**30:.2f} GiB "
              f"(bapo/grpo {memory_ratio:.4f})" if peak else "; peak memory: CUDA only")
    batch = args["per_device_train_batch_size"]
    return {
        "check": f"BAPO vs GRPO training steps, batch {batch}",
        "ok": same_work,
        "detail": (f"{params / 1e6:.1f}M-parameter random model ({'bf16' if cuda else 'fp32'}, built in "
                   f"{build_s:.0f} s), batch {batch} ({args['num_generations']} per "
                   f"group), completions <= {args['max_completion_length']}, steps_per_generation "
                   f"{args['steps_per_generation']}, lr 0; {rounds} interleaved rounds of {steps} steps: grpo "
                   f"{ms['grpo']:.1f} ms/step, bapo {ms['bapo']:.1f} ms/step, paired bapo/grpo {step_ratio:.4f} "
                   f"(per round {' '.join(f'{r:.3f}' for r in ratios)}; target <= 1.01: "
                   f"{'met' if step_ratio <= 1.01 else 'not met'}); inside BAPO's own code {inside:.2f} ms/step"
                   f"{memory}; decoupled {ms['decoupled']:.1f} ms/step, paired decoupled/bapo "
                   f"{statistics.median(decoupled):.4f} (per round {' '.join(f'{r:.3f}' for r in decoupled)})"
                   + (f", peak {peak['decoupled'] / 2**30:.2f} GiB" if peak else "")
                   + f"; same completion tokens: {same_work}"),
        "step_ratio": step_ratio, "memory_ratio": memory_ratio, "decoupled_ratio": statistics.median(decoupled),
    }


def profile_row(model_dir: str, device: str, overrides: dict, steps: int, tmp: str) -> dict:
    """BAPO's share of real training steps, from ``torch.profiler``, and the search's host syncs inside them.

    One BAPO trainer, three blocks of ``steps`` steps: a warm-up; a block with every search call under
    :func:`host_sync_guard` (a call that syncs is counted, then repeated unguarded so training goes on); a block
    under the profiler with the search and the whole adaptation (``_adapt_clip_window``: search + metrics) each in
    a ``record_function`` range. Device time is what the kernels launched inside a range took on the GPU (over
    all the GPU work of the block); host time is the range's wall time on the CPU (over the block's wall time). The
    adaptation's metrics read values on the host (one sync per micro-batch, as TRL's own metrics do), so its host
    time includes waiting for GPU work queued before it: an upper bound on BAPO's own CPU time. The guard covers the
    search only."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    import bapo_trl.trainer.bapo_trainer as trainer_module

    cuda = device == "cuda"
    trainer, timer = step_overhead.build("bapo", model_dir, os.path.join(tmp, "profiled"), steps, device,
                                         overrides or None)
    search, adapt = trainer_module.search_clip_bounds, trainer._adapt_clip_window
    state = {"guard": False, "calls": 0, "syncs": []}

    def searched(*args, **kwargs):
        with record_function("bapo.search"):
            if not state["guard"]:
                return search(*args, **kwargs)
            state["calls"] += 1
            result, err = guarded(device, lambda: search(*args, **kwargs))
            if err is None:
                return result
            state["syncs"].append(f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            return search(*args, **kwargs)  # unguarded, so training goes on

    def adapted(*args, **kwargs):
        with record_function("bapo.adapt"):
            return adapt(*args, **kwargs)

    trainer._adapt_clip_window = adapted
    trainer_module.search_clip_bounds = searched
    try:
        step_overhead.run_block(trainer, timer, 0)  # warm-up (and the search's constants, uploaded once)
        state["guard"] = True
        step_overhead.run_block(trainer, timer, 1)
        state["guard"] = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            wall = step_overhead.run_block(trainer, timer, 2)
    finally:
        trainer_module.search_clip_bounds = search
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    # microseconds of GPU work: every kernel, copy and set the device ran (user ranges left out: they would count
    # their kernels twice); the kernels linked to a CPU op (each once) are a cross-check
    device_total = sum(e.device_time_total for e in prof.events()
                       if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))
    linked_total = sum(e.self_device_time_total for e in events)

    def ranged(name):  # (device us, host us) inside every range of that name
        found = [e for e in events if e.name == name]
        return sum(e.device_time_total for e in found), sum(e.cpu_time_total for e in found), len(found)

    search_dev, search_host, calls = ranged("bapo.search")
    adapt_dev, adapt_host, _ = ranged("bapo.adapt")
    wall_us = 1e6 * wall
    batch = step_overhead.common_args("", steps, device, **overrides)["per_device_train_batch_size"]
    device_part = (f"device time: search {search_dev / 1e3 / steps:.3f} ms/step = "
                   f"{100 * search_dev / device_total:.3f}% of the GPU's {device_total / 1e3 / steps:.1f} ms/step "
                   f"({linked_total / 1e3 / steps:.1f} ms/step linked to CPU ops), "
                   f"adaptation {adapt_dev / 1e3 / steps:.3f} ms/step = {100 * adapt_dev / device_total:.3f}%; "
                   if cuda and device_total > 0 else "device time: CUDA only; ")
    del trainer, prof
    gc.collect()  # the next batch size's trainers start on an empty GPU
    if cuda:
        torch.cuda.empty_cache()
    return {
        "check": f"BAPO's share of a step (profiler), batch {batch}",
        "ok": calls > 0 and state["calls"] > 0 and not state["syncs"],
        "detail": (f"{steps} steps, {calls} searches profiled, {wall_us / 1e3 / steps:.1f} ms/step wall; "
                   f"{device_part}host time: search {search_host / 1e3 / steps:.3f} ms/step = "
                   f"{100 * search_host / wall_us:.3f}% of the wall time, adaptation {adapt_host / 1e3 / steps:.3f} "
                   f"ms/step = {100 * adapt_host / wall_us:.3f}%; host syncs in {state['calls']} guarded searches "
                   f"inside training steps: {len(state['syncs'])}"
                   + (" (" + "; ".join(sorted(set(state["syncs"]))) + ")" if state["syncs"] else "")),
        "search_device_share": search_dev / device_total if device_total else math.nan,
        "adapt_host_share": adapt_host / wall_us, "step_syncs": len(state["syncs"]),
    }


def _load_config_model(model_dir: str):
    """The model's parameters without its weights (meta device), to count them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def section_deepspeed(device: str, tmp: str) -> list[dict]:
    rows = [launch_zero3(device, os.path.join(tmp, "zero3"))]
    if device == "cuda":
        rows.append(build_deepspeed_op())
    return rows


def launch_zero3(device: str, out: str) -> dict:
    """``accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 1 train_bapo.py``
    on the embedded tiny default for a few steps; its launch record must say DeepSpeed, ZeRO-3, partitioned."""
    cuda = device == "cuda"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml"), "--num_processes", "1",
           "--main_process_port", str(bound_search._free_port())]
    cmd += [] if cuda else ["--mixed_precision", "no"]  # the yaml's bf16 is for GPUs
    cmd += [str(REPO / "train_bapo.py"), "--max_steps", "4", "--per_device_train_batch_size", "8",
            "--num_generations", "4", "--steps_per_generation", "2", "--max_completion_length", "8",
            "--output_dir", out]
    cmd += ["--use_cpu", "False", "--bf16", "True"] if cuda else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - start
    info_path = Path(out, "launch_info", "rank0.json")
    if proc.returncode != 0 or not info_path.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"check": "DeepSpeed ZeRO-3 launch of train_bapo.py", "ok": False,
                "detail": f"exit {proc.returncode} after {seconds:.0f} s: ...{tail}"}
    info = json.loads(info_path.read_text())
    history = Path(out, "bapo_log_history.json")
    logs = json.loads(history.read_text())["log_history"] if history.exists() else []
    steps = [h for h in logs if "bapo/clip_high" in h]
    ok = (info["distributed_type"] == "DEEPSPEED" and info["zero_stage"] == 3 and info["world_size"] == 1
          and info["ds_partitioned_parameters"] > 0 and info["device"].startswith(device)
          and len(steps) == 4 and "BAPO run summary" in proc.stdout)
    return {"check": "DeepSpeed ZeRO-3 launch of train_bapo.py", "ok": ok,
            "detail": (f"1 process on {info['device']}, {info['distributed_type']} stage {info['zero_stage']}, "
                       f"{info['ds_partitioned_parameters']} partitioned parameters "
                       f"({info.get('full_numel', 0)} elements), {len(steps)} BAPO steps logged, {seconds:.0f} s "
                       "(launch included)")}


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder can read it, or None where it needs no change.

    DeepSpeed (0.19.8) sorts the listed compute capabilities as integers and fails on an architecture-specific
    suffix: ``9.0a`` (what the GPU machine's image sets) raises ``ValueError: invalid literal for int() with base
    10: '0a'`` before nvcc runs. Without the suffix the op builds for sm_90, which FusedAdam needs no more than;
    ``+PTX`` stays (DeepSpeed reads it)."""
    if not value:
        return None
    parts = [p for p in value.replace(" ", ";").split(";") if p]
    fixed = [re.sub(r"^(\d+\.\d+)[a-z]+(\+PTX)?$", r"\1\2", part) for part in parts]  # names stay as they are
    return None if fixed == parts else ";".join(fixed)


def build_deepspeed_op() -> dict:
    """JIT-build DeepSpeed's FusedAdam with the machine's nvcc, then take one step with it."""
    start = time.perf_counter()
    arch = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    note = f"; TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']!r} read as {arch!r}" if arch else ""
    try:
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.ops.op_builder import FusedAdamBuilder

        with mock.patch.dict(os.environ, {"TORCH_CUDA_ARCH_LIST": arch} if arch else {}):
            FusedAdamBuilder().load()
        build_s = time.perf_counter() - start
        param = torch.nn.Parameter(torch.ones(4096, device="cuda"))
        optimizer = FusedAdam([param], lr=0.1)
        param.grad = torch.ones_like(param)
        optimizer.step()
        moved = bool((param.detach() < 1).all().item())
        return {"check": "DeepSpeed op build (FusedAdam, nvcc)", "ok": moved,
                "detail": f"built and loaded in {build_s:.0f} s; one step moved the weights: {moved}{note}"}
    except Exception as err:  # noqa: BLE001 - reported in the table
        return {"check": "DeepSpeed op build (FusedAdam, nvcc)", "ok": False,
                "detail": f"{type(err).__name__}: {str(err)[-1500:]}{note}"}


def section_oracle(device: str) -> list[dict]:
    """``tests/test_trl_oracle.py`` with its trainers on ``device``, one pytest run per model dtype (module docstring,
    item 4): a row each, passing where every test passed."""
    rows = []
    runs = (("float32", None), ("bfloat16", None)) if device == "cuda" else (("bfloat16", "at_the_documented_window"),)
    for dtype, only in runs:
        env = dict(os.environ, BAPO_TEST_DEVICE=device, BAPO_TEST_DTYPE=dtype, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "pytest", "tests/test_trl_oracle.py", "-q", "-p", "no:cacheprovider",
                   "-W", "ignore", "--tb=short", *(["-k", only] if only else []),
                   *(["-n", str(min(8, os.cpu_count() or 1))] if device == "cuda" else [])]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        failures = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
        rows.append({"check": f"TRL as the oracle on {device}, {dtype}", "ok": done.returncode == 0,
                     "detail": f"tests/test_trl_oracle.py{f' -k {only}' if only else ''}: {summary.strip('= ')}"
                               + ("; " + "; ".join(failures[:5]) if failures else "")
                               + (f"; {done.stderr.strip()[-500:]}" if done.returncode not in (0, 1) else "")})
    return rows


def section_replay(device: str, tmp: str) -> list[dict]:
    """A few BAPO steps with the replay queue, then with partial rollout, on the device (the tiny default)."""
    model_dir = build_tiny_model()
    runs = {
        "replay queue": dict(steps=6, overrides=dict(steps_per_generation=1),
                             bapo_extra=dict(replay_buffer_size=16, replay_ratio=0.5)),
        "partial rollout": dict(steps=6, overrides=dict(steps_per_generation=1, max_completion_length=12),
                                bapo_extra=dict(partial_rollout_budget=4, partial_rollout_max_resumes=2)),
    }
    rows = []
    for name, run in runs.items():
        trainer, _ = step_overhead.build("bapo", model_dir, os.path.join(tmp, name.replace(" ", "-")), run["steps"],
                                         device, run["overrides"], run["bapo_extra"])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        on = trainer.model.device.type

        def most(key):  # a metric's largest value over the steps (None where a step had nothing to report)
            return max((h.get(key) or 0.0 for h in logs), default=0.0)

        if name == "replay queue":
            fraction = most("replay/fraction")
            ok = on == device and fraction > 0 and len(logs) == run["steps"]
            detail = (f"{len(logs)} steps on {on}: queue up to {most('replay/size'):.0f} groups, replayed fraction "
                      f"up to {fraction:.2f}, staleness up to {most('replay/staleness_max'):.0f} steps")
        else:
            segments = most("partial/segments_per_completion")
            stale = most("partial/token_staleness_max")
            ok = on == device and segments > 1 and len(logs) == run["steps"]
            detail = (f"{len(logs)} steps on {on}: up to {segments:.2f} segments per scored completion, token "
                      f"staleness up to {stale:.0f} steps")
        rows.append({"check": name, "ok": ok, "detail": detail})
        del trainer
    return rows


def section_lora(device: str, quick: bool, tmp: str) -> list[dict]:
    """A LoRA run's adapter push from the device, end to end: BAPOTrainer in server mode with a peft adapter
    (:data:`LORA`) on the random model of the step comparison, 4 steps, a push every 2. No vLLM GPU wheel can travel
    to the GPU machine, so the server is the STAND-IN of ``tests/support/policy_server.py`` (a thread sampling on the
    CPU with transformers, loading each pushed adapter with peft as vLLM would load it): what runs for real is the
    trainer's side of the push on the device, the gather of the adapter's parameters, peft's files written, the
    base weights once, the name switch and unload. Checked: two pushes, the first with the base weights, the second
    the adapter alone; every request named an adapter the server held. Reported: bytes and seconds of each push, the
    adapter's gather alone, TRL's sampler/trainer log-prob difference (the stand-in samples in float32 on the CPU,
    the trainer runs in bf16 on CUDA: the gap there is precision, not staleness)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo_trl import BAPOConfig, BAPOTrainer
    from bapo_trl.generation.gather import adapter_parameters
    from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

    sys.path.insert(0, str(REPO / "tests"))
    from support.policy_server import PolicyServer  # the stand-in server (named so in the row)

    cuda = device == "cuda"
    model_dir = os.path.join(tmp, "random-model")  # the step comparison's, when that section ran
    if not os.path.isdir(model_dir):
        build_random_model(model_dir, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                           **(GPU_MODEL if cuda else CPU_MODEL))
    server = PolicyServer(model_dir)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        args = step_overhead.common_args(
            os.path.join(tmp, "lora"), 4, device, steps_per_generation=2, learning_rate=1e-4,
            max_completion_length=8 if cuda else 6, use_vllm=True, vllm_mode="server", vllm_server_host=host,
            vllm_server_port=int(port), vllm_server_timeout=600)
        trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward,
                              args=BAPOConfig(**args), train_dataset=make_reverse_dataset(64, seed=step_overhead.SEED),
                              processing_class=AutoTokenizer.from_pretrained(model_dir),
                              peft_config=LoraConfig(**LORA))
        backend = trainer.vllm_generation
        trainer.train()
        logs = trainer.state.log_history
        pushed = [h["weight_sync/pushed_bytes"] for h in logs if "weight_sync/pushed_bytes" in h]
        seconds = [h["weight_sync/seconds"] for h in logs if "weight_sync/seconds" in h]
        gaps = [h["sampling/sampling_logp_difference/mean"] for h in logs
                if "sampling/sampling_logp_difference/mean" in h]
        adapter = sum(p.numel() * p.element_size() for _, p in adapter_parameters(trainer.model, "default"))
        model = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" not in n)
        gathers = []
        for _ in range(5):
            start = time.perf_counter()
            backend._gathered_adapter()
            gathers.append(time.perf_counter() - start)
        events = [event for event, _ in server.lora_events]
        on = next(p for _, p in adapter_parameters(trainer.model, "default")).device.type
        # loads and unloads: the start-up probe's (a zero adapter of the run's shapes), the two pushes' (the first
        # adapter unloaded when the second replaced it), and the last adapter's at the end of training
        ok = (on == device and len(pushed) == 2 and pushed[0] > 0.5 * model and pushed[1] < adapter + 2**16
              and events.count("load") == 3 and events.count("unload") == 3 and "unknown" not in events
              and server.requests["RPC", "reload_weights"] == 1 and backend.uses_adapter_sync)
        detail = (f"stand-in server (tests/support/policy_server.py, CPU); adapter r={LORA['r']} on "
                  f"{'/'.join(LORA['target_modules'])} of the {model / 2**20:.0f} MiB model on {on}: "
                  f"{adapter / 2**20:.2f} MiB ({adapter / model:.2%}); pushes "
                  + ", ".join(f"{b / 2**20:.2f} MiB in {s:.2f} s" for b, s in zip(pushed, seconds))
                  + f" (first: base weights once + adapter); adapter gather alone "
                  f"{1e3 * statistics.median(gathers):.1f} ms (median of 5); loads/unloads "
                  f"{events.count('load')}/{events.count('unload')} (start-up probe and end of training included); "
                  f"sampler/trainer "
                  f"log-prob difference {' '.join(f'{g:.2e}' for g in gaps)}")
        return [{"check": "LoRA adapter push (server mode, stand-in server)", "ok": ok, "detail": detail,
                 "lora_push_mib": pushed[-1] / 2**20 if pushed else math.nan}]
    finally:
        server.close()


# -- report ---------------------------------------------------------------------------------------------------------


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} missing")
    return ", ".join(found)


def device_name(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    threads = torch.get_num_threads()
    return f"CPU ({os.cpu_count()} cores, {threads} torch thread{'s' if threads > 1 else ''})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="fewest repeats; on CPU also the smallest sizes (make test-on-demand)")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out: "
                        + ",".join(SECTIONS))
    parser.add_argument("--batches", default=",".join(map(str, GPU_STEP_BATCHES)),
                        help="CUDA: comma-separated micro-batch sizes of the step comparison, each a multiple of 8 "
                             "(whole groups of 8) (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the step comparison (default: 5 on CUDA, 4 on CPU, 2 with "
                             "--quick)")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SECTIONS):
        parser.error(f"--skip: unknown section(s) {','.join(sorted(skip - set(SECTIONS)))}; the sections are "
                     f"{','.join(SECTIONS)}")
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError:
        batches = ()
    if not batches or any(b <= 0 or b % 8 for b in batches):
        parser.error(f"--batches must be positive multiples of 8 separated by commas, got {args.batches!r}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    if args.device == "cpu":
        torch.set_num_threads(1)  # the shared 2-core boxes: one thread is fastest for these sizes
    print(f"# gpu_check on {device_name(args.device)}; {versions()}; Python {platform.python_version()}; repo "
          f"{step_overhead.git_state()}; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)

    sections = {"search": lambda tmp: section_search(args.device, args.quick),
                "steps": lambda tmp: section_steps(args.device, args.quick, tmp, batches, args.rounds),
                "variants": lambda tmp: section_variants(args.device, args.quick, tmp, args.rounds),
                "oracle": lambda tmp: section_oracle(args.device),
                "replay": lambda tmp: section_replay(args.device, tmp),
                "lora": lambda tmp: section_lora(args.device, args.quick, tmp),
                "deepspeed": lambda tmp: section_deepspeed(args.device, tmp)}
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in sections.items():
            if name in skip:
                continue
            start = time.perf_counter()
            try:
                new = run(tmp)
            except Exception as err:  # noqa: BLE001 - one broken section must not hide the others' results
                traceback.print_exc()
                new = [{"check": name, "ok": False, "detail": f"{type(err).__name__}: {str(err)[-1500:]}"}]
            for row in new:
                row["section"] = name
                print(f"# {'PASS' if row['ok'] else 'FAIL'} {row['check']}: {row['detail']}", flush=True)
            print(f"# section {name}: {time.perf_counter() - start:.0f} s", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            rows += new

    print()
    print(f"| check ({args.device}) | result | numbers |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {'pass' if row['ok'] else 'FAIL'} | {row['detail']} |")
    print()
    print(f"# {len(rows)} checks, {sum(not r['ok'] for r in rows)} failed, {time.perf_counter() - started:.0f} s")

    def pick(key, default=math.nan, combine=lambda found: found[-1]):
        found = [r[key] for r in rows if key in r]
        return combine(found) if found else default

    def status(check):
        found = [r for r in rows if r["check"] == check]
        return ("pass" if found[0]["ok"] else "fail") if found else "skip"

    failed = sum(not r["ok"] for r in rows)
    oracle_rows = [r for r in rows if r["section"] == "oracle"]
    oracle = "skip" if not oracle_rows else "pass" if all(r["ok"] for r in oracle_rows) else "fail"
    print(f"device={args.device} checks={len(rows)} failed={failed} search_tokens={pick('tokens', 0)} "
          f"speedup_vs_loop={pick('speedup'):.1f} floor_ratio={pick('floor_ratio'):.2f} "
          f"host_syncs={pick('host_syncs', -1)} step_time_ratio={pick('step_ratio', combine=max):.4f} "
          f"peak_memory_ratio={pick('memory_ratio', combine=max):.4f} "
          f"search_device_share={pick('search_device_share', combine=max):.5f} "
          f"adapt_host_share={pick('adapt_host_share', combine=max):.4f} "
          f"step_syncs={pick('step_syncs', -1, combine=sum)} "
          f"decoupled_step_ratio={pick('decoupled_ratio', combine=max):.4f} "
          f"length_fair_step_ratio={pick('length_fair_ratio'):.4f} "
          f"length_fair_own_ms={pick('length_fair_own_ms'):.2f} "
          f"balanced_own_ms={pick('balanced_own_ms'):.2f} "
          f"zero3={status('DeepSpeed ZeRO-3 launch of train_bapo.py')} "
          f"oracle={oracle} "
          f"replay={status('replay queue')} partial_rollout={status('partial rollout')} "
          f"lora_push={status('LoRA adapter push (server mode, stand-in server)')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
