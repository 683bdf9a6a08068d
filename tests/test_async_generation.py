"""Async generation: the vLLM server generates the next batches while the trainer trains (issue 17).

Fast tier: the prompt stream, the producer's pacing and push ordering (a scripted generator in place of the server,
named as such), configuration and argument errors, and a stalled server (the stand-in server of policy_server.py). Slow tier: the real vLLM CPU server: overlap, staleness bounded by K, behaviour log-probs equal to
a recomputation with the saved sampling policy, resume without loss or duplication, LoRA, and ZeRO-3 on 2 processes
through train_bapo.py.
"""

from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
from policy_server import PolicyServer
from probes import source_of
from test_vllm_server import completion_length, reset_server_weights, train_with_server
from transformers import AutoModelForCausalLM, TrainerCallback
from trl.trainer.utils import RepeatSampler

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.rollout.async_generation import AsyncGeneration
from bapo_trl.rollout.producer import Producer, PromptStream, Work

pytestmark = pytest.mark.usefixtures("use_test_cache")

# -- the prompt stream -------------------------------------------------------------------------------------------


def test_prompt_stream_draws_as_trls_repeat_sampler_and_resumes_where_it_stopped():
    stream = PromptStream(num_rows=10, num_generations=2, batch_rows=6, shuffle=True, seed=3)
    batches = [stream.next() for _ in range(7)]  # 3 batches of 3 prompts per epoch: 7 spans three epochs
    reference = RepeatSampler(range(10), mini_repeat_count=2, batch_size=3, shuffle=True, seed=3)
    expected = [i for _ in range(3) for i in list(reference)[:9 * 2]]  # each epoch drops the incomplete last chunk
    assert [i for b in batches for i in b] == expected[: 7 * 6]
    assert all(b[0::2] == b[1::2] for b in batches)  # a group's copies side by side
    resumed = PromptStream(num_rows=10, num_generations=2, batch_rows=6, shuffle=True, seed=3)
    resumed.skip_to(4)
    assert [resumed.next() for _ in range(3)] == batches[4:]


def test_prompt_stream_refuses_a_batch_of_partial_groups():
    with pytest.raises(ValueError, match="whole groups of 4"):
        PromptStream(num_rows=10, num_generations=4, batch_rows=6, shuffle=False, seed=0)


# -- the producer (a scripted generator in place of the server) --------------------------------------------------


class ScriptedGenerator:
    """Stands in for the server's generate request (a scripted fake): returns one token per completion, can be held
    mid-request, records when each request ran."""

    def __init__(self):
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()
        self.calls = []

    def __call__(self, work):
        self.started.set()
        self.calls.append(("start", time.perf_counter()))
        assert self.release.wait(30)
        self.calls.append(("end", time.perf_counter()))
        return {"completion_ids": [[7] for _ in work.prompts for _ in range(work.n)],
                "logps": [[-0.5] for _ in work.prompts for _ in range(work.n)]}


