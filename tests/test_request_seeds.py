"""Seeded generation calls: reproducible, and every sequence draws its own random numbers.

vLLM applies a request's ``seed`` to every prompt of the request (child j of a prompt: seed + j), so one seeded
request holding the same prompt twice samples it twice identically. Partial rollout, in-flight updates and TRL's
colocated engine send the members of a group (and later their prefixes) as separate prompts of one call: with one seed
per call (a request seed, or the user's ``seed`` in ``generation_kwargs``) every group would be sampled as copies of
one completion, every advantage would be zero and nothing would train, silently. Every seeded call with several
prompts is sent one request per prompt, each with a seed of its own (``bapo_trl.generation.seeding``), all at once.
Checked on the stand-in (fast) and on a real vLLM CPU server (slow), where the first check also shows the server's
semantics the stand-in copies.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import requests

from bapo_trl import BAPOConfig
from bapo_trl.generation.fleet import ServerFleet
from bapo_trl.generation.http_client import HTTPVLLMClient
from bapo_trl.generation.seeding import SeededEngine, per_prompt_seeds, prompt_seeds, seed_salt
from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration
from bapo_trl.trainer.trl_port import TRLPort
from support.policy_server import PolicyServer
from support.server_training import reset_server_weights

PROMPT = [6, 7, 14, 43]  # a reverse-task prompt of the toy tokenizer
COPIES = 8


def port_for(url: str, **generation_kwargs) -> TRLPort:
    """A TRLPort whose generation backend is TRL's vLLM backend as bapo_trl builds it, holding only the few facts its
    ``sample`` reads (the client and the sampling settings; TRL's constructor, which needs a model, not run)."""
    backend = object.__new__(BAPOVLLMGeneration)
    backend.__dict__.update(
        vllm_client=HTTPVLLMClient(base_url=url, connection_timeout=30, request_timeout=60), server_timeout=60,
        repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, structured_outputs_regex=None,
        generation_kwargs=generation_kwargs)
    port = TRLPort(SimpleNamespace(vllm_generation=backend, args=BAPOConfig(output_dir="unused", use_cpu=True)))
    port._backend = backend  # what generation_backend="vllm" builds (trainer_vllm_backend)
    return port


def distinct(output: dict) -> int:
    return len({tuple(ids) for ids in output["completion_ids"]})


def check_seeded_requests(url: str) -> None:
    # The server's semantics, in one raw request: all copies of a prompt agree under one seed.
    raw = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": HTTPVLLMClient(base_url=url, connection_timeout=30).model, "prompt": [PROMPT] * COPIES, "n": 1,
        "temperature": 1.0, "max_tokens": 8, "seed": 5, "logprobs": 0, "return_token_ids": True}).json()
    assert len({tuple(choice["token_ids"]) for choice in raw["choices"]}) == 1

    # The client (TRL's own generation path in server mode): the user's seed no longer collapses the copies.
    client = HTTPVLLMClient(base_url=url, connection_timeout=30, request_timeout=60)
    sampling = dict(n=1, temperature=1.0, max_tokens=8, logprobs=0)
    seeded = client.generate(prompts=[PROMPT] * COPIES, generation_kwargs={"seed": 5}, **sampling)
    assert distinct(seeded) > 1, seeded["completion_ids"]
    assert client.generate(prompts=[PROMPT] * COPIES, generation_kwargs={"seed": 5}, **sampling) == seeded
    assert client.generate(prompts=[PROMPT] * COPIES, generation_kwargs={"seed": 6}, **sampling) != seeded

    # The rollout port: a request seed, a user seed, and both.
    port = port_for(url)
    first = port.sample([PROMPT] * COPIES, 1, 8, seed=5)
    assert distinct(first) > 1, first["completion_ids"]
    assert port.sample([PROMPT] * COPIES, 1, 8, seed=5) == first  # reproducible
    assert port.sample([PROMPT] * COPIES, 1, 8, seed=6) != first
    grouped = port.sample([PROMPT, [12, 14, 8, 43]], 4, 8, seed=5)  # n > 1: prompt-major, 4 each
    assert len(grouped["completion_ids"]) == 8 and len({tuple(ids) for ids in grouped["completion_ids"][:4]}) > 1
    assert all(len(lp) == len(ids) for lp, ids in zip(grouped["logps"], grouped["completion_ids"]))
    for request_seed in (None, 5):  # a continuation chunk has no request seed; a request has one
        user = port_for(url, seed=7).sample([PROMPT] * COPIES, 1, 8, seed=request_seed)
        assert distinct(user) > 1, user["completion_ids"]
        assert port_for(url, seed=7).sample([PROMPT] * COPIES, 1, 8, seed=request_seed) == user
        assert port_for(url, seed=8).sample([PROMPT] * COPIES, 1, 8, seed=request_seed) != user
    assert port_for(url, seed=7).sample([PROMPT] * COPIES, 1, 8, seed=5) != first  # the user's seed counts


