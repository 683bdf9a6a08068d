"""Seeded requests to the generation server: reproducible, and every sequence draws its own random numbers.

vLLM applies a request's ``seed`` to every prompt of the request (child j of a prompt: seed + j), so one seeded
request holding the same prompt twice samples it twice identically. Partial rollout and in-flight updates send the
members of a group (and later their prefixes) as separate prompts of one request: with one seed per request every
group would be sampled as copies of one completion, every advantage would be zero and nothing would train, silently.
``TRLPort.server_generate`` gives each prompt a seed of its own. Checked on the stand-in (fast) and on a real vLLM
CPU server (slow), where the first test also shows the server's semantics the stand-in copies.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from policy_server import PolicyServer
from test_vllm_server import reset_server_weights

from bapo_trl.generation.cpu_server import HTTPVLLMClient
from bapo_trl.rollout.port import TRLPort, prompt_seeds

PROMPT = [6, 7, 14, 43]  # a reverse-task prompt of the toy tokenizer
COPIES = 8


def port_for(url: str) -> TRLPort:
    """A TRLPort over the few facts server_generate reads of a trainer (its vLLM backend's sampling settings)."""
    client = HTTPVLLMClient(base_url=url, connection_timeout=30, request_timeout=60)
    backend = SimpleNamespace(vllm_client=client, server_timeout=60, repetition_penalty=1.0, temperature=1.0,
                              top_p=1.0, top_k=-1, min_p=0.0, structured_outputs_regex=None, generation_kwargs={})
    return TRLPort(SimpleNamespace(vllm_generation=backend))


def check_seeded_requests(url: str) -> None:
    one_seed = HTTPVLLMClient(base_url=url, connection_timeout=30, request_timeout=60).generate(
        prompts=[PROMPT] * COPIES, n=1, temperature=1.0, max_tokens=8, logprobs=0, generation_kwargs={"seed": 5})
    assert len({tuple(ids) for ids in one_seed["completion_ids"]}) == 1  # the server's semantics: all copies agree

    port = port_for(url)
    first = port.server_generate([PROMPT] * COPIES, 1, 8, seed=5)
    assert len({tuple(ids) for ids in first["completion_ids"]}) > 1, first["completion_ids"]
    assert port.server_generate([PROMPT] * COPIES, 1, 8, seed=5) == first  # reproducible
    assert port.server_generate([PROMPT] * COPIES, 1, 8, seed=6) != first
    grouped = port.server_generate([PROMPT, [12, 14, 8, 43]], 4, 8, seed=5)  # n > 1: prompt-major, 4 each
    assert len(grouped["completion_ids"]) == 8 and len({tuple(ids) for ids in grouped["completion_ids"][:4]}) > 1
    assert all(len(lp) == len(ids) for lp, ids in zip(grouped["logps"], grouped["completion_ids"]))


def test_prompt_seeds_are_reproducible_and_leave_room_for_each_prompts_children():
    seeds = prompt_seeds(5, 64, 4)
    assert seeds == prompt_seeds(5, 64, 4) and seeds != prompt_seeds(6, 64, 4)
    streams = [s + j for s in seeds for j in range(4)]  # vLLM seeds child j with s + j
    assert len(set(streams)) == len(streams) and max(streams) < 2**31


def test_each_prompt_of_a_seeded_request_draws_its_own_numbers_on_the_stand_in(tiny_model_dir):
    server = PolicyServer(tiny_model_dir)
    try:
        check_seeded_requests(server.url)
    finally:
        server.close()


@pytest.mark.slow
def test_each_prompt_of_a_seeded_request_draws_its_own_numbers_on_a_real_vllm_server(tiny_server, tiny_model_dir):
    reset_server_weights(tiny_server.url, tiny_model_dir)
    check_seeded_requests(tiny_server.url)
