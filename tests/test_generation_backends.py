"""A generation backend of one's own is one class and one registration line (bapo_trl.generation.contract): here a
STAND-IN engine that samples in the trainer's process with a copy of the policy (no vLLM, no server), registered and
trained through by every source that generates (TRL's default, partial rollout, async generation) with no other
change: every trained completion is one the stand-in sampled, its behaviour log-probs are checked against each
token's saved policy and its staleness against the bound, as the guarantees matrix checks the vLLM backend."""

from __future__ import annotations

import threading

import pytest
import torch

from bapo_trl import BAPOConfig
from bapo_trl.generation.contract import GenerationBackend, register_backend, registered_backends
from bapo_trl.rollout.settings import staleness_bound
from support.guarantee_rows import build
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
        self.sampled: dict = {}  # prefix (prompt, or prompt + a partial completion) -> the segments sampled after it
        self.eos = trainer.processing_class.eos_token_id

    @torch.no_grad()
    def sample(self, prompts, n, max_tokens, seed=None):
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
                    self.sampled.setdefault(tuple(prompt), set()).add(tuple(out))
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


def sampled_here(backend: InProcessBackend, prompt: tuple, completion: tuple) -> bool:
    """Whether every token of ``completion`` came from one of the backend's calls: from the prompt, segment after
    segment (partial rollout grows a completion over several calls, each continuing the prefix so far)."""
    k = 0
    while k < len(completion):
        segments = [seg for seg in backend.sampled.get(prompt + completion[:k], ()) if seg
                    and completion[k: k + len(seg)] == seg]
        if not segments:
            return False
        k += max(len(seg) for seg in segments)
    return True


#: Each source that generates, as a user turns it on: (settings, the staleness a trained token may reach).
SOURCES = {
    "TRL's default (synchronous)": dict(steps_per_generation=2),
    "partial rollout": dict(steps_per_generation=2, partial_rollout_budget=3),
    "async generation, K=1": dict(steps_per_generation=2, async_generation=True, max_staleness=1),
    "async generation, K=2": dict(steps_per_generation=2, async_generation=True, max_staleness=2),
    "replay": dict(steps_per_generation=1, replay_buffer_size=16, replay_ratio=0.5, replay_max_staleness=4),
}


def test_a_second_train_pushes_the_trained_weights_before_it_samples(tiny_model_dir, tmp_path):
    """A run of one generation batch (its only push at step 0), then ``train()`` again on the same trainer: the second
    run restarts at step 0 with the first run's trained weights, which the backend does not hold. It pushes them
    before sampling (it did not: TRL's record of the last push still said step 0, so the second run's first batch was
    sampled by the first run's initial weights and stamped as the current policy's)."""
    args = cpu_config(tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, seed=0, learning_rate=5e-2, max_steps=1, disable_tqdm=True,
                      generation_backend="in_process_stand_in")
    trainer = build(tiny_model_dir, args)
    trainer.train()
    backend = trainer.port.backend
    pushed, trained = backend.pushes, {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert backend.pushes == pushed + 1
    held = backend.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in trained.items())  # what the second run's first batch sampled from


def test_a_users_backend_keeps_its_own_push_record_apart_from_trls_vllm(tiny_model_dir, tmp_path):
    """With ``use_vllm`` beside a backend of the user's own, TRL's evaluation pushes TRL's vLLM and sets TRL's record
    of the last push: that record is not the user's backend's. Read as such, the next training batch was sampled by
    older weights and stamped as the current policy's (and async generation dropped the pushes handed over). The
    backend's record is its own; TRL's stays TRL's; a run's end resets it."""
    args = cpu_config(tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, seed=0, max_steps=1, generation_backend="in_process_stand_in")
    trainer = build(tiny_model_dir, args)
    port = trainer.port
    assert port.weights_step == -1
    port.push_weights()
    assert port.weights_step == trainer.state.global_step == 0 and getattr(trainer, "_last_loaded_step", -1) == -1
    trainer.state.global_step = 3
    trainer._last_loaded_step = 3  # what TRL's evaluation sets when it pushes its own vLLM at step 3
    assert port.weights_step == 0
    pushes = port.backend.pushes
    port._weights_current()  # the next training batch: the backend is brought to step 3 first
    assert port.backend.pushes == pushes + 1 and port.weights_step == 3
    port.close_backend()
    assert port.weights_step == -1


