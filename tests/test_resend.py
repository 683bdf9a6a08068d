"""A request lost before any answer came back (a keep-alive connection the server closed as it was reused) is sent once
more on a fresh connection, where running it twice is safe; a LoRA load or unload only after asking the server what it
holds. On the stand-in server, which can drop a request's connection before the request runs or after (the answer
lost)."""

from __future__ import annotations

import pytest
import requests
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from bapo_trl.generation.adapter_sync import LOAD, UNLOAD, AdapterPush, AdapterSync
from bapo_trl.generation.http_client import HTTPVLLMClient, VLLMServerTimeout, VLLMServerUnreachable
from bapo_trl.generation.resend import lost_before_answer
from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError
from support.policy_server import PolicyServer

PROMPT = [6, 7, 14, 43]


@pytest.fixture
def server(tiny_model_dir):
    server = PolicyServer(tiny_model_dir)
    yield server
    server.close()


def client_of(server, timeout: float = 30.0) -> HTTPVLLMClient:
    return HTTPVLLMClient(base_url=server.url, connection_timeout=30, request_timeout=timeout)


@pytest.mark.parametrize("how", ["before", "after"])
def test_a_generation_lost_before_its_answer_is_sent_again(server, how):
    """Seeded generation is safe to repeat: lost before it ran, or after (the answer lost), the client sends it once
    more and gets the completions the first request would have given."""
    client = client_of(server)
    sampling = dict(n=2, max_tokens=6, logprobs=0, generation_kwargs={"seed": 3})
    expected = client.generate(prompts=[PROMPT], **sampling)
    server.drops["/v1/completions"] = [how]
    assert client.generate(prompts=[PROMPT], **sampling) == expected
    assert server.requests["POST", "/v1/completions"] == 3  # the first call, then the lost request and its resend


def test_a_request_lost_twice_in_a_row_is_an_error_naming_the_server(server):
    client = client_of(server)
    server.drops["/v1/completions"] = ["before", "before"]
    with pytest.raises(VLLMServerUnreachable, match=server.url):
        client.generate(prompts=[PROMPT], n=1, max_tokens=2, logprobs=0)


def test_a_stalled_request_is_never_sent_again(tiny_model_dir):
    stalled = PolicyServer(tiny_model_dir, stall_on=(1,))
    try:
        with pytest.raises(VLLMServerTimeout):
            client_of(stalled, timeout=1.0).generate(prompts=[PROMPT], n=1, max_tokens=2, logprobs=0)
        assert stalled.requests["POST", "/v1/completions"] == 1
    finally:
        stalled.close()


def test_a_server_that_is_gone_is_not_retried(server):
    url = server.url
    server.close()
    with pytest.raises(requests.ConnectionError) as error:
        requests.get(f"{url}/health", timeout=5)
    assert not lost_before_answer(error.value)  # refused: the server is gone, not a lost request


def test_a_weight_reload_lost_before_its_answer_is_sent_again(server, tiny_model_dir, tmp_path):
    sync = DiskWeightSync(server.url, timeout=30, root=str(tmp_path))
    try:
        server.drops["/collective_rpc"] = ["before"]
        sync.push(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
        assert server.reloads == 1 and server.requests["RPC", "reload_weights"] == 1
    finally:
        sync.close()


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
@pytest.mark.parametrize("how", ["before", "after"])
def test_a_lost_adapter_load_or_unload_is_sent_again_only_if_it_did_not_run(server, tiny_model_dir, tmp_path,
                                                                            path, how):
    """A LoRA (un)load lost before its answer: the client asks the server which adapters it serves; one that ran
    (lost after) is not sent again (vLLM would refuse a second load of the name), one that did not is."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    sync = AdapterSync(server.url, model.peft_config["default"].to_dict(), lambda name: None, root=str(tmp_path))
    try:
        sync.push(AdapterPush(adapter))
        first = sync.active_name
        server.drops[path] = [how]
        sync.push(AdapterPush({k: v + 1 for k, v in adapter.items()}))  # loads the new, then unloads the first
        assert set(server.adapters) == {sync.active_name} and first not in server.adapters
        runs = 1 if how == "after" else 2  # the request that ran, and, where it did not, its resend
        assert server.requests["POST", path] == (2 if path == LOAD else 1) - 1 + runs
        # asked twice: before the load, whether the server still holds the adapter (a restart), and for the lost one
        assert server.requests["GET", "/v1/models"] == 2
    finally:
        sync.close()


def test_an_adapter_load_refused_for_a_name_it_holds_is_still_an_error(server, tiny_model_dir, tmp_path):
    """Only a lost request is checked against the server's adapters: an answered refusal stays an error."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    sync = AdapterSync(server.url, model.peft_config["default"].to_dict(), lambda name: None, root=str(tmp_path))
    try:
        sync.push(AdapterPush(get_peft_model_state_dict(model)))
        with pytest.raises(WeightSyncError, match="already been loaded"):
            sync._lora_call(LOAD, "again", server.url, sync.active_name, {"lora_path": sync.current_dir})
    finally:
        sync.close()
