"""The embedded default: a tiny character-level model and a 3-digit reversal task, built offline on CPU (and, for
the studies, a variable-length variant: ``digits=(2, 5)``, its own warm-started model).

Used by ``train_bapo.py`` with no arguments, by the tests, the notebooks, and the vLLM CPU server. Why it is
shaped like this (measured, see the project's CPU testing notes):

* character-level tokenizer, Llama architecture (a qwen2 config makes AutoTokenizer reload it as a Qwen2
  tokenizer that drops spaces); head size 32 (vLLM's CPU backend rejects 16); untied embeddings;
* a short supervised warm start teaches the answer format, and half of its targets ramble on after the answer.
  Wrong answers are then longer than right ones, as wrong chains of thought are in real LLMs, so
  negative-advantage tokens dominate the loss and BAPO's bounds actually move.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import torch

from ..cache import default_cache_dir
from .task import (  # noqa: F401
    DIGITS,
    EOS,
    is_test_prompt,
    make_reverse_dataset,
    reverse_reward,
    reverse_target,
    sample_prompt,
    split_prompts,
)
from .tokenizer import build_tokenizer  # noqa: F401

#: Bump when the model, tokenizer or warm start change, so stale caches are not reused.
TOY_VERSION = "v1"
MARKER = "BAPO_TOY_COMPLETE"


def model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: accepted by vLLM's CPU attention
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype="float32",
    )


def warm_start(model, tokenizer, steps: int = 80, seed: int = 0, ramble_prob: float = 0.5, lr: float = 5e-3,
               digits=DIGITS):
    """Supervised warm start on ``"123>" -> "321<eos>"``; with probability ``ramble_prob`` the target rambles on
    (random characters) after the answer before EOS, which the reward counts as wrong. ``digits``: the task's digit
    range (training prompts drawn as :func:`make_reverse_dataset` draws them)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch_ids, batch_labels = [], []
        for _ in range(64):
            prompt = sample_prompt(rng, "train", digits)
            target = reverse_target(prompt)
            if rng.random() < ramble_prob:
                target += "".join(rng.choice("abcdefghij0123456789 ") for _ in range(rng.randint(2, 6)))
            p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            t_ids = tokenizer(target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            batch_ids.append(p_ids + t_ids)
            batch_labels.append([-100] * len(p_ids) + t_ids)
        width = max(map(len, batch_ids))
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in batch_ids])
        labels = torch.tensor([x + [-100] * (width - len(x)) for x in batch_labels])
        attention = (labels != -100) | (torch.arange(width)[None] < torch.tensor([len(x) for x in batch_ids])[:, None])
        loss = model(input_ids=ids, attention_mask=attention.long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


def build_tiny_model(output_dir: str | None = None, seed: int = 0, warm_start_steps: int = 80,
                     force: bool = False, digits=DIGITS, warm_start_lr: float = 5e-3) -> str:
    """Build (or reuse from the cache) the warm-started tiny model + tokenizer; returns the directory. ``digits``:
    the task it is warm-started on (default the 3-digit task), ``warm_start_lr`` its learning rate; other values
    than the defaults cache under their own directory.

    Written to a temporary directory and renamed into place, so concurrent processes (accelerate ranks) never
    load a half-written model; a marker file says the directory is complete.
    """
    from transformers import LlamaForCausalLM

    if output_dir is None:
        task = "" if tuple(digits) == DIGITS else f"-digits{digits[0]}-{digits[1]}"
        task += "" if warm_start_lr == 5e-3 else f"-lr{warm_start_lr:g}"
        output_dir = os.path.join(default_cache_dir(),
                                  f"tiny-reverse-{TOY_VERSION}-seed{seed}-ws{warm_start_steps}{task}")
    if os.path.exists(os.path.join(output_dir, MARKER)) and not force:
        return output_dir
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(tokenizer))
    if warm_start_steps:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # several times faster than 2 threads for a model this small
        try:
            warm_start(model, tokenizer, steps=warm_start_steps, seed=seed, digits=digits, lr=warm_start_lr)
        finally:
            torch.set_num_threads(threads)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=parent)
    # Every rank of a launch may build it, but under an initialised process group transformers' save_pretrained
    # writes weights and config on rank 0 only: a rank that won the rename race left a directory without them.
    from safetensors.torch import save_model

    model.config.architectures = [type(model).__name__]  # what save_pretrained would record
    model.config.save_pretrained(staging)
    save_model(model, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if
               not os.path.exists(os.path.join(staging, f))]
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"building the tiny model wrote no {missing} in {staging}")
    open(os.path.join(staging, MARKER), "w").close()
    if os.path.exists(output_dir):
        if os.path.exists(os.path.join(output_dir, MARKER)) and not force:
            shutil.rmtree(staging)  # another process finished first
            return output_dir
        shutil.rmtree(output_dir, ignore_errors=True)
    try:
        os.replace(staging, output_dir)
    except OSError:  # lost a race with another process that renamed first
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


@torch.no_grad()
def score_completions(model, tokenizer, dataset, max_new_tokens: int = 10, batch_size: int = 64,
                      **sampling) -> list[float]:
    """The task's reward of the model's completion of each row of a dataset with ``prompt``/``answer`` columns, in
    row order: greedy unless ``sampling`` says otherwise (``do_sample=True, temperature=1.0, top_k=0`` samples as
    training does, from torch's global generator). Completions are cut at their first EOS, as a trainer's are."""
    model.eval()
    sampling = sampling or {"do_sample": False}
    scores: list[float] = []
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [p if isinstance(p, str)
                 else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completion_ids = [row[enc.input_ids.size(1):].tolist() for row in out]
        eos = tokenizer.eos_token_id  # generate pads finished rows: keep each completion up to its first EOS
        completion_ids = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in completion_ids]
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        scores += reverse_reward(completions, answers[start : start + batch_size], completion_ids=completion_ids)
    return scores


def evaluate_accuracy(model, tokenizer, dataset, max_new_tokens: int = 10, batch_size: int = 64) -> float:
    """Greedy exact-match accuracy (answer followed by EOS) on a dataset with ``prompt``/``answer`` columns."""
    scores = score_completions(model, tokenizer, dataset, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return sum(scores) / max(len(scores), 1)