@pytest.mark.parametrize("backend", [None, "in_process_stand_in"])
@pytest.mark.parametrize("source", ["TRL's default (synchronous)", "partial rollout", "replay"])
def test_a_batch_of_the_current_version_is_on_policy_only_where_the_trainer_scored_it(source, backend, tiny_model_dir,
                                                                                     tmp_path):
    """A micro-batch carrying old log-probs, every row of the current policy's version, keeps the user's window (is
    exactly on-policy) where those log-probs are the trainer's own (TRL's old-logp forward, a source's scoring); where
    a backend of the user's own sampled it they are the sampler's, the ratio carries its gap and the search acts. An
    older row, or no version, is stale either way; no old log-probs is TRL's on-policy path."""
    from support.harness import tiny_trainer

    args = cpu_config(tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=1, generation_backend=backend or "vllm", **SOURCES[source])
    trainer = tiny_trainer(tiny_model_dir, args)
    assert trainer.rollout_source.behaviour_from_sampler == (backend is not None)
    trainer.model.train()
    step = trainer.state.global_step
    current = {"advantages": torch.zeros(4), "old_per_token_logps": torch.zeros(4, 3),
               "policy_version": torch.full((4,), step)}
    assert trainer._on_policy(current) == (backend is None)
    assert not trainer._on_policy({**current, "policy_version": torch.tensor([step, step, step - 1, step])})
    assert not trainer._on_policy({k: v for k, v in current.items() if k != "policy_version"})
    assert trainer._on_policy({k: v for k, v in current.items() if k != "old_per_token_logps"})
    trainer.rollout_source = object()  # a source of the user's that does not declare behaviour_from_sampler
    assert not trainer._on_policy(current)  # the search acts, as before the attribute existed


@pytest.mark.parametrize("source", list(SOURCES))
def test_every_source_trains_through_a_registered_backend(source, tiny_model_dir, tmp_path):
    """Through the registered stand-in (no vLLM, ``use_vllm`` off), 2 updates per batch: it trains; every trained
    completion is one the stand-in sampled (TRL's generate call and its vLLM are not used); every trained token's
    behaviour log-prob is its version's saved policy's (recomputed as the guarantees matrix does) and its staleness
    within the documented bound (which async generation's tokens reach; the others' are stale too)."""
    from support.guarantee_rows import check_behaviour_logps, check_versions_and_staleness

    snapshots = PolicySnapshots()
    args = cpu_config(
        tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, logging_steps=1, seed=0, learning_rate=5e-3, max_steps=6, disable_tqdm=True,
        generation_backend="in_process_stand_in", **SOURCES[source])
    trainer = build(tiny_model_dir, args, callbacks=[snapshots])
    trainer.train()
    backend = trainer.port.backend
    assert isinstance(backend, InProcessBackend) and backend.pushes > 1 and backend.answered > 0
    assert trainer.state.global_step == 6 and trainer.trained
    assert all(sampled_here(backend, r["prompt"], r["completion"]) for r in trainer.trained)
    bound = staleness_bound(args)
    check_versions_and_staleness(trainer.trained, bound)
    reached = max(r["step"] - min(r["versions"]) for r in trainer.trained)
    assert reached == bound if args.async_generation else reached >= 1  # stale tokens (partial's bound is 9)
    assert check_behaviour_logps(trainer.trained, snapshots.policies, tiny_model_dir, args.temperature, 1e-4) > 0


class ShortLogpsBackend(InProcessBackend):
    """A STAND-IN backend with a bug: its first completion's log-prob list is one token short."""

    def sample(self, prompts, n, max_tokens, seed=None):
        out = super().sample(prompts, n, max_tokens, seed)
        out["logps"][0] = out["logps"][0][:-1]
        return out