def test_prompt_seeds_are_reproducible_and_leave_room_for_each_prompts_children():
    seeds = prompt_seeds(5, 64, 4)
    assert seeds == prompt_seeds(5, 64, 4) and seeds != prompt_seeds(6, 64, 4)
    streams = [s + j for s in seeds for j in range(4)]  # vLLM seeds child j with s + j
    assert len(set(streams)) == len(streams) and max(streams) < 2**31


def test_a_calls_seeds_depend_on_its_seed_and_its_prompts():
    copies = per_prompt_seeds(5, [PROMPT] * COPIES, 1)
    assert len(set(copies)) == COPIES and copies == per_prompt_seeds(5, [PROMPT] * COPIES, 1)
    assert copies != per_prompt_seeds(6, [PROMPT] * COPIES, 1)
    assert copies != per_prompt_seeds(5, [PROMPT + [1]] * COPIES, 1)  # another call's prompts: other streams


def test_each_prompt_of_a_seeded_request_draws_its_own_numbers_on_the_stand_in(tiny_model_dir):
    server = PolicyServer(tiny_model_dir)
    try:
        check_seeded_requests(server.url)
        # one request per prompt, each with its own seed; an unseeded call stays one request
        seeds = [body[2] for body in server.bodies[-COPIES:]]
        assert len(set(seeds)) == COPIES and all(len(body[0]) == 1 for body in server.bodies[-COPIES:])
        before = len(server.bodies)
        HTTPVLLMClient(base_url=server.url, connection_timeout=30, request_timeout=60).generate(
            prompts=[PROMPT] * COPIES, n=1, max_tokens=2, logprobs=0)
        assert len(server.bodies) == before + 1 and server.bodies[-1][2] is None
    finally:
        server.close()


def test_a_fleet_derives_the_same_seeds_as_one_server(tiny_model_dir):
    """Seeds are derived once, by the outermost client: the same call samples the same completions on one server and
    on two (the fleet sends each per-prompt request to the least-loaded server)."""
    servers = [PolicyServer(tiny_model_dir) for _ in range(2)]
    try:
        clients = [HTTPVLLMClient(base_url=s.url, connection_timeout=30, request_timeout=60) for s in servers]
        sampling = dict(n=2, temperature=1.0, max_tokens=6, logprobs=0, generation_kwargs={"seed": 3})
        alone = clients[0].generate(prompts=[PROMPT] * COPIES, **sampling)
        fleet = ServerFleet(clients)
        spread = fleet.generate(prompts=[PROMPT] * COPIES, **sampling)
        assert spread["completion_ids"] == alone["completion_ids"] and distinct(alone) > 1
        assert all(count > 0 for count in fleet.prompts_sent)
        assert fleet.requests.answered == COPIES
    finally:
        for server in servers:
            server.close()


class BarrierServer(PolicyServer):
    """A STAND-IN for a server that batches concurrent requests: every generate request waits until ``expected``
    requests are in flight at once (or ``patience`` seconds pass), so a client that sends a batch in waves is caught
    without a clock: its first wave waits out the patience, its answers carry ``full = False``."""

    def __init__(self, model_dir: str, expected: int, patience: float = 20.0):
        super().__init__(model_dir)
        self.barrier = threading.Barrier(expected, timeout=patience)
        self.full: list[bool] = []

    def complete(self, body: dict) -> dict:
        try:
            self.barrier.wait()
            self.full.append(True)
        except threading.BrokenBarrierError:
            self.full.append(False)
        return super().complete(body)


def test_a_seeded_batch_larger_than_64_prompts_is_in_flight_at_once(tiny_model_dir):
    """TRL keeps 64 connections and sends its own concurrent requests 64 at a time; a seeded batch here is one request
    per prompt, all in flight at once (vLLM batches them), so a batch of 100 is never 2 waves."""
    prompts = 100
    server = BarrierServer(tiny_model_dir, expected=prompts)
    try:
        client = HTTPVLLMClient(base_url=server.url, connection_timeout=30, request_timeout=60)
        output = client.generate(prompts=[PROMPT] * prompts, n=1, max_tokens=1, logprobs=0,
                                 generation_kwargs={"seed": 1})
        assert len(output["completion_ids"]) == prompts
        assert server.full == [True] * prompts, f"{server.full.count(False)} requests waited for a later wave"
        assert client.requests.answered == prompts
    finally:
        server.close()


