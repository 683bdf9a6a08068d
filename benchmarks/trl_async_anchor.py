"""TRL's own ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) on this project's CPU machines, against ``bapo
serve``'s vLLM CPU server: the anchor beside which BAPO's async generation is measured (issue 76). A TRL user who goes
async reaches for it first; it drops samples older than ``max_staleness`` weight versions and clips with a fixed
window.

    python benchmarks/trl_async_anchor.py --quick            # starts a server, trains 8 steps, prints the log
    python benchmarks/trl_async_anchor.py --steps 160 --max-staleness 4 --out runs/anchor

Everything it needs on a CPU machine is :data:`GLUE` below: one patch per TRL line it works around, each checked
against TRL's source before it is applied (a TRL that changed the line fails here, naming it, instead of training
something else). Its weight sync is the package's :class:`bapo_trl.generation.disk_transfer.DiskWeightTransfer`
(TRL's default is NCCL, which needs CUDA).

The task is the embedded reversal task as one-turn chats rendered to the bare prompt (:data:`BARE_CHAT_TEMPLATE`: the
same token ids BAPO trains on), scored by the task's own reward; the model, its tokenizer and the server are the ones
BAPO's async generation uses.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


# -- the CPU glue -----------------------------------------------------------------------------------------------------

def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                     causal=True, window_size=(-1, -1), softcap=None, **_):
    """flash-attention's ``flash_attn_varlen_func`` on the CPU, as ONE SDPA call over the packed segments with a block
    mask: ``query`` ``(total_q, heads, d)``, ``key``/``value`` ``(total_k, kv_heads, d)``; a query sees the keys of its
    own segment only, causal aligned to the bottom right (the segment's last query sees its whole key range), as
    flash-attention aligns it when ``q`` is shorter than ``k``. (A Python loop over segments made TRL's step 10x
    slower than its kernel would: the anchor must not handicap the trainer it anchors.)"""
    if softcap or tuple(window_size) != (-1, -1):
        raise NotImplementedError("the CPU tree attention has no softcap or sliding window")
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    lengths_q, lengths_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    segment_q = torch.repeat_interleave(torch.arange(len(lengths_q)), lengths_q)
    segment_k = torch.repeat_interleave(torch.arange(len(lengths_k)), lengths_k)
    position_q = torch.arange(len(segment_q)) - cu_q[segment_q]  # within the segment
    position_k = torch.arange(len(segment_k)) - cu_k[segment_k]
    mask = segment_q[:, None] == segment_k[None, :]
    if causal:
        offset = (lengths_k - lengths_q)[segment_q]  # bottom-right alignment
        mask &= position_k[None, :] <= (position_q + offset)[:, None]
    groups = query.size(1) // key.size(1)
    q = query.transpose(0, 1)
    k = key.transpose(0, 1).repeat_interleave(groups, 0)
    v = value.transpose(0, 1).repeat_interleave(groups, 0)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    return out.transpose(0, 1)


class CPUFlashAttention:
    """What ``packing._flash_attn()`` returns on CUDA (a Hub kernel), for the CPU."""

    flash_attn_varlen_func = staticmethod(varlen_attention)


@dataclass(frozen=True)
class Patch:
    """One CPU workaround: the TRL function whose source must hold ``line`` (else TRL changed and the patch may be
    wrong or useless: an error naming both), and what replaces what."""

    name: str
    where: str  # "module:attribute" whose source holds the line
    line: str
    apply: Callable[[], None]

    def check(self) -> None:
        import importlib

        module, _, attribute = self.where.partition(":")
        target = importlib.import_module(module)
        for part in filter(None, attribute.split(".")):
            target = getattr(target, part)
        if self.line not in inspect.getsource(target):
            raise RuntimeError(f"CPU glue {self.name!r}: {self.where} no longer contains {self.line!r}; TRL changed "
                               "there, so this workaround must be looked at again (benchmarks/trl_async_anchor.py).")


def _no_cuda_device_name() -> None:
    if not torch.cuda.is_available():
        torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"


def _rollout_worker_without_vllm() -> None:
    from trl.experimental.async_grpo import async_rollout_worker

    async_rollout_worker.is_vllm_available = lambda *args, **kwargs: True


def _cpu_tree_attention() -> None:
    from trl.experimental.async_grpo import packing

    packing._flash_attn = lambda: CPUFlashAttention


#: Each CPU workaround with the TRL line it works around (TRL 1.16).
GLUE = (
    Patch("FLOPs estimate asks CUDA for the device name", "trl.trainer.utils", "torch.cuda.get_device_name",
          _no_cuda_device_name),
    Patch("the rollout worker refuses to start without vllm importable (it only speaks HTTP, over aiohttp)",
          "trl.experimental.async_grpo.async_rollout_worker:AsyncRolloutWorker.__init__",
          "if not is_vllm_available():", _rollout_worker_without_vllm),
    Patch("tree packing's attention loads a CUDA flash-attention kernel from the Hub",
          "trl.experimental.async_grpo.packing:tree_attention", "_flash_attn().flash_attn_varlen_func",
          _cpu_tree_attention),
)


def apply_glue() -> None:
    for patch in GLUE:
        patch.check()
    for patch in GLUE:
        patch.apply()


#: The async trainer renders every prompt through the chat template: this one renders a user turn as its bare text, so
#: the token ids are exactly the plain prompts BAPO's runs train on ("123>"), which the tiny model was warm-started on.
BARE_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
#: The worker wants a ``response_template`` on the tokenizer (else it calls TRL's ``add_response_schema``, made for
#: known chat templates). transformers refuses this one at every parse (it has no ``start_anchor``), and TRL's
#: ``parse_response`` then decodes the ids with ``skip_special_tokens=True``: the same text TRL's synchronous trainer
#: scores, and the reward checks the EOS on the ids anyway. Kept as the study's runs used it (a valid template gives
#: the same text on the answers tried).
BARE_RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"},
                          "fields": {"content": {"close_pattern": r"(<eos>)\s*", "content": "text"}}}


def chat_reversal(count: int, seed: int, digits: tuple[int, int] = (3, 3)):
    """The embedded reversal task's prompts as one user turn each (the async trainer renders chats only)."""
    from datasets import Dataset

    from bapo_trl.recipes.toy import make_reverse_dataset

    rows = make_reverse_dataset(count, seed=seed, digits=digits)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]}
                              for row in rows])


