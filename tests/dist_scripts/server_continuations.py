"""Under `accelerate launch --num_processes 2`, with a vLLM server: partial rollout's continuation calls when the ranks
want DIFFERENT things. One server request serves both ranks, so its max_tokens and TRL's equal per-rank slices must
be agreed on; each rank must still get one continuation per prefix (its own: the trainer's log-probs after that
prefix match the server's), cut to its own cap. Rounds alternate which rank
is the "idle" one (one prefix, cap 1, as an empty partial-rollout round makes). argv: model_dir server_url out_dir.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, server_url, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
host, port = server_url.removeprefix("http://").split(":")
args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
                  partial_rollout_budget=3, use_vllm=True, vllm_mode="server", vllm_server_host=host,
                  vllm_server_port=int(port), vllm_server_timeout=30)
tok = AutoTokenizer.from_pretrained(model_dir)
dataset = make_reverse_dataset(16, seed=0)
trainer = BAPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reverse_reward, args=args,
                      train_dataset=dataset, processing_class=tok)
rank = trainer.accelerator.process_index
prompts, _, _ = trainer._tokenize_prompts([row["prompt"] for row in dataset])
records = []
for round_index in range(4):
    idle = round_index % 2  # the rank with one prefix and a cap of 1
    count, cap = (1, 1) if rank == idle else (6, 8)
    prefixes = prompts[rank * 6 : rank * 6 + count]
    completions, logprobs = trainer.port.continue_completions(prefixes, cap)
    # the trainer's log-probs of each answer AFTER THIS RANK'S OWN prefix: another prefix's answer would be far off
    own = trainer.rollout_source.segment_logps(prefixes, completions)
    gap = max(abs(a - b) for row, ref in zip(logprobs, own) for a, b in zip(row, ref) if a is not None)
    records.append({"count": count, "cap": cap, "lengths": [len(c) for c in completions],
                    "logprob_lengths": [len(x) for x in logprobs], "gap_to_own_prefix": gap})
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world_size": trainer.accelerator.num_processes, "records": records}, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