class RecordingEngine:
    """A STAND-IN for ``vllm.LLM``: records the sampling params each prompt gets."""

    def __init__(self):
        self.calls = []
        self.other = "engine attribute"

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append(sampling_params)
        return ["output"] * len(prompts)


def test_the_colocated_engine_wrapper_with_a_stand_in_sampling_params():
    class Params(SimpleNamespace):  # a STAND-IN for vllm.SamplingParams: clone() and a seed, n
        def clone(self):
            return Params(**vars(self))

    engine = RecordingEngine()
    wrapped = SeededEngine(engine)
    prompts = [{"prompt_token_ids": PROMPT}] * 4
    assert wrapped.generate(prompts, sampling_params=Params(seed=9, n=1), use_tqdm=False) == ["output"] * 4
    seeds = [p.seed for p in engine.calls[-1]]
    assert seeds == per_prompt_seeds(9, [PROMPT] * 4, 1) and len(set(seeds)) == 4
    wrapped.generate(prompts, sampling_params=Params(seed=None, n=1))  # unseeded: the params as given
    assert engine.calls[-1].seed is None
    wrapped.generate(prompts[:1], sampling_params=Params(seed=9, n=1))  # one prompt keeps its seed
    assert engine.calls[-1].seed == 9
    assert wrapped.other == "engine attribute"


def test_a_salt_gives_the_same_prompts_other_seeds_one_prompt_included():
    """The trainer's salt (step, call in the step, engine group): two colocated engines holding the same prompts, or
    the same prompts in another step, draw other numbers; a call of one prompt too (TRL spreads a group of 2 over 2
    processes as one copy each)."""
    class Params(SimpleNamespace):  # a STAND-IN for vllm.SamplingParams
        def clone(self):
            return Params(**vars(self))

    engine = RecordingEngine()
    wrapped = SeededEngine(engine)
    drawn = {}
    for salt in [(0, 0, 0), (0, 0, 1), (1, 0, 0), (0, 1, 0)]:  # (step, call, group)
        for count in (1, 2):
            with seed_salt(*salt):
                wrapped.generate([{"prompt_token_ids": PROMPT}] * count, sampling_params=Params(seed=9, n=1))
            params = engine.calls[-1]
            drawn[salt, count] = tuple(p.seed for p in params) if isinstance(params, list) else (params.seed,)
    seeds = [s for key in drawn.values() for s in key]
    assert len(set(seeds)) == len(seeds), drawn
    with seed_salt(0, 0, 1):  # reproducible
        wrapped.generate([{"prompt_token_ids": PROMPT}] * 2, sampling_params=Params(seed=9, n=1))
    assert tuple(p.seed for p in engine.calls[-1]) == drawn[(0, 0, 1), 2]


def test_a_salted_call_is_derived_once_on_a_fleet_as_on_one_server(tiny_model_dir):
    servers = [PolicyServer(tiny_model_dir) for _ in range(2)]
    try:
        clients = [HTTPVLLMClient(base_url=s.url, connection_timeout=30, request_timeout=60) for s in servers]
        for count in (1, 3):
            sampling = dict(n=2, temperature=1.0, max_tokens=6, logprobs=0, generation_kwargs={"seed": 3})
            with seed_salt(4, 0, 0):
                alone = clients[0].generate(prompts=[PROMPT] * count, **sampling)
                spread = ServerFleet(clients).generate(prompts=[PROMPT] * count, **sampling)
            assert spread["completion_ids"] == alone["completion_ids"]
        sent = [body[2] for server in servers for body in server.bodies]
        assert 3 not in sent  # the user's seed itself never reaches a server inside a salt
    finally:
        for server in servers:
            server.close()


