"""Rank 1 alone builds the embedded model under an initialised process group (as an accelerate launch does when
rank 1 wins the build race); rank 0 then loads it. Writes rank<N>.json with what each rank saw."""

import json
import os
import sys

import torch.distributed as dist
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.recipes.toy import build_tiny_model

out_dir = sys.argv[1]
state = PartialState(cpu=True)  # initialises the process group, as TrainingArguments does before train_bapo.py builds
model_dir = os.path.join(out_dir, "tiny")
if state.process_index == 1:
    build_tiny_model(model_dir, warm_start_steps=2)
dist.barrier()
model = AutoModelForCausalLM.from_pretrained(model_dir)
with open(os.path.join(out_dir, f"rank{state.process_index}.json"), "w") as f:
    json.dump({"files": sorted(os.listdir(model_dir)), "parameters": sum(p.numel() for p in model.parameters()),
               "initialized": dist.is_initialized()}, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
