"""A generation backend of one's own is one class and one registration line (bapo_trl.generation.contract): here a
STAND-IN engine that samples in the trainer's process with a copy of the policy (no vLLM, no server), registered and
trained through by async generation with no other change; its behaviour log-probs are checked against each token's
saved policy and its staleness against the bound, as the guarantees matrix checks the vLLM backend."""

from __future__ import annotations

import threading

import pytest
import torch

from bapo_trl import BAPOConfig
from bapo_trl.generation.contract import GenerationBackend, register_backend, registered_backends
from bapo_trl.rollout.settings import staleness_bound
from support.harness import PolicySnapshots, cpu_config


class InProcessBackend:
    """Samples with its own copy of the policy (loaded from the trainer's weights at each push), token by token at
    the run's temperature; every sequence draws from a generator seeded by the request's seed and its index."""

    def __init__(self, trainer):
        self.trainer = trainer
        policy = trainer.accelerator.unwrap_model(trainer.model)
        # a model of its own, built from the config (a deep copy would keep a forward that accelerate bound to the
        # trainer's model, and sample with the weights being trained)
        self.model = type(policy)(policy.config).eval()
        self.model.load_state_dict(policy.state_dict())
        self.lock = threading.Lock()
        self.answered = 0
        self.pushes = 0
        self.eos = trainer.processing_class.eos_token_id

    @torch.no_grad()
    def generate(self, prompts, n, max_tokens, seed=None):
        temperature = self.trainer.args.temperature
        completions, logps = [], []
        with self.lock:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    generator = torch.Generator().manual_seed(hash((seed, p, j)) % 2**31)
                    ids, out, lps = list(prompt), [], []
                    for _ in range(max_tokens):
                        logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
                        probs = torch.softmax(logits, -1)
                        token = int(torch.multinomial(probs, 1, generator=generator))
                        out.append(token)
                        lps.append(float(torch.log(probs[token])))
                        ids.append(token)
                        if token == self.eos:
                            break
                    completions.append(out)
                    logps.append(lps)
            self.answered += 1
        return {"completion_ids": completions, "logps": logps}

    def requests_answered(self):
        return self.answered

    def push_weights(self):
        self.send_weights(self.gather_weights())

    def gather_weights(self):
        return {k: v.detach().clone() for k, v in self.trainer.accelerator.unwrap_model(self.trainer.model)
                .state_dict().items()}

    def send_weights(self, state):
        with self.lock:
            self.model.load_state_dict(state)
            self.pushes += 1

    def close(self):
        pass


register_backend("in_process_stand_in", InProcessBackend)


def test_the_stand_in_follows_the_protocol():
    assert "in_process_stand_in" in registered_backends() and "vllm" in registered_backends()
    assert issubclass(InProcessBackend, GenerationBackend)  # runtime-checkable: the methods are there


def test_async_generation_trains_through_a_registered_backend(tiny_model_dir, tmp_path):
    """Async generation, K=1, 2 updates per batch, through the registered stand-in (no vLLM, ``use_vllm`` off): it
    trains; every trained token's behaviour log-prob is its version's saved policy's (recomputed as the guarantees
    matrix does) and its staleness within the documented bound, which some tokens reach."""
    from support.guarantee_rows import build, check_behaviour_logps, check_versions_and_staleness

    snapshots = PolicySnapshots()
    args = cpu_config(
        tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, logging_steps=1, seed=0, learning_rate=5e-3, steps_per_generation=2, max_steps=6,
        disable_tqdm=True, async_generation=True, max_staleness=1, generation_backend="in_process_stand_in")
    trainer = build(tiny_model_dir, args, callbacks=[snapshots])
    trainer.train()
    backend = trainer.port.backend
    assert isinstance(backend, InProcessBackend) and backend.pushes > 1 and backend.answered > 0
    assert trainer.state.global_step == 6
    bound = staleness_bound(args)
    check_versions_and_staleness(trainer.trained, bound)
    assert max(r["step"] - min(r["versions"]) for r in trainer.trained) == bound
    assert check_behaviour_logps(trainer.trained, snapshots.policies, tiny_model_dir, args.temperature, 1e-4) > 0


def test_an_unregistered_backend_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="generation_backend.*registered"):
        BAPOConfig(output_dir="unused", use_cpu=True, generation_backend="sglang")
