"""The disk weight sync in two halves: the write on the sync's writer thread (``write_later``), the servers' load of it
(``load``). Async generation writes each push while the server is still busy and loads it between two requests, so
what must hold is: the server loads exactly the weights written for that push, directories written before a loaded
one go, newer ones (pushes not loaded yet) stay, a failure names its cause and leaves no directory behind.

Against the stand-in server (``tests/support/policy_server.py``), which reloads a safetensors directory as vLLM's
``reload_weights`` does; the real server's reload is checked in ``tests/test_vllm_server.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError, WrittenWeights
from support.policy_server import PolicyServer

pytestmark = pytest.mark.usefixtures("use_test_cache")


@pytest.fixture
def stand_in(tiny_model_dir):
    server = PolicyServer(tiny_model_dir)
    yield server
    server.close()


def shifted(server: PolicyServer, by: float) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() + by for name, p in server.model.state_dict().items()}


def server_holds(server: PolicyServer, state: dict[str, torch.Tensor]) -> bool:
    held = server.model.state_dict()
    return all(torch.equal(held[name], tensor) for name, tensor in state.items())


def test_a_written_push_loads_exactly_its_weights_and_only_older_directories_go(stand_in, tmp_path):
    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path))
    states = [shifted(stand_in, by) for by in (0.1, 0.2, 0.3)]
    written = [sync.write_later(state) for state in states]
    assert all(isinstance(w, WrittenWeights) for w in written)
    directories = [w.directory() for w in written]
    assert len(set(directories)) == 3 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        d.rsplit("/", 1)[1] for d in directories)

    sync.load(written[1])  # the first push was replaced before it was loaded (a newer one was handed over)
    assert server_holds(stand_in, states[1]) and stand_in.reloads == 1
    assert sync.current_dir == directories[1]
    assert sorted(str(p) for p in tmp_path.iterdir()) == sorted(directories[1:])  # the third is still to load

    sync.load(written[2])
    assert server_holds(stand_in, states[2]) and stand_in.reloads == 2
    assert [str(p) for p in tmp_path.iterdir()] == [directories[2]]
    sync.close()
    assert list(tmp_path.iterdir()) == [] and sync.current_dir is None


def test_push_is_write_then_load(stand_in, tmp_path):
    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path))
    state = shifted(stand_in, 0.5)
    assert sync.push(state) >= 0 and sync.last_seconds is not None
    assert server_holds(stand_in, state) and stand_in.requests["POST", "/reset_prefix_cache"] == 1
    assert [str(p) for p in tmp_path.iterdir()] == [sync.current_dir]
    sync.close()


def test_a_prefix_cache_reset_refused_while_blocks_are_held_is_retried_then_an_error(tiny_model_dir, tmp_path):
    """vLLM answers a reset with 200 and ``{"success": false}`` while a running request holds KV blocks (the stand-in
    answers so for its first ``busy_resets``): the sync retries until the cache is really reset, and names the problem
    when it never is, instead of letting later requests reuse prefixes computed by the old weights."""
    server = PolicyServer(tiny_model_dir, busy_resets=2)
    try:
        sync = DiskWeightSync(server.url, timeout=10, root=str(tmp_path))
        state = shifted(server, 0.5)
        sync.push(state)
        assert server_holds(server, state) and server.requests["POST", "/reset_prefix_cache"] == 3
        server.busy_resets = 10**6
        sync.timeout = 0.5
        with pytest.raises(WeightSyncError, match=r"could not reset its prefix cache within 0.5 s"):
            sync.push(shifted(server, 0.7))
        sync.close()
    finally:
        server.close()


@pytest.mark.parametrize("client", ["KeyedVLLMClient", "HTTPVLLMClient"])
def test_the_reset_after_trls_own_push_is_checked_too(client, tiny_model_dir, monkeypatch):
    """TRL's push (NCCL on CUDA) ends with ``vllm_client.reset_prefix_cache()``, whose ``{"success": false}`` TRL
    ignored: later requests reused prefixes computed by the old weights. Both clients the backend builds retry it as
    the disk push does, then name the server; a stalled server is an error too (TRL's session resent and never timed
    out)."""
    import trl.generation.vllm_client as trl_client

    from bapo_trl.generation import http_client

    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)  # only checked, never used here
    server = PolicyServer(tiny_model_dir, busy_resets=2)
    try:
        timeout = {"connection_timeout": 10} if client == "KeyedVLLMClient" else {"request_timeout": 10}
        vllm_client = getattr(http_client, client)(base_url=server.url, **timeout)
        vllm_client.reset_prefix_cache()
        assert server.requests["POST", "/reset_prefix_cache"] == 3
        server.drops["/reset_prefix_cache"] = ["before"]  # an idle connection the server closed (review s9, F5)
        vllm_client.reset_prefix_cache()
        assert server.requests["POST", "/reset_prefix_cache"] == 5
        server.busy_resets = 10**6
        setattr(vllm_client, "reset_timeout" if client == "KeyedVLLMClient" else "request_timeout", 0.3)
        with pytest.raises(WeightSyncError, match=rf"{server.url} could not reset its prefix cache within 0.3 s"):
            vllm_client.reset_prefix_cache()
        server.busy_resets, server.reset_delay = 0, 30.0  # a stalled server: each request is bounded too
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"did not answer /reset_prefix_cache within 1 s"):
            vllm_client.reset_prefix_cache()
        assert time.monotonic() - started < 10
    finally:
        server.close()


def test_trls_weight_transfer_requests_are_not_sent_again_on_cuda(tiny_model_dir, monkeypatch):
    """Review s8, F7: TRL's session resends a POST after a 5xx or a read error (3 times for a 500); a weight-transfer
    request sent again leaves the server's workers waiting for NCCL data that never comes (the push hangs, no error).
    The CUDA client sends those once and fails; other requests keep TRL's retries."""
    import trl.generation.vllm_client as trl_client

    from bapo_trl.generation.http_client import WEIGHT_TRANSFER_PATHS, KeyedVLLMClient

    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)  # only checked, never used here
    server = PolicyServer(tiny_model_dir)
    try:
        client = KeyedVLLMClient(base_url=server.url, connection_timeout=10)
        client.session.get_adapter("http://").max_retries.backoff_factor = 0  # TRL's: 2 s, 4 s, ... between resends
        server.failing = {*WEIGHT_TRANSFER_PATHS, "/v1/completions"}
        for path in WEIGHT_TRANSFER_PATHS:
            with pytest.raises(Exception):
                client._post(f"{server.url}{path}", json={})
            assert server.requests["POST", path] == 1, path
        with pytest.raises(Exception):
            client._post(f"{server.url}/v1/completions", json={})
        assert server.requests["POST", "/v1/completions"] == 4  # TRL's: once, then 3 retries on a 500
    finally:
        server.close()


