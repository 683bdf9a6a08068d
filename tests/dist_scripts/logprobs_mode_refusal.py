"""Under `accelerate launch --num_processes 2`: build a BAPOTrainer with async generation against the servers named in
argv (comma-separated) and record, on every rank, what construction raised (or that it built). A server whose
``--logprobs-mode`` is not ``processed_logprobs`` must stop every rank at start-up, none waiting forever for the main
process. argv: model_dir server_urls out_dir."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, server_urls, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=4, use_vllm=True,
                  vllm_mode="server", vllm_server_base_url=server_urls, vllm_server_timeout=30,
                  async_generation=True)
record = {"rank": args.process_index, "world_size": args.world_size, "error": None, "message": None}
try:
    BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward, args=args,
                train_dataset=make_reverse_dataset(16, seed=0),
                processing_class=AutoTokenizer.from_pretrained(model_dir))
except Exception as exc:  # noqa: BLE001 - recorded for the test
    record.update(error=type(exc).__name__, message=str(exc))
with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as f:
    json.dump(record, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
