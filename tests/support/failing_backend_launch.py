"""Launched on 2 processes by tests/test_launch.py: a STAND-IN generation backend of the user's own that fails on
process 1 only. The run must end with an error on every process, not leave process 0 to enter the next collective
(the sampler-gap reduction) alone."""

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


register_backend("fails_on_process_one", FailsOnProcessOne)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    args = cpu_config(out, generation_backend="fails_on_process_one", per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=4, max_steps=1, save_strategy="no",
                      disable_tqdm=True)
    try:
        tiny_trainer(build_tiny_model(), args, prompts=32).train()
    except Exception as error:  # each process records its own error, then waits: the launcher stops every process
        out.mkdir(parents=True, exist_ok=True)  # once one exits, and one still in a collective records nothing
        (out / f"error_rank{PartialState().process_index}.txt").write_text(f"{type(error).__name__}: {error}")
        time.sleep(5)
        raise