register_backend("short_logps_stand_in", ShortLogpsBackend)


@pytest.mark.parametrize("source", ["TRL's default (synchronous)", "partial rollout", "async generation, K=1"])
def test_a_backend_answering_a_log_prob_short_is_an_error_naming_it_in_every_source(source, tiny_model_dir, tmp_path):
    """Every source trusts the backend's answer: a log-prob list one token short would shift every later token's
    behaviour log-prob (in-flight chunks), or be padded with log-prob 0 (TRL's default source, async), or fall back
    silently (partial rollout). It is an error naming the backend and the completion, in every source."""
    args = cpu_config(tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, logging_steps=1, seed=0, max_steps=2, disable_tqdm=True,
                      generation_backend="short_logps_stand_in", **SOURCES[source])
    trainer = build(tiny_model_dir, args)
    with pytest.raises(Exception, match=r"generation backend 'short_logps_stand_in'.*completion 0 has \d+ token"):
        trainer.train()


@pytest.mark.parametrize("output, problem", [
    ({"completion_ids": [[5, 6]]}, "keys"),
    ([[5, 6]], "got list"),
    ({"completion_ids": [[5, 6]], "logps": [[-0.1, -0.2]]}, "asked for 2 completion"),
    ({"completion_ids": [[5, 6], [7]], "logps": [[-0.1, None], [-0.3]]}, "not a number"),
    ({"completion_ids": [[5, 6], [7, 8, 9, 10]], "logps": [[-0.1, -0.2], [-0.3] * 4]}, "at most 3 asked"),
])
def test_a_backends_answer_is_checked_before_any_source_reads_it(output, problem):
    from bapo_trl.generation.contract import sampled_or_error

    with pytest.raises(ValueError, match=rf"generation backend 'mine'.*{problem}"):
        sampled_or_error("mine", output, prompts=1, n=2, max_tokens=3)
    fine = {"completion_ids": [[5, 6], [7]], "logps": [[-0.1, float("nan")], [-0.3]]}  # NaN: a token not scored
    assert sampled_or_error("mine", fine, prompts=1, n=2, max_tokens=3) is fine


def test_an_unregistered_backend_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="generation_backend.*registered"):
        BAPOConfig(output_dir="unused", use_cpu=True, generation_backend="sglang")


def test_a_rollout_func_beside_a_backend_of_ones_own_is_refused_by_name_before_loading(tmp_path):
    """The default source hands a backend's completions to TRL through ``rollout_func``: a user's own would be
    replaced, so the pair is refused, naming both, before the model is loaded (a path that does not exist)."""
    from bapo_trl import BAPOTrainer

    args = cpu_config(tmp_path / "out", generation_backend="in_process_stand_in")
    with pytest.raises(ValueError, match="generation_backend='in_process_stand_in'.*rollout_func"):
        BAPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=args, rollout_func=lambda prompts, trainer: {})


