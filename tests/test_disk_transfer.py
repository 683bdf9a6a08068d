"""The disk ``WeightTransferProtocol`` for TRL's ``AsyncGRPOTrainer`` (bapo_trl.generation.disk_transfer), on the
in-process STAND-IN server (tests/support/policy_server.py): TRL's protocol methods in TRL's order give the server the
streamed weights, with the pause that holds requests, the reset after it (checked), and the resume."""

from __future__ import annotations

import inspect

import pytest
import torch

from bapo_trl.generation.disk_transfer import DiskWeightTransfer
from bapo_trl.generation.weight_sync import WeightSyncError
from support.policy_server import PolicyServer
from support.server_training import load_weights

pytestmark = pytest.mark.usefixtures("use_test_cache")


def test_it_implements_trls_weight_transfer_protocol():
    from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol

    wanted = {name for name, _ in inspect.getmembers(WeightTransferProtocol, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"init_weight_transfer", "pause", "send_weights", "resume", "destroy"}
    for name in wanted:
        assert list(inspect.signature(getattr(DiskWeightTransfer, name)).parameters) == list(
            inspect.signature(getattr(WeightTransferProtocol, name)).parameters), name


def test_a_sync_reaches_the_server_as_trls_protocol_drives_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir)
    transfer = DiskWeightTransfer(server.url, timeout=30)
    try:
        transfer.init_weight_transfer()
        posted, post = [], transfer.sync._post
        monkeypatch.setattr(transfer.sync, "_post", lambda path, *a, **k: posted.append(path) or post(path, *a, **k))
        generator = torch.Generator().manual_seed(0)
        moved = {k: v + 0.01 * torch.randn(v.shape, generator=generator)
                 for k, v in load_weights(tiny_model_dir).items()}
        transfer.pause()
        transfer.send_weights(iter(moved.items()))  # TRL streams (name, tensor) pairs under checkpoint names
        transfer.resume()
        served = dict(server.model.named_parameters())
        assert all(torch.equal(served[name].detach(), value) for name, value in moved.items())
        assert posted == ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache", "/resume"], posted
        assert transfer.syncs == 1
    finally:
        transfer.destroy()
        server.close()
    assert not list(tmp_path.glob("bapo-vllm-weights-*"))  # the directories go with the transfer


def test_a_server_that_keeps_blocks_through_the_pause_fails_the_sync_naming_it(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM 0.32's keep-mode pause clears its caches (the reset after it answers success: measured on the CPU server
    with requests held). A server whose pause kept blocks answers ``success: false``: later requests would reuse
    prefixes computed by the old weights, so the sync fails, naming the server, instead of going on (or retrying
    until its timeout while the requests stay held)."""
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, busy_resets=1)
    transfer = DiskWeightTransfer(server.url, timeout=30)
    try:
        transfer.init_weight_transfer()
        transfer.pause()
        with pytest.raises(WeightSyncError, match=rf"{server.url} kept KV blocks through its pause"):
            transfer.send_weights(iter(load_weights(tiny_model_dir).items()))
        assert server.requests["POST", "/reset_prefix_cache"] == 1  # once: not retried
        transfer.resume()
    finally:
        transfer.destroy()
        server.close()