def test_every_post_of_trls_weight_transfer_is_sent_once():
    """Review s9, F1: the paths TRL's own weight-transfer methods POST (read from its source: a TRL that renames one
    fails here) are those the CUDA client sends once. The list named /init_communicator and /close_communicator, which
    TRL 1.16 does not send: it opens the transfer with /init_weight_transfer_engine, which its session still resent."""
    import inspect
    import re

    from trl.generation.vllm_client import VLLMClient

    from bapo_trl.generation.http_client import WEIGHT_TRANSFER_PATHS

    methods = ("init_communicator", "_start_weight_update", "update_named_params", "update_named_param",
               "_finish_weight_update", "close_communicator")
    posted = {path for name in methods
              for path in re.findall(r'f"\{self\.base_url\}(/[\w/]+)"', inspect.getsource(getattr(VLLMClient, name)))}
    assert posted == set(WEIGHT_TRANSFER_PATHS)


def test_writes_run_on_the_writer_thread_in_push_order(stand_in, tmp_path):
    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path))
    seen = []
    real = sync._write

    def recording(tensors):
        seen.append((threading.current_thread().name, float(next(iter(tensors.values())).flatten()[0])))
        return real(tensors)

    sync._write = recording
    written = [sync.write_later({"w": torch.full((4,), float(i))}) for i in range(5)]
    for w in written:
        w.directory()
    assert [value for _, value in seen] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(name.startswith("bapo-weight-writer") for name, _ in seen)
    sync.close()


def test_a_failed_load_names_the_server_and_removes_only_its_directory(stand_in, tmp_path):
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    sync = DiskWeightSync([stand_in.url, dead], timeout=5, root=str(tmp_path))
    first, second = sync.write_later(shifted(stand_in, 0.1)), sync.write_later(shifted(stand_in, 0.2))
    kept = second.directory()
    with pytest.raises(WeightSyncError, match="127.0.0.1:9 "):
        sync.load(first)
    assert [str(p) for p in tmp_path.iterdir()] == [kept]
    sync.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_raised_by_the_load_and_leaves_no_directory(stand_in, tmp_path):
    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path))
    written = sync.write_later({1: torch.zeros(2)})  # safetensors refuses a name that is not a string, once the
    with pytest.raises(TypeError):  # directory exists: the write removes it and the load raises the write's error
        sync.load(written)
    assert list(tmp_path.iterdir()) == [] and stand_in.reloads == 0
    sync.load(sync.write_later(shifted(stand_in, 0.1)))  # the sync still works
    assert stand_in.reloads == 1 and [str(p) for p in tmp_path.iterdir()] == [sync.current_dir]
    sync.close()


