"""Under `accelerate launch --num_processes 2`: BAPOTrainer.compute_loss on different data per rank; on some
micro-batches rank 1 has NO real token (all masked). Both ranks must join every collective (no deadlock) and
install the same window. argv: model_dir out_dir."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=6)
model = AutoModelForCausalLM.from_pretrained(model_dir)
tok = AutoTokenizer.from_pretrained(model_dir)
trainer = BAPOTrainer(model=model, reward_funcs=reverse_reward, args=args, train_dataset=make_reverse_dataset(8),
                      processing_class=tok)
trainer.model.train()
trainer.current_gradient_accumulation_steps = 1
rank = trainer.accelerator.process_index
records = []
for case in range(8):
    gen = torch.Generator().manual_seed(100 * case + rank)
    prompts = tok(["123>", "456>", "78>", "9>"], return_tensors="pt", padding=True)
    mask = torch.ones(4, 6, dtype=torch.long)
    empty = rank == 1 and case % 3 == 1
    if empty:
        mask.zero_()
    inputs = {
        "prompt_ids": prompts.input_ids, "prompt_mask": prompts.attention_mask,
        "completion_ids": torch.randint(6, len(tok), (4, 6), generator=gen), "completion_mask": mask,
        "old_per_token_logps": -2.5 + torch.randn(4, 6, generator=gen) * (1.0 + rank),
        "advantages": torch.randn(4, generator=gen) - 0.5 * rank,
        "num_items_in_batch": mask.sum().float() * 2,
    }
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    chosen = trainer.last_search.as_floats()
    records.append({"case": case, "empty": empty, "loss": float(loss), "clip_low": chosen["clip_low"],
                    "clip_high": chosen["clip_high"], "steps": chosen["steps"]})
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"world_size": trainer.accelerator.num_processes, "records": records}, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