class PerturbedBackend(InProcessBackend):
    """A sampler that differs from the trainer (as another kernel, precision or a broken push would): its copy of the
    policy gets N(0, 0.05) noise on every weight at each push. Records the log-prob it gave every token it sampled,
    by prefix (``sampled`` keeps the segments)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.token_logps: dict = {}  # (prefix, segment) -> the sampler's log-probs of the segment

    def send_weights(self, state):
        generator = torch.Generator().manual_seed(1234 + self.pushes)
        noisy = {k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                 for k, v in state.items()}
        super().send_weights(noisy)

    def sample(self, prompts, n, max_tokens, seed=None):
        out = super().sample(prompts, n, max_tokens, seed)
        for i, (ids, lps) in enumerate(zip(out["completion_ids"], out["logps"])):
            self.token_logps[(tuple(prompts[i // n]), tuple(ids))] = lps
        return out


register_backend("perturbed_stand_in", PerturbedBackend)


def sampler_logps_of(backend: PerturbedBackend, prompt: tuple, completion: tuple) -> list[float]:
    """The sampler's log-probs of ``completion``, segment by segment (partial rollout continues a prefix)."""
    k, logps = 0, []
    while k < len(completion):
        options = [(seg, lps) for (prefix, seg), lps in backend.token_logps.items()
                   if prefix == prompt + completion[:k] and seg and completion[k: k + len(seg)] == seg]
        assert options, (prompt, completion, k)
        seg, lps = max(options, key=lambda o: len(o[0]))
        logps += lps
        k += len(seg)
    return logps


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_sampler_that_differs_from_the_trainer_is_the_behaviour_policy(source, tiny_model_dir, tmp_path):
    """Sampler truth (issue 75, finding 1): with a backend whose sampler differs from the trainer (perturbed weights,
    learning rate 0, so the policy never moves), every trained token's behaviour log-prob is the SAMPLER's, so BAPO's
    ratio carries the gap (it was the trainer's own forward: ratio exactly 1, the gap invisible), and the gap is logged
    under TRL's ``sampling/sampling_logp_difference/*`` names by the sources that can see it (the synchronous ones)."""
    args = cpu_config(
        tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, logging_steps=1, seed=0, learning_rate=0.0, max_steps=2, disable_tqdm=True,
        generation_backend="perturbed_stand_in", **SOURCES[source])
    trainer = build(tiny_model_dir, args)
    trainer.train()
    backend = trainer.port.backend
    assert isinstance(backend, PerturbedBackend) and trainer.trained
    for row in trainer.trained:
        sampler = sampler_logps_of(backend, row["prompt"], row["completion"])
        assert row["old"] == pytest.approx(sampler, abs=1e-6), row
    logged = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    if not args.async_generation:
        assert logged and all(h["sampling/sampling_logp_difference/mean"] > 0.05 for h in logged), logged
        gaps = [h["sampling/sampling_logp_difference/max"] for h in logged]
        assert max(gaps) > 0.1


def trainer_logps(model, prompt: tuple, completion: tuple, temperature: float) -> list[float]:
    """The policy's log-probs of ``completion`` after ``prompt``, temperature-scaled as TRL's forward scales them."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def frozen_policy_config(server, tmp_path, **settings):
    """A config generating in ``server`` for two steps at learning rate 0 (the trainer's policy never moves)."""
    host, port = server.url.removeprefix("http://").split(":")
    return cpu_config(
        tmp_path / "out", save_strategy="no", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, logging_steps=1, seed=0, learning_rate=0.0, max_steps=2, disable_tqdm=True,
        use_vllm=True, vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port),
        vllm_server_timeout=30, **settings)


#: The sources of the built-in vLLM backend, through the stand-in server: (settings, whether TRL's vLLM
#: importance-sampling correction carries the sampler's gap; else BAPO's ratio does, the sampler being the behaviour).
VLLM_SOURCES = {
    "TRL's default (synchronous)": (dict(steps_per_generation=2), True),
    "partial rollout": (dict(steps_per_generation=2, partial_rollout_budget=3), True),
    "async generation, K=1": (dict(steps_per_generation=2, async_generation=True, max_staleness=1), False),
    "async generation, K=2": (dict(steps_per_generation=2, async_generation=True, max_staleness=2), False),
    "async generation, in-flight updates": (dict(steps_per_generation=2, async_generation=True, max_staleness=1,
                                                 inflight_update_tokens=3), False),
    "replay": (dict(steps_per_generation=1, replay_buffer_size=16, replay_ratio=0.5, replay_max_staleness=4), True),
}