def test_a_push_of_gathered_copies_is_written_without_a_second_copy(tmp_path):
    """A push's gathered weights are already CPU copies the trainer hands over: writing them copies only what
    safetensors cannot write as it is (a view, a tensor sharing storage with an earlier one: tied weights), so a push
    holds one CPU copy of the model while it is written. Live tensors (no hand-over) are all copied, and either way the
    file holds exactly the tensors."""
    from safetensors.torch import load_file

    from bapo_trl.generation.weight_files import writable, write_weights

    base = torch.randn(4, 6)
    gathered = {"owned": torch.randn(3, 5), "tied": base, "tied_again": base, "view": base[:, :3],
                "transposed": torch.randn(5, 3).t()}
    state, copied = writable(gathered.items())
    assert copied == ["tied_again", "view", "transposed"]
    assert state["owned"].data_ptr() == gathered["owned"].data_ptr() and state["tied"].data_ptr() == base.data_ptr()
    for handed_over in (True, False):
        directory = write_weights(gathered, str(tmp_path), "push-", handed_over=handed_over)
        written = load_file(f"{directory}/model.safetensors")
        assert written.keys() == gathered.keys() and all(torch.equal(written[k], v) for k, v in gathered.items())


def test_a_restarted_server_loads_the_last_pushed_weights_again_before_the_next_request(stand_in, tmp_path):
    """A server restarted between two pushes holds its checkpoint's weights; its completions would be stamped with the
    pushed version. The worker extension keeps the name of the weights it loaded last (``bapo_weights_mark``): a
    restarted server holds none, so before the next request it loads the last pushed weights again (once: a server
    that holds them costs one RPC and no reload). After ``close`` (the files gone) nothing is asked."""
    import os

    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path), mark_weights=True)
    try:
        assert sync.reload_if_restarted() == []  # nothing pushed yet
        pushed = shifted(stand_in, 0.5)
        sync.push(pushed)
        assert stand_in.mark == os.path.basename(sync.current_dir)
        assert sync.reload_if_restarted() == [] and stand_in.reloads == 1
        stand_in.restart()
        assert not server_holds(stand_in, pushed)
        assert sync.reload_if_restarted() == [stand_in.url] and server_holds(stand_in, pushed)
        assert stand_in.reloads == 2 and sync.restarts == [stand_in.url]
        assert sync.reload_if_restarted() == [] and stand_in.reloads == 2
    finally:
        sync.close()
    asked = stand_in.requests["RPC", "bapo_weights_mark"]
    assert sync.reload_if_restarted() == [] and stand_in.requests["RPC", "bapo_weights_mark"] == asked


def test_a_server_restarted_without_the_worker_extension_is_taken_for_restarted(stand_in, tmp_path):
    """A server that kept a mark and restarts as a plain vLLM server (no worker extension: the mark's method is gone)
    has restarted too: it loads the last push again, and is not asked afterwards (it can keep no mark)."""
    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path), mark_weights=True)
    try:
        pushed = shifted(stand_in, 0.5)
        sync.push(pushed)
        stand_in.restart()
        stand_in.marks = False
        assert sync.reload_if_restarted() == [stand_in.url] and server_holds(stand_in, pushed)
        asked = stand_in.requests["RPC", "bapo_weights_mark"]
        assert sync.reload_if_restarted() == [] and stand_in.requests["RPC", "bapo_weights_mark"] == asked
    finally:
        sync.close()


def test_a_restarted_server_whose_last_push_was_removed_by_something_else_is_an_error(stand_in, tmp_path):
    """Review s8, F5: the last push's directory removed by something else (a temp-dir cleaner on a long run) and the
    server restarted: it cannot load that push again, and sampling from its checkpoint's weights stamped with the
    pushed version would be silent. The check raises, naming the directory (it skipped every server before)."""
    import shutil

    sync = DiskWeightSync(stand_in.url, timeout=10, root=str(tmp_path), mark_weights=True)
    try:
        sync.push(shifted(stand_in, 0.5))
        shutil.rmtree(sync.current_dir)
        assert sync.reload_if_restarted() == []  # the server still holds it: nothing to load
        stand_in.restart()
        with pytest.raises(WeightSyncError, match=rf"{stand_in.url} lost the weights it loaded last .* is gone"):
            sync.reload_if_restarted()
    finally:
        sync.close()