def test_a_push_waits_for_the_request_in_flight_and_later_batches_carry_its_version():
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10)
    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=2, max_tokens=4, context=[0, 0]))
        assert generate.started.wait(10)
        pushed = []

        def push():
            with producer.between_requests():
                pushed.append(time.perf_counter())
                producer.version = 5

        pusher = threading.Thread(target=push)
        pusher.start()
        time.sleep(0.2)
        assert not pushed  # the request in flight holds the push back ...
        generate.release.set()
        pusher.join(10)
        assert pushed and pushed[0] >= generate.calls[1][1]  # ... until it has ended
        producer.submit(Work(1, [[2]], n=2, max_tokens=4, context=[1, 1]))
        first, _ = producer.take(0)
        second, _ = producer.take(1)
        assert (first.version, second.version) == (0, 5)  # batch 0 on the old weights, batch 1 on the pushed ones
        assert second.prompt_ids == [[2], [2]] and second.work.context == [1, 1]
    finally:
        producer.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lazy_producer_loads_a_push_only_when_the_next_work_needs_it(lazy):
    """Pushes of steps 1 and 2 are handed over while work queued earlier (min_version 0 and 1) waits: eagerly each
    request first loads the newest push; lazily the work that weights 0 satisfy runs on them, the work that needs 1
    loads the newest push (2), and the push is then no longer pending."""
    generate = ScriptedGenerator()
    producer = Producer(generate, request_timeout=10, lazy=lazy)
    loads = []

    def push(step):
        return (lambda: loads.append(step)), step

    try:
        generate.release.clear()
        producer.submit(Work(0, [[1]], n=1, max_tokens=4, min_version=0))
        assert generate.started.wait(10)
        producer.push_later(*push(1))
        producer.push_later(*push(2))  # replaces the push of step 1, not applied yet
        producer.submit(Work(1, [[2]], n=1, max_tokens=4, min_version=0))
        producer.submit(Work(2, [[3]], n=1, max_tokens=4, min_version=1))
        producer.submit(Work(3, [[4]], n=1, max_tokens=4, min_version=2))
        generate.release.set()
        versions = [producer.take(i)[0].version for i in range(4)]
        if lazy:
            assert versions == [0, 0, 2, 2] and loads == [2]
        else:
            assert versions == [0, 2, 2, 2] and loads == [2]
        assert producer.take_load_seconds() >= 0 and producer.take_load_seconds() == 0.0  # read once
        for i, work_min in enumerate([0, 0, 1, 2]):
            assert versions[i] >= work_min
    finally:
        producer.close()


def test_a_failed_request_is_raised_where_the_trainer_takes_the_batch():
    def broken(work):
        raise ConnectionError("server went away")

    producer = Producer(broken, request_timeout=10)
    producer.submit(Work(0, [[1]], n=1, max_tokens=4))
    with pytest.raises(ConnectionError, match="server went away"):
        producer.take(0)
    producer.close()


# -- configuration ------------------------------------------------------------------------------------------------

BASE = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
            num_generations=4)


@pytest.mark.parametrize("overrides,message", [
    (dict(async_generation=True), r"`async_generation` needs a vLLM server .*use_vllm=False"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="colocate"), r"vllm_mode='colocate'"),
    (dict(max_staleness=0), r"`max_staleness` must be an integer >= 1 .*got 0"),
    (dict(weight_sync_steps=0), r"`weight_sync_steps` must be an integer >= 1 .*got 0"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", partial_rollout_budget=2,
          max_completion_length=8, max_staleness=2), r"`max_staleness` must be 1, got 2"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", inflight_update_tokens=0),
     r"`inflight_update_tokens` must be an integer >= 1"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", partial_rollout_budget=2, max_completion_length=8,
          inflight_update_tokens=2), r"`inflight_update_tokens` cannot be combined with `partial_rollout_budget`"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_staleness=2, inflight_update_tokens=2,
          lazy_weight_loading=True), r"`lazy_weight_loading` cannot be combined with `inflight_update_tokens`"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_completion_length=8, inflight_update_tokens=8),
     r"`inflight_update_tokens` \(8\) must be below `max_completion_length` \(8\)"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_completion_length=8, inflight_update_tokens=2,
          generation_kwargs={"stop": ["\n"], "max_tokens": 4}),
     r"`generation_kwargs` keys \['max_tokens', 'stop'\] cannot be used with `inflight_update_tokens`"),
    (dict(async_generation=True, use_vllm=True, vllm_mode="server", max_completion_length=8, inflight_update_tokens=2,
          generation_kwargs={"ignore_eos": True}), r"\['ignore_eos'\] cannot be used with `inflight_update_tokens`"),
])
def test_async_settings_are_checked_before_anything_is_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        BAPOConfig(**{**BASE, **overrides})


ASYNC = dict(async_generation=True, use_vllm=True, vllm_mode="server")


