"""Trainers on the tiny model with the settings the trainer tests share, and a scripted stale micro-batch to compute a
loss on."""

import torch
from transformers import AutoModelForCausalLM

from support.harness import cpu_config, tiny_trainer

COMMON = dict(
    save_strategy="no",
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    seed=0,
)


def make_trainer(cls, config_cls, model_dir, tmp_path, **overrides):
    args = cpu_config(tmp_path, config_cls=config_cls, **{**COMMON, **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()  # compute_loss reads train/eval mode; the training loop would set it
    trainer = tiny_trainer(model_dir, args, cls=cls, model=model, prompts=32, prompt_seed=0)
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by the training loop
    return trainer


def stale_batch(trainer, seed=0, noise=0.7, adv_shift=-0.2):
    """A scripted micro-batch: real completions from the model, behaviour log-probs perturbed to be stale."""
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
        logits = trainer.model(ids, attention_mask=attention_mask).logits
        logps = torch.log_softmax(logits[:, prompts.input_ids.size(1) - 1 : -1], -1)
        logps = logps.gather(-1, completions[..., None]).squeeze(-1)
    return {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": completions,
        "completion_mask": completion_mask,
        "old_per_token_logps": logps + noise * torch.randn(4, 6, generator=gen),
        "advantages": torch.tensor([1.0, -1.5, 0.5, -0.8]) + adv_shift,
        "num_items_in_batch": completion_mask.sum(),
    }