def test_a_user_seed_samples_a_repeated_prompt_anew_at_every_step(tiny_model_dir, tmp_path):
    """TRL's generation through a server with `generation_kwargs={"seed": ...}` and a data set of one prompt (every
    generation batch the same prompts in the same order): each batch's requests carry other seeds (the step is in the
    salt), so batches are not replays of the first."""
    from support.harness import tiny_trainer
    from support.server_training import server_config

    server = PolicyServer(tiny_model_dir)
    try:
        args = server_config(server, tmp_path, steps_per_generation=1, max_steps=3, shuffle_dataset=False,
                             generation_kwargs={"seed": 11})
        tiny_trainer(tiny_model_dir, args, prompts=2).train()
        seeds = [body[2] for body in server.bodies]  # 2 prompts a batch, one request each
        assert len(seeds) == 6 and None not in seeds and len(set(seeds)) == 6, seeds
    finally:
        server.close()


@pytest.mark.slow
def test_each_prompt_of_a_seeded_request_draws_its_own_numbers_on_a_real_vllm_server(tiny_server, tiny_model_dir):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    check_seeded_requests(tiny_server.url)


class StandInParams(SimpleNamespace):
    """A STAND-IN for ``vllm.SamplingParams``: a seed, n and ``clone()``."""

    def clone(self):
        return StandInParams(**vars(self))


def colocated_backend(monkeypatch, process_index: int, tensor_parallel_size: int, steps: list[int]):
    """The trainer's vLLM backend in colocate mode at ``process_index``, its engine a RecordingEngine STAND-IN behind
    the seeding wrapper; TRL's colocate generation is a STAND-IN sending every prompt row to the engine with the
    user's seed (as TRL builds its SamplingParams; with tensor parallelism, the rows of the whole group, gathered)."""
    from trl.generation.vllm_generation import VLLMGeneration

    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration

    def trl_generate(self, prompts, images, num_generations, profiler=None):
        params = StandInParams(n=1, **self.generation_kwargs)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params)

    monkeypatch.setattr(VLLMGeneration, "generate", trl_generate)
    backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
    backend.mode, backend.generation_kwargs = "colocate", {"seed": 9}
    backend.tensor_parallel_size = tensor_parallel_size
    backend.accelerator = SimpleNamespace(process_index=process_index)
    backend.seed_round, backend._round_calls = lambda: steps[-1], (None, 0)
    backend.llm = SeededEngine(RecordingEngine())
    return backend


def generated_seeds(backend, prompts) -> list[int]:
    backend.generate(prompts, None, 1)
    return [p.seed for p in backend.llm._llm.calls[-1]]


def salted_seeds(prompts, *salt) -> list[int]:
    with seed_salt(*salt):
        return per_prompt_seeds(9, prompts, 1)


@pytest.mark.parametrize("tensor_parallel_size, groups", [(1, [0, 1]), (2, [0, 0, 1, 1])])
def test_a_colocated_process_seeds_its_prompts_with_its_engine_group(tensor_parallel_size, groups, monkeypatch):
    """Colocate mode with a user seed: process i salts its seeds with its engine group, i // tensor_parallel_size.
    Separate engines holding the same prompts (TRL spreads a group's copies over processes) draw other seeds, else
    they sample copies; the ranks of one tensor-parallel engine hold the same gathered prompts and must send the same
    seeds, or their shared engine gets conflicting requests."""
    prompts = [PROMPT] * 2
    seeds = [generated_seeds(colocated_backend(monkeypatch, index, tensor_parallel_size, [0]), prompts)
             for index in range(len(groups))]
    by_group = {group: salted_seeds(prompts, 0, 0, group) for group in range(len(groups))}  # (step, call, group)
    used = [next((group for group, drawn in by_group.items() if drawn == one), None) for one in seeds]
    assert used == groups, f"engine groups of processes 0..{len(groups) - 1} (tensor parallel {tensor_parallel_size})"


def test_two_seeded_calls_in_one_step_draw_other_seeds_and_the_count_restarts_each_step(monkeypatch):
    """Two generate calls in one optimizer step (partial rollout's continuation, a second generation batch) with the
    same prompts: the call's index in the step is in the salt, so the second call is not a replay of the first; the
    next step counts from 0 again (its step differs)."""
    steps = [3]
    backend = colocated_backend(monkeypatch, 0, 1, steps)
    prompts = [PROMPT] * 2
    first, second = generated_seeds(backend, prompts), generated_seeds(backend, prompts)
    assert first != second, "the second call of the step replayed the first call's seeds"
    assert [first, second] == [salted_seeds(prompts, 3, 0, 0), salted_seeds(prompts, 3, 1, 0)]
    steps.append(4)
    assert generated_seeds(backend, prompts) == salted_seeds(prompts, 4, 0, 0)