@pytest.mark.parametrize("source", list(VLLM_SOURCES))
def test_a_vllm_sampler_that_differs_from_the_trainer_is_corrected_or_is_the_behaviour(source, tiny_model_dir,
                                                                                      tmp_path, monkeypatch):
    """Sampler truth with TRL's own vLLM backend (the stand-in server with its policy perturbed, as another kernel or
    quantisation would; learning rate 0, so the trainer's policy never moves): where TRL computes its importance-
    sampling correction (the synchronous sources) the behaviour log-probs are the trainer's own and TRL's weights
    carry the gap (logged: ``sampling/importance_sampling_ratio/*`` away from 1, ``sampling/sampling_logp_difference``
    above 0); under async generation the behaviour log-probs are the sampler's, so BAPO's ratio carries it."""
    from transformers import AutoModelForCausalLM

    from support.policy_server import PolicyServer

    settings, corrected = VLLM_SOURCES[source]
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, perturb=1.5)
    try:
        args = frozen_policy_config(server, tmp_path, **settings)
        trainer = build(tiny_model_dir, args)
        trainer.train()
    finally:
        server.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gaps = [abs(a - b) for row in trainer.trained if row["completion"]
            for a, b in zip(row["old"], trainer_logps(model, row["prompt"], row["completion"], args.temperature))]
    history = trainer.state.log_history
    weights = [h["sampling/importance_sampling_ratio/mean"] for h in history
               if "sampling/importance_sampling_ratio/mean" in h]
    if corrected:
        assert max(gaps) < 1e-4, max(gaps)  # the behaviour is the trainer's own policy ...
        assert weights and max(abs(w - 1) for w in weights) > 0.01, weights  # ... and TRL's weights carry the gap
        assert max(h["sampling/sampling_logp_difference/mean"] for h in history
                   if "sampling/sampling_logp_difference/mean" in h) > 0.05
    else:
        assert sum(gaps) / len(gaps) > 0.05, sum(gaps) / len(gaps)  # the behaviour is the sampler: BAPO's ratio


#: LoRA rows of sampler truth: how the adapter reaches the server (``vllm_lora_sync``) x every source of the built-in
#: vLLM backend.
LORA_SOURCES = tuple(VLLM_SOURCES)


@pytest.mark.parametrize("mode", ["adapter", "merged"])
@pytest.mark.parametrize("source", LORA_SOURCES)
def test_with_lora_the_behaviour_is_the_sampler_of_base_plus_adapter_or_trls_correction_carries_it(
        source, mode, tiny_model_dir, tmp_path, monkeypatch):
    """Sampler truth through peft, each way the adapter reaches the server: the stand-in server samples from ITS policy
    (the pushed base plus the pushed adapter, perturbed); a synchronous source's behaviour is the trainer's own
    policy (base + adapter) with TRL's correction carrying the gap, an async one's is exactly the sampler's policy
    of base + adapter (recomputed here with the perturbation): an adapter missing on the server, or counted twice,
    fails it (seen failing with the pushed adapter's B zeroed)."""
    from peft import LoraConfig

    from support.policy_server import PolicyServer

    settings, corrected = VLLM_SOURCES[source]
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, perturb=1.5, lora=True)
    try:
        args = frozen_policy_config(server, tmp_path, vllm_lora_sync=mode, **settings)
        trainer = build(tiny_model_dir, args, peft=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                if "lora_B" in name:  # the adapter moves the policy
                    parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
        trainer.train()
        perturbation = server.perturbation
    finally:
        server.close()
    policy = trainer.model.eval()
    rows = [row for row in trainer.trained if row["completion"]]
    own = [abs(a - b) for row in rows
           for a, b in zip(row["old"], trainer_logps(policy, row["prompt"], row["completion"], args.temperature))]
    if corrected:
        assert max(own) < 1e-4, max(own)  # the behaviour is the trainer's own policy, adapter included
        assert max(h["sampling/sampling_logp_difference/mean"] for h in trainer.state.log_history
                   if "sampling/sampling_logp_difference/mean" in h) > 0.05
    else:
        sampler = [abs(a - b) for row in rows for a, b in zip(row["old"], perturbed_logps(
            policy, row["prompt"], row["completion"], args.temperature, perturbation))]
        assert max(sampler) < 1e-4, max(sampler)  # exactly the server's policy: base + adapter, perturbed
        assert sum(own) / len(own) > 0.05


def perturbed_logps(model, prompt: tuple, completion: tuple, temperature: float, perturbation) -> list[float]:
    """The stand-in server's log-probs: the policy's logits shifted by its perturbation, then temperature-scaled."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = (model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() + perturbation) / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()
