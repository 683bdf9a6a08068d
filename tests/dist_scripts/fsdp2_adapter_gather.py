"""Run under `accelerate launch` on 2 CPU processes (gloo): a peft LoRA model sharded with FSDP2 (torch's
`fully_shard` on a CPU mesh: accelerate turns an FSDP config into DDP on CPU, so the sharding is done here, as
accelerate does on GPUs), then the adapter push's gathers, `_gathered_adapter` and `_gather_base`, run on the
STAND-IN of a backend (BAPOVLLMGeneration without a server: the model, the accelerator and TRL's
DistributedBackend with fsdp_version 2, the only parts those gathers use). Rank 0 writes whether what they gathered
equals the unsharded model's adapter (peft's saved names) and base weights. argv: model_dir out_dir."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from trl.distributed import DistributedBackend

from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration

model_dir, out_dir = sys.argv[1], sys.argv[2]
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                       LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"]))
for name, param in model.named_parameters():
    if "lora_B" in name or "lora_embedding_A" in name:
        param.data.normal_(0, 0.3)
adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}
base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v.detach().clone()
        for k, v in model.named_parameters() if "lora_" not in k}

mesh = init_device_mesh("cpu", (accelerator.num_processes,))
for layer in model.base_model.model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
sharded = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())

backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)  # the stand-in (see the module doc)
backend.model, backend.accelerator = model, accelerator
backend._dist = DistributedBackend(accelerator)
backend._dist.fsdp_version = 2
gathered = backend._gathered_adapter()
gathered_base = backend._gather_base()
if accelerator.is_main_process:
    result = {
        "world_size": accelerator.num_processes, "sharded_parameters": sharded,
        "adapter_names_equal": sorted(gathered) == sorted(adapter),
        "adapter_equal": sorted(gathered) == sorted(adapter) and all(torch.equal(gathered[k], adapter[k])
                                                                     for k in adapter),
        "embedding_tensors": sum("lora_embedding" in k for k in gathered),
        "base_equal": sorted(gathered_base) == sorted(base) and all(torch.equal(gathered_base[k], base[k])
                                                                    for k in base),
        "all_plain": all(type(t) is torch.Tensor for t in [*gathered.values(), *gathered_base.values()]),
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
else:
    assert gathered == {} and gathered_base == {}
accelerator.wait_for_everyone()
