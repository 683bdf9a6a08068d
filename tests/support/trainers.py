"""Trainers on the tiny model with the settings the trainer tests share, and a scripted stale micro-batch to compute a
loss on.

They run on the CPU in float32, as every CI run does. The GPU check (``benchmarks/gpu_check.py``) runs the oracle tests
on a GPU too: ``BAPO_TEST_DEVICE=cuda`` puts :func:`make_trainer`'s trainers there and ``BAPO_TEST_DTYPE=bfloat16``
loads their model in that dtype (the batches stay on the CPU in float32 until :func:`to_device`)."""

import os

import torch
from transformers import AutoModelForCausalLM

from support.harness import cpu_config, tiny_trainer

#: Where :func:`make_trainer` puts its trainers, and the dtype of their model (see the module's docstring).
DEVICE = os.environ.get("BAPO_TEST_DEVICE", "cpu")
DTYPE = getattr(torch, os.environ.get("BAPO_TEST_DTYPE", "float32"))
#: The config settings that put a trainer on :data:`DEVICE` (over the harness's CPU settings).
PLACEMENT = {} if DEVICE == "cpu" else dict(use_cpu=False)


def load_model(model_dir):
    """The model of ``model_dir`` in :data:`DTYPE`."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE)

COMMON = dict(
    save_strategy="no",
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    seed=0,
)


def make_trainer(cls, config_cls, model_dir, tmp_path, **overrides):
    args = cpu_config(tmp_path, config_cls=config_cls, **{**COMMON, **PLACEMENT, **overrides})
    model = load_model(model_dir)
    model.train()  # compute_loss reads train/eval mode; the training loop would set it
    trainer = tiny_trainer(model_dir, args, cls=cls, model=model, prompts=32, prompt_seed=0)
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by the training loop
    return trainer


def stale_batch(trainer, seed=0, noise=0.7, adv_shift=-0.2):
    """A scripted micro-batch: real completions from the model, behaviour log-probs perturbed to be stale (on the CPU,
    in float32)."""
    device = trainer.model.device
    gen = torch.Generator().manual_seed(seed)
    tok = trainer.processing_class
    prompts = tok(["123>", "456>", "789>", "012>"], return_tensors="pt", padding=True)
    completions = torch.randint(3, len(tok), (4, 6), generator=gen)
    completion_mask = torch.ones(4, 6)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    with torch.no_grad():
        ids = torch.cat([prompts.input_ids, completions], 1)
        attention_mask = torch.cat([prompts.attention_mask, completion_mask.long()], 1)
        logits = trainer.model(ids.to(device), attention_mask=attention_mask.to(device)).logits
        logps = torch.log_softmax(logits[:, prompts.input_ids.size(1) - 1 : -1], -1)
        logps = logps.gather(-1, completions.to(device)[..., None]).squeeze(-1).float().cpu()
    return {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": completions,
        "completion_mask": completion_mask,
        "old_per_token_logps": logps + noise * torch.randn(4, 6, generator=gen),
        "advantages": torch.tensor([1.0, -1.5, 0.5, -0.8]) + adv_shift,
        "num_items_in_batch": completion_mask.sum(),
    }


def to_device(batch: dict, trainer) -> dict:
    """``batch`` with its tensors on ``trainer``'s model's device (a copy; where the trainer runs on the CPU, the same
    tensors)."""
    device = trainer.model.device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