@pytest.mark.parametrize("overrides,named", [
    (dict(top_p=0.9), "top_p=0.9"), (dict(top_k=20), "top_k=20"), (dict(min_p=0.05), "min_p=0.05"),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(generation_kwargs={"presence_penalty": 0.5}), "generation_kwargs['presence_penalty']"),
    (dict(generation_kwargs={"temperature": 0.7}), "generation_kwargs['temperature']"),
    (dict(vllm_structured_outputs_regex="[0-9]+"), "vllm_structured_outputs_regex"),
    (dict(partial_rollout_budget=2, max_completion_length=8, top_p=0.9), "top_p=0.9"),
])
def test_async_refuses_sampling_whose_log_probs_are_not_the_policys(overrides, named):
    """With top-p/top-k/min-p truncation or penalties, the server's processed log-probs belong to another
    distribution than the policy's: every async ratio would carry that bias. Refused, naming the setting."""
    with pytest.raises(ValueError, match="truncated or penalised") as error:
        BAPOConfig(**{**BASE, **ASYNC, **overrides})
    assert named in str(error.value) and "async_generation=False" in str(error.value)


def test_sync_generation_keeps_trls_handling_of_truncated_sampling():
    BAPOConfig(**BASE, top_p=0.9, top_k=20, steps_per_generation=2)  # TRL's IS correction handles it: accepted


@pytest.mark.parametrize("name", ["max_staleness", "weight_sync_steps"])
def test_async_settings_without_async_warn_that_they_do_nothing(name):
    with pytest.warns(UserWarning, match=rf"`{name}` \(3\) only acts on async generation"):
        BAPOConfig(**BASE, **{name: 3}, steps_per_generation=2)


def test_lazy_loading_warns_where_it_can_change_nothing():
    with pytest.warns(UserWarning, match=r"`lazy_weight_loading` \(True\) only acts on async generation"):
        BAPOConfig(**BASE, lazy_weight_loading=True, steps_per_generation=2)
    with pytest.warns(UserWarning, match=r"`lazy_weight_loading` has no effect with `max_staleness`=1"):
        BAPOConfig(**BASE, lazy_weight_loading=True, async_generation=True, use_vllm=True, vllm_mode="server",
                   steps_per_generation=2)


def test_a_users_rollout_func_is_refused_with_async_generation():
    from bapo_trl.rollout import check_source_arguments

    args = BAPOConfig(**BASE, async_generation=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="async generation .*would replace yours"):
        check_source_arguments(args, {"rollout_func": lambda prompts, trainer: {}})


def test_resuming_planned_short_batches_without_the_replay_that_fills_them_is_refused():
    """A checkpoint of async generation with replay_saves_generation holds batches generated (or planned) short, for
    replay to fill; resumed with it switched off, they would reach TRL short. Refused at load, before generating."""
    from types import SimpleNamespace

    port = SimpleNamespace(args=SimpleNamespace(max_staleness=2))
    saved = {"batches_handed": 3, "batches_submitted": 3, "generated": [], "planned": {3: 0, 4: 1},
             "planned_upto": 5}
    with pytest.raises(ValueError, match=r"those batches would be short\. Resume with the checkpoint's settings"):
        AsyncGeneration(port).load_state_dict(saved)
    planned = AsyncGeneration(port)
    planned.plan_with(lambda index, ahead: 1)  # what ReplaySource does when replay_saves_generation is on
    planned.load_state_dict(saved)
    assert (planned.handed, planned.planned) == (3, {3: 0, 4: 1})
    AsyncGeneration(port).load_state_dict({**saved, "planned": {3: 0, 4: 0}})  # nothing left out: any settings


def test_a_stalled_server_is_an_error_naming_the_timeout(tiny_model_dir, tmp_path, monkeypatch):
    """The producer's request to a server that never answers surfaces in the trainer as the client's timeout error,
    sent once."""
    from bapo_trl.generation.cpu_server import VLLMServerTimeout

    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, stall_on=(1,))
    try:
        with pytest.raises(VLLMServerTimeout, match=r"did not answer /v1/completions within 2 s"):
            train_with_server(tiny_model_dir, tmp_path / "out", server.url, vllm_server_timeout=2,
                              async_generation=True)
    finally:
        server.close()
    assert server.requests["RPC", "reload_weights"] >= 1  # the weights were pushed before the first request
    # the first batch is one request per prompt (16 rows: 4 prompts of 4 completions); the first stalled; none sent
    # twice
    assert 1 <= server.requests["POST", "/v1/completions"] <= 4 and not server.resent()


