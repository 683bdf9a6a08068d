"""Launched on 2 processes by tests/test_launch.py: a STAND-IN generation backend of the user's own that fails on one
process only. The run must end with an error on every process, not leave the other to enter the next collective alone.

``sync`` (the first argument after the output folder): the synchronous source, sampling fails on process 1 (the next
collective: the sampler-gap reduction). ``checkpoint``: async generation (the main process samples every batch), the
batch generated ahead at the first checkpoint fails while the checkpoint waits for it on the main process (the next
collective: the checkpoint's barrier)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.*

from accelerate import PartialState  # noqa: E402

from bapo_trl.generation.contract import register_backend  # noqa: E402
from bapo_trl.recipes.toy import build_tiny_model  # noqa: E402
from support.harness import cpu_config, tiny_trainer  # noqa: E402


class FailsOnProcessOne:
    def __init__(self, trainer):
        self.eos = trainer.processing_class.eos_token_id

    def sample(self, prompts, n, max_tokens, seed=None):
        if PartialState().process_index == 1:
            raise RuntimeError("the sampler of process 1 is down")
        return {"completion_ids": [[self.eos]] * (len(prompts) * n), "logps": [[-1.0]] * (len(prompts) * n)}

    def requests_answered(self):
        return 0

    def push_weights(self):
        pass

    def gather_weights(self):
        return None

    def send_weights(self, state):
        pass

    def close(self):
        pass


class FailsAtTheCheckpoint(FailsOnProcessOne):
    """Answers the first request; the second (the batch generated ahead, which the checkpoint after step 1 waits for)
    fails 3 s later, once step 1 has taken the first batch."""

    calls = 0

    def sample(self, prompts, n, max_tokens, seed=None):
        FailsAtTheCheckpoint.calls += 1
        if FailsAtTheCheckpoint.calls == 2:
            time.sleep(3)
            raise RuntimeError("the sampler failed on the batch generated ahead")
        return super().sample(prompts, n, max_tokens, seed)


register_backend("fails_on_process_one", FailsOnProcessOne)
register_backend("fails_at_the_checkpoint", FailsAtTheCheckpoint)

if __name__ == "__main__":
    out, case = Path(sys.argv[1]), sys.argv[2]
    settings = {"sync": dict(generation_backend="fails_on_process_one", max_steps=1, save_strategy="no"),
                "checkpoint": dict(generation_backend="fails_at_the_checkpoint", max_steps=2, save_strategy="steps",
                                   save_steps=1, async_generation=True, max_staleness=1, steps_per_generation=1)}
    args = cpu_config(out, per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
                      disable_tqdm=True, **settings[case])
    try:
        tiny_trainer(build_tiny_model(), args, prompts=32).train()
    except Exception as error:  # each process records its own error, then waits: the launcher stops every process
        out.mkdir(parents=True, exist_ok=True)  # once one exits, and one still in a collective records nothing
        (out / f"error_rank{PartialState().process_index}.txt").write_text(f"{type(error).__name__}: {error}")
        time.sleep(5)
        raise