def async_trainer(model_dir: str, url: str, out: Path, steps: int, max_staleness: int, seed: int, batch: int,
                  generations: int, length: int, learning_rate: float, epsilon: float, epsilon_high: float | None,
                  digits: tuple[int, int] = (3, 3), callbacks: list | None = None, token_budget: int | None = None,
                  reward_func: Callable | None = None):
    """One AsyncGRPOTrainer, built as its users build it (the glue applied first): TRL's defaults but for what the
    study fixes for every trainer (batch, generations, length, learning rate, constant schedule, the window).
    ``token_budget``: TRL's default (None) packs each step's row up to the server's ``max_model_len`` tokens (15-16
    samples of the tiny model's task); 0 trains exactly ``batch`` samples a step, as the other trainers do.
    ``reward_func``: the task's reward (default), or one that wraps it (it is pickled to the rollout worker's process).
    One torch thread, as BAPO's runs beside a server take (the server holds the other core)."""
    torch.set_num_threads(1)
    apply_glue()
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from bapo_trl.generation.disk_transfer import DiskWeightTransfer
    from bapo_trl.recipes.toy import reverse_reward  # the same reward as BAPO's runs (EOS checked on the ids)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template, tokenizer.response_template = BARE_CHAT_TEMPLATE, BARE_RESPONSE_TEMPLATE
    args = AsyncGRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, num_generations=generations,
        max_completion_length=length, learning_rate=learning_rate, temperature=1.0, epsilon=epsilon,
        epsilon_high=epsilon_high, max_staleness=max_staleness, vllm_server_base_url=url, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, seed=seed, save_strategy="no", disable_tqdm=True,
        lr_scheduler_type="constant", token_budget=token_budget)
    return AsyncGRPOTrainer(model=model_dir, reward_funcs=reward_func or reverse_reward, args=args,
                            train_dataset=chat_reversal(4096, seed, digits), processing_class=tokenizer,
                            weight_transfer=DiskWeightTransfer(url, timeout=120), callbacks=callbacks)