# -- the real server ------------------------------------------------------------------------------------------------


class Snapshots(TrainerCallback):
    """The policy at the start of every optimizer step (the weights a push at that step sends) and when each step
    ended."""

    def __init__(self):
        self.policies, self.step_ends = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.policies[state.global_step] = copy.deepcopy(model.state_dict())

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends[state.global_step - 1] = time.perf_counter()  # the step that trained on batch global_step-1


class LongerSteps(TrainerCallback):
    """Makes each optimizer step last at least ``seconds`` (before Snapshots records its end): on the tiny model a
    step (~0.1 s) is shorter than the weight push that precedes the next request (a disk write and a server reload),
    which a loaded machine stretches; a real model's step is the longer one, and only then can a request overlap it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - self.began)))


class AsyncProbe:
    """Wraps the real source's methods (a probe, not a fake): records each batch handed to the trainer and when each
    server request started."""

    def __init__(self, trainer):
        source: AsyncGeneration = source_of(trainer, AsyncGeneration)
        self.batches, self.requests = [], {}
        next_batch, generate = source.next_batch, source._generate

        def recording_next_batch(inputs, score):
            output = next_batch(inputs, score)
            self.batches.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in output.items()})
            return output

        def recording_generate(work):
            self.requests[len(self.requests)] = time.perf_counter()  # requests run in batch order
            return generate(work)

        source.next_batch, source._generate = recording_next_batch, recording_generate


class ProbedTrainer(BAPOTrainer):
    """BAPOTrainer with an :class:`AsyncProbe` on its source; ``resume_from`` and ``peft_config`` set on the class."""

    resume_from = None
    peft = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, **({"peft_config": self.peft} if self.peft is not None else {}))
        self.probe = AsyncProbe(self)

    def train(self, *args, **kwargs):
        return super().train(resume_from_checkpoint=self.resume_from)


def async_run(model_dir, out, server_url, callbacks=(), resume_from=None, peft=None, **overrides):
    trainer_cls = type("Probed", (ProbedTrainer,), {"resume_from": resume_from, "peft": peft})
    settings = dict(async_generation=True, steps_per_generation=1, learning_rate=5e-3, max_steps=6)
    trainer = train_with_server(model_dir, out, server_url, trainer_cls=trainer_cls, callbacks=callbacks,
                                **{**settings, **overrides})
    return trainer, trainer.probe


def sequence_logps(model, prompt_ids, completion_ids, temperature):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def completions_of(batch):
    """(prompt ids, completion ids, behaviour log-probs) of every completion of a recorded batch."""
    for i in range(batch["completion_ids"].size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        length = int(batch["completion_mask"][i].sum())
        yield prompt, batch["completion_ids"][i][:length].tolist(), batch["old_per_token_logps"][i][:length]


@pytest.fixture(scope="module")
def async_k1(start_server, tiny_model_dir, tmp_path_factory):
    tiny_server = start_server(tiny_model_dir)
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = Snapshots()
    trainer, probe = async_run(tiny_model_dir, tmp_path_factory.mktemp("async") / "out", tiny_server.url,
                               callbacks=[LongerSteps(1.5), snapshots])
    return trainer, probe, snapshots


@pytest.mark.slow
def test_generation_of_the_next_batch_overlaps_training_on_this_one(async_k1):
    trainer, probe, snapshots = async_k1
    assert len(probe.batches) == 6
    # K=1: request b+1 is sent while the step on batch b is still training
    overlapped = [b for b in range(5) if probe.requests[b + 1] < snapshots.step_ends[b]]
    assert len(overlapped) >= 4, (probe.requests, snapshots.step_ends)
    logs = [h for h in trainer.state.log_history if "async/wait_seconds" in h]
    assert len(logs) == 6
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


@pytest.mark.slow
def test_staleness_never_exceeds_max_staleness(async_k1):
    trainer, probe, _ = async_k1
    versions = [int(b["policy_version"][0]) for b in probe.batches]
    assert versions[0] == 0
    ages = [step - v for step, v in enumerate(versions)]  # one optimizer step per generation batch here
    assert max(ages) <= 1 and ages[1:] == [1] * 5  # K=1, and generation always ran one batch ahead
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    assert max(h["async/staleness_max"] for h in logs) == 1 and max(h["bapo/staleness_max"] for h in logs) == 1
    assert all(h["bapo/token_fraction/age_1"] == 1 for h in logs[1:])


@pytest.mark.slow
def test_behaviour_logps_are_those_of_the_saved_sampling_policy(async_k1, tiny_model_dir):
    """Each batch's old_per_token_logps equal a recomputation with the policy of the version the batch carries
    (saved at that step), and differ from the current policy's: the staleness reaches BAPO."""
    trainer, probe, snapshots = async_k1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    checked, gap = 0, 0.0
    for step, batch in enumerate(probe.batches[1:], start=1):
        version = int(batch["policy_version"][0])
        for prompt, completion, behaviour in list(completions_of(batch))[:4]:
            model.load_state_dict(snapshots.policies[version])
            sampling = sequence_logps(model, prompt, completion, trainer.temperature)
            assert torch.allclose(sampling, behaviour, atol=1e-3), (version, sampling, behaviour)
            model.load_state_dict(snapshots.policies[step])
            gap = max(gap, float((sequence_logps(model, prompt, completion, trainer.temperature) - behaviour)
                                 .abs().max()))
            checked += 1
    print(f"largest current-policy gap: {gap:.3f}")
    assert checked >= 16 and gap > 1e-2