def test_a_server_restarted_with_another_logprobs_mode_is_refused_before_it_samples(tiny_model_dir, tmp_path):
    """Review s8, F2: a server restarted with vLLM's default ``--logprobs-mode`` (raw_logprobs, before temperature)
    loads the last push again and would then put an offset into every ratio; its mode is checked again, as at start.
    """
    from bapo_trl.generation.http_client import VLLMLogprobsModeError
    from support.harness import tiny_trainer
    from support.server_training import server_config

    server = PolicyServer(tiny_model_dir)
    try:
        trainer = tiny_trainer(tiny_model_dir, server_config(server, tmp_path, max_steps=1))
        generation = trainer.vllm_generation
        assert generation.sampler_logprobs_use is not None
        generation.sync_weights()
        server.restart()
        generation._reload_restarted_servers(everywhere=True)  # the same flags: loaded again, nothing refused
        server.restart()
        server.model_config = {"logprobs_mode": "raw_logprobs"}
        refused = rf"{server.url} runs with `--logprobs-mode raw_logprobs`"
        with pytest.raises(VLLMLogprobsModeError, match=refused):
            generation._reload_restarted_servers(everywhere=True)
        with pytest.raises(VLLMLogprobsModeError, match=refused):  # as found: refused again (review s9, F2)
            generation._reload_restarted_servers(everywhere=True)
        assert generation.disk_sync.restarts == [server.url] * 3
    finally:
        server.close()


def test_a_server_restarted_between_two_pushes_has_its_logprobs_mode_checked_by_the_push(tiny_model_dir, tmp_path):
    """Review s9, F2: TRL pushes right before it generates, so a server restarted during the optimizer step (where
    most of the time goes) gets the next push before any request could find it restarted: the push itself finds the
    mark of the push before gone, and checks the server's ``--logprobs-mode`` before loading (it re-marked the server
    and the restart went unseen). Refused at every push until the server runs with the right flag again."""
    from bapo_trl.generation.http_client import VLLMLogprobsModeError
    from support.harness import tiny_trainer
    from support.server_training import server_config

    server = PolicyServer(tiny_model_dir)
    try:
        generation = tiny_trainer(tiny_model_dir, server_config(server, tmp_path, max_steps=1)).vllm_generation
        generation.sync_weights()
        reloads = server.reloads
        server.restart()
        server.model_config = {"logprobs_mode": "raw_logprobs"}
        for _ in range(2):
            with pytest.raises(VLLMLogprobsModeError, match=rf"{server.url} runs with `--logprobs-mode raw_logprobs`"):
                generation.sync_weights()
            assert server.reloads == reloads  # nothing loaded there
        server.restart()
        server.model_config = {"logprobs_mode": "processed_logprobs"}
        generation.sync_weights()
        generation._reload_restarted_servers(everywhere=True)
        assert server.reloads == reloads + 1 and generation.disk_sync.restarts == [server.url] * 3
    finally:
        server.close()


def test_a_server_without_the_worker_extension_is_not_asked_after_its_first_load(tiny_model_dir, tmp_path):
    server = PolicyServer(tiny_model_dir, marks=False)
    sync = DiskWeightSync(server.url, timeout=10, root=str(tmp_path), mark_weights=True)
    try:
        sync.push(shifted(server, 0.5))
        server.restart()
        assert sync.reload_if_restarted() == [] and server.reloads == 1  # it cannot tell
        sync.push(shifted(server, 0.25))
        assert server.requests["RPC", "bapo_weights_mark"] == 1
    finally:
        sync.close()
        server.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async_k1"])
def test_a_server_restarted_just_after_a_push_samples_from_the_pushed_weights(tiny_model_dir, tmp_path, caplog,
                                                                                asynchronous):
    """Full-weight training through the stand-in server, which restarts (its checkpoint's weights again) just after
    it loaded the second push: the request that follows finds it restarted and it loads that push again, so every
    generation samples from the weights the trainer pushed (synchronous: the sampler/trainer log-prob gap TRL logs
    stays at float32 noise). Seen failing without the check: the generation after the restart sampled from the
    checkpoint's weights."""
    from support.harness import tiny_trainer
    from support.server_training import logp_differences, server_config

    server = PolicyServer(tiny_model_dir)
    try:
        extra = dict(async_generation=True, max_staleness=1) if asynchronous else {}
        trainer = tiny_trainer(tiny_model_dir, server_config(server, tmp_path, max_steps=6, steps_per_generation=1,
                                                             **extra))
        sync = trainer.vllm_generation.disk_sync
        load = sync.load

        def load_then_restart(*args, **kwargs):
            seconds = load(*args, **kwargs)
            if sync.num_syncs == 2:
                server.restart()
            return seconds

        sync.load = load_then_restart
        trainer.train()
        assert sync.restarts == [server.url]
        assert any("did not hold the last pushed weights" in record.getMessage() for record in caplog.records)
        if not asynchronous:
            diffs = logp_differences(trainer)
            assert len(diffs) == 6 and max(diffs) < 1e-4, diffs
    finally:
        server.close()