class StalenessAudit:
    """The staleness TRL's async trainer checks beside the staleness it trains: per sample kept, the policy version
    when its staleness was checked (``RolloutQueueDataset.__iter__``) and the version that generated it; per step, the
    version that trains it (``training_step``). Batch k is kept samples ``[b k, b (k + 1))`` (the fixed-count batcher
    keeps their order). ``install()`` wraps the two TRL methods (each checked against TRL's source first), before
    the trainer is built, for the rest of the process. It holds for the anchor's runs only: one process, fixed-count
    batches (``token_budget=0``), one micro-batch a step."""

    CHECKS = (Patch("the staleness check records each kept sample's staleness",
                    "trl.experimental.async_grpo.async_grpo_trainer:RolloutQueueDataset.__iter__",
                    'self.metrics["sample/staleness_max"].append(float(staleness))', lambda: None),
              Patch("a weight sync makes the next policy version",
                    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer",
                    "self.model_version += 1", lambda: None))

    def __init__(self):
        self.kept: list[tuple[int, int]] = []  # (version at the check, version that generated the sample)
        self.trained: list[int] = []  # the trainer's version at each training step

    def install(self) -> "StalenessAudit":
        from trl.experimental.async_grpo import async_grpo_trainer as module

        for check in self.CHECKS:
            check.check()
        audit, iterate, step = self, module.RolloutQueueDataset.__iter__, module.AsyncGRPOTrainer.training_step

        def audited_iter(dataset):
            for item in iterate(dataset):
                version = dataset.model_version_fn()
                audit.kept.append((version, version - int(dataset.metrics["sample/staleness_max"][-1])))
                yield item

        def audited_step(trainer, *args, **kwargs):
            audit.trained.append(trainer.model_version)
            return step(trainer, *args, **kwargs)

        module.RolloutQueueDataset.__iter__ = audited_iter
        module.AsyncGRPOTrainer.training_step = audited_step
        return self

    def per_step(self, batch: int) -> list[tuple[int, int]]:
        """``(largest staleness checked, largest staleness trained)`` of every step."""
        rows = []
        for k, version in enumerate(self.trained):
            kept = self.kept[k * batch: (k + 1) * batch]
            rows.append((max(v - g for v, g in kept), version - min(g for _, g in kept)))
        return rows


def train(model_dir: str, url: str, out: Path, steps: int, max_staleness: int, seed: int, batch: int,
          generations: int, length: int, learning_rate: float, epsilon: float, epsilon_high: float | None):
    """One AsyncGRPOTrainer run of ``batch`` samples a step (``token_budget=0``, as the study runs it); returns the
    trainer (its ``state.log_history``) and its :class:`StalenessAudit`."""
    apply_glue()
    audit = StalenessAudit().install()
    trainer = async_trainer(model_dir, url, out, steps, max_staleness, seed, batch, generations, length,
                            learning_rate, epsilon, epsilon_high, token_budget=0)
    trainer.train()
    return trainer, audit


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps, then print the log (CI's slow tier)")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--max-staleness", type=int, default=4, help="TRL's default: 4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--epsilon-high", type=float, default=None)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "trl-async-anchor")
    parser.add_argument("--json", type=Path, default=None, help="also write the printed summary here")
    args = parser.parse_args(argv)
    from bapo_trl.recipes.toy import build_tiny_model

    model_dir = build_tiny_model()
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.url is None:
        from server_bench import Server

        server = Server(model_dir, args.out / "server.log", core=0)
    steps = 8 if args.quick else args.steps
    try:
        start = time.perf_counter()
        trainer, audit = train(model_dir, args.url or server.url, args.out / "run", steps, args.max_staleness,
                               args.seed, args.batch, args.generations, args.length, args.learning_rate, args.epsilon,
                               args.epsilon_high)
        seconds = time.perf_counter() - start
    finally:
        if server is not None:
            server.stop()
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    summary = {"steps": trainer.state.global_step, "seconds": round(seconds, 1), "rewards": rewards,
               "staleness": audit.per_step(args.batch), "log": [h for h in history if "loss" in h]}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(dict(summary, command=["trl_async_anchor.py", *(argv or sys.argv[1:])],
                                             trl=_version("trl"))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