@pytest.mark.slow
def test_every_async_metric_is_registered_and_logged(async_k1):
    from bapo_trl.metrics import REGISTRY

    trainer, _, _ = async_k1
    logged = {k for h in trainer.state.log_history for k in h if k.startswith(("async/", "bapo/"))}
    registered = {name for names in REGISTRY.values() for name in names}
    assert logged <= registered, logged - registered
    assert set(REGISTRY["async"]) <= logged, set(REGISTRY["async"]) - logged


@pytest.mark.slow
def test_k2_runs_up_to_two_batches_ahead_and_no_further(tiny_server, tiny_model_dir, tmp_path):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = Snapshots()
    # steps last 1.5 s: on the tiny model a bare step is shorter than the push before the next request (see LongerSteps)
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, callbacks=[LongerSteps(1.5), snapshots],
                               max_staleness=2)
    ages = [step - int(b["policy_version"][0]) for step, b in enumerate(probe.batches)]
    assert max(ages) <= 2, ages
    # Pacing: request b+2 is queued when the step on batch b begins (after step b-1 ended), never earlier ...
    for b in range(1, len(probe.batches) - 2):
        assert probe.requests[b + 2] > snapshots.step_ends[b - 1]
    # ... and it does run while batch b trains (impossible at K=1, where b+2 waits for the step on b+1)
    ahead = [b for b in range(len(probe.batches) - 2) if probe.requests[b + 2] < snapshots.step_ends[b]]
    assert ahead, (probe.requests, snapshots.step_ends)


def test_lazy_loading_lets_a_slower_server_skip_reloads_within_the_bound(tiny_model_dir, tmp_path):
    """Generation the slower side (a slowed stand-in server), K=2: eagerly the server would reload before every
    request and the data stay one push old (benchmarks/async_overlap.py measured that); lazily it skips the reloads
    the bound does not need, so requests run on weights up to two pushes old, never older (age at hand-over <= 2)."""
    server = PolicyServer(tiny_model_dir, seconds_per_token=0.004)
    try:
        trainer = train_with_server(tiny_model_dir, tmp_path, server.url, max_steps=10, async_generation=True,
                                    max_staleness=2, steps_per_generation=1, lazy_weight_loading=True,
                                    disable_tqdm=True)
    finally:
        server.close()
    ages = [h["async/staleness_max"] for h in trainer.state.log_history if "async/staleness_max" in h]
    assert len(ages) == 10 and max(ages) <= 2, ages
    requests = len(server.versions)
    assert server.reloads < requests - 1, (server.reloads, server.versions)  # loads were skipped ...
    assert ages.count(2) >= 2, ages  # ... so batches reached the bound
    loads = [h["async/load_seconds"] for h in trainer.state.log_history if "async/load_seconds" in h]
    assert 0 < sum(s > 0 for s in loads) < len(loads), loads  # hand-overs with a load since the last, and without


