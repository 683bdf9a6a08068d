"""What a launch really did: world size, distributed type, ZeRO stage, whether ZeRO-3 partitioned the weights.

Several launch mistakes pass silently (two independent world-size-1 runs instead of one DDP run, FSDP quietly
becoming DDP on CPU, ZeRO-3 not partitioning). ``train_bapo.py`` writes this record per rank to
``<output_dir>/launch_info/rank<N>.json``, so a user (and the tests) can check; the console keeps the progress bar
(the saved listing at the end names the folder).
"""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback


def describe_launch(accelerator, model) -> dict:
    state = accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    info = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "local_rank": accelerator.local_process_index,
        # torchrun's node index (accelerate's --machine_rank) and processes on this node; None outside torchrun
        "machine_rank": int(os.environ["GROUP_RANK"]) if "GROUP_RANK" in os.environ else None,
        "processes_on_machine": int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": str(accelerator.device),
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "backend": getattr(state, "backend", None),
    }
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    info["num_parameters"] = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    info["ds_partitioned_parameters"] = len(partitioned)
    if partitioned:
        info["local_shard_numel"] = sum(p.ds_tensor.numel() for p in partitioned)
        info["full_numel"] = sum(p.ds_numel for p in partitioned)
    info["trainable_parameters"] = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    return info


def launch_errors(training_args, environ=os.environ, cuda_available: bool | None = None) -> list[str]:
    """Launch mistakes that would otherwise end in a wall of per-rank tracebacks, told as what to pass instead.

    Read from the variables ``accelerate launch`` exports (``ACCELERATE_*``) before any model or process group is
    built. Checked: a DeepSpeed config asking for bf16/fp16 mixed precision while the trainer runs without
    ``--bf16``/``--fp16`` (DeepSpeed's "config values mismatch" on every rank; on a CPU-only machine, where the
    embedded job runs in fp32, the fix is ``--mixed_precision no``).
    """
    errors = []
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no")
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and precision in ("bf16", "fp16") and not getattr(training_args, precision, False):
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        fix = ("add `--mixed_precision no` to `accelerate launch` (before train_bapo.py; without CUDA it trains in "
               "float32 on the CPU)"
               if not cuda_available else
               f"pass `--{precision} True` to train_bapo.py, or `--mixed_precision no` to `accelerate launch`")
        errors.append(
            f"the accelerate config asks DeepSpeed for mixed_precision {precision} but train_bapo.py runs without "
            f"`--{precision}`{' (a machine without CUDA)' if not cuda_available else ''}: {fix}."
        )
    return errors


class LaunchInfoCallback(TrainerCallback):
    """Writes :func:`describe_launch` for every rank when training starts."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
        info = describe_launch(trainer.accelerator, getattr(model, "module", model))
        folder = os.path.join(args.output_dir, "launch_info")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{info['rank']}.json"), "w") as f:
            json.dump(info, f, indent=1)
