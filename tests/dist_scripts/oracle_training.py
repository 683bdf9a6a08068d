"""Under `accelerate launch --num_processes 2` (any accelerate config): TRL as the oracle at world size 2. The same
config ``C`` (a JSON object, argv[3]) trains ``BAPOTrainer(BAPOConfig(**C))`` and then TRL's
``GRPOTrainer(GRPOConfig(**C))`` on-policy from the same weights and seed; each rank writes rank<N>.json with both
runs' logged losses and rewards, and rank 0 writes both runs' final weights (gathered under ZeRO-3) to
weights_<Trainer>.pt. argv: model_dir out_dir config_json."""

import json
import os
import sys

import torch
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward

model_dir, out_dir, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
record = {}
for cls, config_cls in ((BAPOTrainer, BAPOConfig), (GRPOTrainer, GRPOConfig)):
    args = config_cls(**{**dict(
        output_dir=os.path.join(out_dir, cls.__name__), use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=3, learning_rate=5e-3, logging_steps=1, seed=0, disable_tqdm=True),
        **settings})
    trainer = cls(model=model_dir, reward_funcs=reverse_reward, args=args,  # a path: ZeRO-3 partitions it at load
                  train_dataset=make_reverse_dataset(32, seed=0),
                  processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    history = trainer.state.log_history
    record[cls.__name__] = {"losses": [h["loss"] for h in history if "loss" in h],
                            "rewards": [h["reward"] for h in history if "reward" in h],
                            "rank": args.process_index, "world_size": args.world_size,
                            "distributed_type": str(trainer.accelerator.distributed_type)}
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # every rank: a collective under ZeRO-3
    if trainer.accelerator.is_main_process:
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()},
                   os.path.join(out_dir, f"weights_{cls.__name__}.pt"))
    del trainer, state
with open(os.path.join(out_dir, f"rank{record['BAPOTrainer']['rank']}.json"), "w") as f:
    json.dump(record, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