@pytest.mark.slow
def test_resume_trains_the_remaining_batches_once(tiny_server, tiny_model_dir, tmp_path):
    """A run checkpointed after 2 of 4 batches resumes with batches 3 and 4 of the same prompt stream: the batch
    generated ahead at the checkpoint is saved and trained as it was (same completions, same policy version), not
    generated again; the union of prompts equals the uninterrupted run's."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "out"
    full, full_probe = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, save_strategy="steps",
                                 save_steps=2)
    state = torch.load(out / "checkpoint-2" / "async_generation_rank0.pt", weights_only=False)
    assert state["batches_handed"] == 2
    assert [g["index"] for g in state["generated"]] == [2]  # K=1: the batch generated ahead of step 3
    _, probe = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, resume_from=str(out / "checkpoint-2"))
    assert len(probe.batches) == 2  # only the two batches after the checkpoint

    def prompts(batch):
        return [tuple(p) for p, _, _ in completions_of(batch)]

    assert [prompts(b) for b in probe.batches] == [prompts(b) for b in full_probe.batches[2:]]
    saved, uninterrupted = probe.batches[0], full_probe.batches[2]
    assert [c for _, c, _ in completions_of(saved)] == [c for _, c, _ in completions_of(uninterrupted)]
    assert int(saved["policy_version"][0]) == int(uninterrupted["policy_version"][0]) == 1


@pytest.mark.slow
def test_lora_with_async_generation(tiny_server, tiny_model_dir, tmp_path):
    """LoRA: the merged weights are pushed, and the behaviour log-probs still match the server's sampling policy
    (TRL's sampler comparison is 0 by construction, so the staleness metrics and a finite loss are what is checked;
    the push of merged weights is TRL's own code)."""
    from peft import LoraConfig

    reset_server_weights(tiny_server.url, tiny_model_dir)
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, max_steps=4, callbacks=[LongerSteps(1.5)],
                               peft=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    assert len(probe.batches) == 4
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    staleness = [h["async/staleness_max"] for h in logs]
    # K=1: the first batch is fresh, none older than one step; the next batch is generated during a step (steps last
    # 1.5 s here: on a loaded machine a 0.1 s step ended before the merged weights' push, and a batch came fresh)
    assert staleness[0] == 0 and max(staleness) == 1 and all(s in (0, 1) for s in staleness), staleness
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial_rollout"])
def test_zero3_two_processes_async_from_train_bapo(tiny_server, tiny_model_dir, tmp_path, partial):
    """`accelerate launch` ZeRO-3 on 2 processes: every rank takes part in each push (gathering is collective), rank
    0's producer alone talks to the server, and each rank trains its slice of the shared batch (with partial rollout:
    of the finished groups of rank 0's pool)."""
    from launching import REPO, accelerate_launch, assert_zero3_partitioned

    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "run"
    extra = ["--partial_rollout_budget", "3", "--max_completion_length", "10"] if partial else \
        ["--max_completion_length", "8"]
    proc = accelerate_launch(
        REPO / "train_bapo.py", "--max_steps", "4",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "1",
        "--logging_steps", "1", "--output_dir", out, *extra,
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", tiny_server.url,
        "--async_generation", "--max_staleness", "1",
        config_file=REPO / "accelerate_configs" / "deepspeed_zero3.yaml", extra_launch=["--mixed_precision", "no"],
        timeout=1200,
    )
    assert_zero3_partitioned(out)
    text = proc.stdout + proc.stderr
    staleness = [float(x) for x in re.findall(r"'async/staleness_max': '([^']+)'", text)]
    assert len(staleness) == 4 and staleness[0] == 0 and min(staleness[1:]) >= 1, staleness
    if not partial:
        assert staleness == [0, 1, 1, 1], staleness
    else:
        segments = [float(x) for x in re.findall(r"'partial/segments_per_completion': '([^']+)'", text)]
        assert len(segments) == 4 and max(segments) > 1, segments
    assert len(re.findall(r"'loss': '([^']+)'", text)) == 4


@pytest.mark.slow
def test_dynamics_plot_draws_the_async_panels_from_a_real_async_run(async_k1):
    from bapo_trl.plot import plot_dynamics

    trainer, _, _ = async_k1
    history = trainer.state.log_history
    fig = plot_dynamics(history, smooth=1)
    assert {"async_time", "async_age"} <= set(fig.bapo_panels)
    drawn = {ln.get_gid(): ln for ln in fig.bapo_axes["async_time"].lines}
    logged = [h["async/generate_seconds"] for h in history if "async/generate_seconds" in h]
    assert list(drawn["async/generate_seconds"].get_ydata()) == pytest.approx(logged)
    assert "async_time" not in plot_dynamics([{"reward": 0.5, "step": 1}], smooth=1).bapo_panels


@pytest.mark.slow
def test_evaluation_during_async_training_holds_the_producer_and_records_its_push(tiny_server, tiny_model_dir,
                                                                                  tmp_path):
    """Evaluation generates through TRL's own path with the producer held; TRL's push of the current weights is
    recorded, so the batches generated after it carry that version (never an older one: staleness stays <= K)."""
    from bapo_trl.toy import make_reverse_dataset

    reset_server_weights(tiny_server.url, tiny_model_dir)

    class WithEval(ProbedTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, eval_dataset=make_reverse_dataset(8, seed=5), **kwargs)

    trainer = train_with_server(tiny_model_dir, tmp_path, tiny_server.url, trainer_cls=WithEval,
                                async_generation=True, steps_per_generation=1, learning_rate=5e-3, max_steps=5,
                                eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) >= 2 and all(torch.isfinite(torch.tensor(h["eval_loss"])) for h in evals)
    versions = [int(b["policy_version"][0]) for b in trainer.probe.batches]
    assert len(versions) == 5 and all(0 <= step - v <= 1 for step, v in enumerate(versions)), versions
    # one push per distinct policy: an evaluation's push is recorded, so the batch at that step does not push again
    pushed_steps = set(range(5)) | {h["step"] for h in evals}
    assert trainer.vllm_generation.disk_sync.num_syncs == len(pushed_steps), pushed_steps


@pytest.mark.slow
def test_partial_rollout_grows_completions_across_async_rounds(tiny_server, tiny_model_dir, tmp_path):
    """Each round the server grows the unfinished completions by the budget while the trainer trains; completions
    span several rounds and policies, and every token's behaviour log-prob is that of the policy of its version
    (recomputed with the saved policy), which the newest policy no longer matches."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    snapshots = Snapshots()
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, callbacks=[snapshots], max_steps=6,
                               partial_rollout_budget=3, partial_rollout_max_resumes=3, max_completion_length=10,
                               per_device_train_batch_size=16, seed=1,
                               reward=completion_length)  # dense: every step moves the policy
    logs = [h for h in trainer.state.log_history if "partial/segments_per_completion" in h]
    assert len(logs) == 6 and max(h["partial/segments_per_completion"] for h in logs) > 1.5
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    checked, gap = set(), 0.0
    for step, batch in enumerate(probe.batches):
        for i, (prompt, completion, behaviour) in enumerate(completions_of(batch)):
            versions = batch["token_policy_version"][i][: len(completion)]
            if len(set(versions.tolist())) < 2:
                continue
            assert int(versions.max()) < step + 1 and step - int(versions.min()) <= 4  # <= max_resumes + 1 rounds
            for version in set(versions.tolist()):
                model.load_state_dict(snapshots.policies[version])
                logps = sequence_logps(model, prompt, completion, trainer.temperature)
                at = versions == version
                assert torch.allclose(logps[at], behaviour[at], atol=1e-3), (step, version)
                checked.add(version)
            model.load_state_dict(snapshots.policies[step])
            older = versions < step
            newest = sequence_logps(model, prompt, completion, trainer.temperature)
            gap = max(gap, float((newest[older] - behaviour[older]).abs().max()))
    print(f"versions checked: {sorted(checked)}; largest newest-policy gap on older segments: {gap:.3f}")
    assert len(checked) >= 2 and gap > 1e-2


@pytest.mark.slow
def test_partial_rollout_resume_continues_the_saved_pool(tiny_server, tiny_model_dir, tmp_path):
    """The pool (unfinished completions with their tokens) and the prompt stream's position are in the checkpoint:
    the resumed run trains groups that were in flight at the checkpoint, and none that trained before it."""
    reset_server_weights(tiny_server.url, tiny_model_dir)
    out = tmp_path / "out"
    partial = dict(partial_rollout_budget=3, partial_rollout_max_resumes=3, max_completion_length=10,
                   per_device_train_batch_size=16, seed=1)
    _, full = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, save_strategy="steps", save_steps=2,
                        **partial)
    state = torch.load(out / "checkpoint-2" / "async_generation_rank0.pt", weights_only=False)
    assert state["batches_handed"] == 2 and state["stream_position"] >= 3 and state["pool"]["groups"]
    in_flight = {tuple(c["prompt_ids"]) for g in state["pool"]["groups"] for c in g["completions"]}
    _, resumed = async_run(tiny_model_dir, out, tiny_server.url, max_steps=4, resume_from=str(out / "checkpoint-2"),
                           **partial)
    assert len(resumed.batches) == 2

    def prompts(batches):
        return {tuple(p) for b in batches for p, _, _ in completions_of(b)}

    after = prompts(resumed.batches)
    # the first batch after the resume is made of the oldest groups in flight at the checkpoint (measured: 8 of the
    # 8 prompts of both resumed batches come from the saved pool; with the pool dropped, 1 of 8, by coincidence)
    assert prompts(resumed.batches[:1]) <= in_flight
    assert len(after & in_flight) > len(after) // 2
    assert not after & prompts(full.batches[:2])  # nothing trained twice


@pytest.mark.slow
def test_weight_sync_steps_pushes_every_nth_step(tiny_server, tiny_model_dir, tmp_path):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    trainer, probe = async_run(tiny_model_dir, tmp_path, tiny_server.url, max_steps=6, weight_sync_steps=2)
    assert trainer.vllm_generation.disk_sync.num_syncs == 3  # at steps 0, 2 and 4
    versions = [int(b["policy_version"][0]) for b in probe.batches]
    assert set(versions) <= {0, 2, 4} and max(step - v for step, v in enumerate(versions)) == 2, versions


@pytest.mark.slow
@pytest.mark.parametrize("stalled", [0, 2], ids=["first batch", "later batch"])
def test_a_stalled_server_ends_every_process_of_a_two_process_run(stalled, tmp_path):
    """2 processes; the stand-in server (tests/policy_server.py) stalls on the first batch's request, or answers the
    first two batches and stalls on the third (sent while step 1 trains): rank 0's request times out, and both ranks
    end with the error at the next hand-over (rank 1 through the broadcast), before either enters the weight push's
    collectives. A batch is 4 requests here (2 x 8 rows / 4 completions: one seeded request per prompt)."""
    from policy_server import PolicyServer

    from bapo_trl.toy import build_tiny_model
    from launching import REPO, accelerate_launch

    prompts_per_batch = 4
    server = PolicyServer(build_tiny_model(), stall_on=(stalled * prompts_per_batch + 1,))  # the embedded model
    try:
        with pytest.raises(AssertionError) as failed:
            accelerate_launch(
                REPO / "train_bapo.py", "--max_steps", "4", "--per_device_train_batch_size", "8",
                "--num_generations", "4", "--max_completion_length", "8", "--steps_per_generation", "1",
                "--output_dir", tmp_path / "run", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
                server.url, "--vllm_server_timeout", "3", "--async_generation", timeout=600,
                env={"BAPO_VLLM_WEIGHTS_DIR": str(tmp_path)})
    finally:
        server.close()
    text = str(failed.value)
    assert "did not answer /v1/completions within 3 s" in text
    assert "async generation failed on the main process: VLLMServerTimeout" in text  # rank 1's error
    sent = server.requests["POST", "/v1/completions"]
    assert stalled * prompts_per_batch < sent <= (stalled + 1) * prompts_per_batch and not server.resent(), sent
