"""Under `accelerate launch --num_processes 2` with DeepSpeed ZeRO-3: TRL's weight push (the path CUDA takes, NCCL to
the server) failing on the main process part-way must raise on every rank, none left waiting in a weight gather.

The push goes through ``BAPOVLLMGeneration.sync_weights``'s TRL branch with a STAND-IN client on the main process (no
NCCL, no server here): it takes ``stop_after`` weights of TRL's walk, then raises ``ConnectionError`` as TRL's client
does when the server is gone; ``reset_fails`` makes the prefix-cache reset after the walk fail instead. The weights are
the trainer's own, partitioned by ZeRO-3 (each gather is a collective). Last, colocate mode with vLLM's sleep mode
(a STAND-IN engine): rank 1's engine fails to wake up, before TRL's walk begins there; then the disk path's restart
check before TRL's generate failing on the main process, the CPU colocate reload failing on rank 1, and the disk
push's gather whose copy fails on the main process; last, TRL's generate whose request fails on the main process.
Each rank writes rank<N>.json:
per case, the error it raised and how many weights it walked. argv: model_dir out_dir."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.*

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.distributed import DistributedBackend  # noqa: E402

from bapo_trl import BAPOConfig, BAPOTrainer  # noqa: E402
from bapo_trl.cli.train import exit_past_gloo_teardown  # noqa: E402
from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration  # noqa: E402
from bapo_trl.generation.weight_sync import WeightSyncError  # noqa: E402
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward  # noqa: E402
from support.trl_stand_ins import StandInClient, StandInEngine  # noqa: E402

model_dir, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
args = BAPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
trainer = BAPOTrainer(model=model_dir, reward_funcs=reverse_reward, args=args,
                      train_dataset=make_reverse_dataset(16, seed=0),
                      processing_class=AutoTokenizer.from_pretrained(model_dir))
accelerator = trainer.accelerator


BAPOVLLMGeneration.uses_disk_sync = property(lambda self: False)  # CUDA's branch: TRL's push
BAPOVLLMGeneration.uses_colocate_reload = property(lambda self: False)  # CUDA's colocate branch too
backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
backend.mode, backend.enable_sleep_mode, backend.lora_sync = "server", False, "merged"
backend.accelerator, backend.model, backend._weight_metadata = accelerator, trainer.model, None
backend._dist = DistributedBackend(accelerator)

walked = {"count": 0}
walk = BAPOVLLMGeneration._walk_named_params


class HostMemoryExhausted:
    """A weight whose copy to the CPU fails (STAND-IN for the host running out of memory)."""

    def detach(self):
        raise RuntimeError("host memory exhausted (stand-in)")


def counted(self):  # every weight this rank's walk yielded (the metadata walk of the first push included)
    for item in walk(self):
        walked["count"] += 1
        failing = walked.get("copy fails at") == walked["count"] and accelerator.is_main_process
        yield (item[0], HostMemoryExhausted()) if failing else item


BAPOVLLMGeneration._walk_named_params = counted


def attempt(call) -> str | None:
    """``call()``'s error as the test reads it (``"Type: message"``), or None."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return f"{type(exc).__name__}: {exc}"
    return None

record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
          "zero3": bool(getattr(next(trainer.model.parameters()), "ds_numel", 0)), "cases": {}}
for case, client in (("push fails at once", StandInClient(stop_after=0)),
                     ("push fails part-way", StandInClient(stop_after=5)),
                     ("prefix-cache reset fails", StandInClient(reset_fails=True)),
                     ("push succeeds", StandInClient())):
    backend.vllm_client = client if accelerator.is_main_process else None  # TRL builds the client there only
    walked["count"] = 0
    error = attempt(backend.sync_weights)
    record["cases"][case] = {"error": error, "walked": walked["count"],
                             "received": client.received if accelerator.is_main_process else None}
accelerator.wait_for_everyone()  # every rank is past every case
# colocate with vLLM's sleep mode: rank 1's engine fails to wake up, before TRL's walk begins there
backend.mode, backend.enable_sleep_mode = "colocate", True
backend.llm = StandInEngine(wake_fails=accelerator.process_index == 1)
walked["count"] = 0
error = attempt(backend.sync_weights)
record["cases"]["colocate wake-up fails on rank 1"] = {"error": error, "walked": walked["count"],
                                                      "received": backend.llm.loaded}
accelerator.wait_for_everyone()


class UnreachableSync:
    """The main process's disk push client (STAND-IN) when the server cannot be reached for the restart check."""

    def reload_if_restarted(self):
        raise WeightSyncError("the vLLM server is gone (stand-in)")


# the restart check before TRL's generate (disk path): its error on the main process is raised on every process
BAPOVLLMGeneration.uses_disk_sync = property(lambda self: True)
backend.mode = "server"
backend.disk_sync = UnreachableSync() if accelerator.is_main_process else None
error = attempt(lambda: backend._reload_restarted_servers(everywhere=True))
record["cases"]["restart check fails on the main process"] = {"error": error}
accelerator.wait_for_everyone()
# colocate on CPU (the engine reloads a directory): rank 1's engine fails to reload, after both walked every weight
BAPOVLLMGeneration.uses_colocate_reload = property(lambda self: True)
backend.mode, backend._pushes = "colocate", []
backend.llm = StandInEngine(reload_fails=accelerator.process_index == 1)
walked["count"] = 0
error = attempt(backend.sync_weights)
record["cases"]["colocate reload fails on rank 1"] = {"error": error, "walked": walked["count"]}
BAPOVLLMGeneration.uses_colocate_reload = property(lambda self: False)
backend.mode = "server"
accelerator.wait_for_everyone()
# the disk push's gather: the main process's copy of the third weight fails; every rank still walks every weight
walked.update(count=0, **{"copy fails at": 3})
error = attempt(backend.gather_state)
record["cases"]["disk gather fails on the main process"] = {"error": error, "walked": walked["count"]}
accelerator.wait_for_everyone()
# TRL's generate (server mode): the main process's request fails (the server gone during it); TRL broadcasts the
# answer from there, so the other rank waited in the broadcast
BAPOVLLMGeneration.uses_disk_sync = property(lambda self: False)
backend.disk_sync = None
backend.temperature, backend.top_p, backend.top_k, backend.min_p, backend.repetition_penalty = 1.0, 1.0, -1, 0.0, 1.0
backend.max_completion_length, backend.logprobs, backend.structured_outputs_regex = 4, 0, None
backend.generation_kwargs = {}
backend.vllm_client = StandInClient() if accelerator.is_main_process else None
error = attempt(lambda: backend.generate([[1, 2, 3]] * 2, None, 2))
record["cases"]["generation fails on the main process"] = {"error": error}
accelerator.wait_for_everyone()
record["parameters"] = len(list(trainer.model.named_parameters()))
with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as f:
    json.dump(record, f)

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
