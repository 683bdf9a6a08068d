"""The sampler's log-probs (issue 44, items 4 and 6).

* **The server's log-prob mode.** Wherever training uses the log-probs vLLM returns for the sampled tokens (async
  generation: as the behaviour log-probs; TRL's importance-sampling correction and off-policy mask: against the
  trainer's), every server must report ``--logprobs-mode processed_logprobs``: vLLM's default, ``raw_logprobs``, is
  taken before temperature, and every ratio would carry an offset. A stand-in server reporting ``raw_logprobs`` (the
  guarantees matrix's new dimension), or no mode at all, is refused at start-up, before anything is written or
  generated, naming the server and the flag; the second server of a fleet as well as the first, on CUDA's client
  too, and on every process of a 2-process launch (slow tier).
* **A NaN sampling log-prob** (vLLM's answer for a token it could not score) drops the token from the loss only where
  the sampler's log-prob IS the behaviour log-prob (async generation, its in-flight chunks and partial rollout). On
  the synchronous paths (TRL's generation, partial rollout through it) the behaviour log-prob is the trainer's own
  and TRL trains the token with IS weight 1: BAPO's gradient there equals TRL's own loss's gradient on the same batch.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from bapo_trl import BAPOTrainer
from bapo_trl.core.numerics import loss_mask
from bapo_trl.generation.http_client import VLLMLogprobsModeError, check_logprobs_mode
from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration
from bapo_trl.rollout.settings import sampler_logprobs_use
from support.harness import cpu_config, tiny_trainer
from support.policy_server import PolicyServer

pytestmark = pytest.mark.usefixtures("use_test_cache")
RAW = "raw_logprobs"
FLAG = "`--logprobs-mode processed_logprobs` (`bapo serve` and `trl vllm-serve` set it)"
NONFINITE = "bapo/nonfinite_tokens"


def spread_reward(completions, **kwargs) -> list[float]:
    """A reward with spread inside the groups of a random-ish policy (so advantages, and gradients, are not zero)."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def build(model_dir: str, out, servers, **overrides) -> BAPOTrainer:
    """A BAPOTrainer in server mode against ``servers`` (constructing it connects and runs the start-up checks)."""
    settings = dict(save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                    max_steps=1, logging_steps=1, seed=0, disable_tqdm=True, use_vllm=True, vllm_mode="server",
                    vllm_server_base_url=",".join(s.url for s in servers), vllm_server_timeout=30)
    return tiny_trainer(model_dir, cpu_config(out, **{**settings, **overrides}), reward=spread_reward, prompts=32,
                        prompt_seed=0)


@pytest.fixture
def stand_ins(tiny_model_dir, tmp_path, monkeypatch):
    """Factory of stand-in servers (closed at the end); the weight directory under tmp_path."""
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    made = []

    def make(**kwargs) -> PolicyServer:
        made.append(PolicyServer(tiny_model_dir, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def nothing_done(server: PolicyServer) -> bool:
    """No generate request, weight reload or directory probe reached the server (only GETs)."""
    return not any(key[0] in ("POST", "RPC") for key in server.requests)


# -- item 4: every server's log-prob mode, at start-up ----------------------------------------------------------------

USES = {
    "async": (dict(async_generation=True, vllm_importance_sampling_correction=False),
              "async generation trains with them as the behaviour log-probs"),
    "sync_is_corrected": (dict(), "TRL's importance-sampling correction (`vllm_importance_sampling_correction`)"),
    "sync_off_policy_mask": (dict(vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.5),
                             "TRL's off-policy sequence mask (`off_policy_mask_threshold`)"),
    "async_partial": (dict(async_generation=True, partial_rollout_budget=3), "async generation"),
    "partial_is_corrected": (dict(partial_rollout_budget=3), "TRL's importance-sampling correction"),
    "own_source": (dict(rollout_source="mine", vllm_importance_sampling_correction=False),
                   "the rollout source 'mine' (`rollout_source`) may train with them"),
}


@pytest.mark.parametrize("use", list(USES))
def test_a_server_reporting_raw_logprobs_is_refused_at_start_up(use, stand_ins, tiny_model_dir, tmp_path,
                                                                monkeypatch):
    from bapo_trl.rollout import registry
    from bapo_trl.rollout.trl_generation import TRLGeneration

    monkeypatch.setitem(registry._SOURCES, "mine", TRLGeneration)  # a source of the user's (which may call the server)
    settings, says = USES[use]
    server = stand_ins(logprobs_mode=RAW)
    with pytest.raises(VLLMLogprobsModeError) as info:
        build(tiny_model_dir, tmp_path / "out", [server], **settings)
    message = str(info.value)
    assert f"the vLLM server at {server.url} runs with `--logprobs-mode {RAW}`" in message
    assert says in message and FLAG in message
    assert nothing_done(server), server.requests  # refused before any weights were written or generated


def test_the_second_server_of_a_fleet_is_checked_too(stand_ins, tiny_model_dir, tmp_path):
    """TRL reads (and warns about) the first server only; here the second one reports raw log-probs."""
    servers = [stand_ins(), stand_ins(logprobs_mode=RAW)]
    with pytest.raises(VLLMLogprobsModeError) as info:
        build(tiny_model_dir, tmp_path / "out", servers, async_generation=True)
    message = str(info.value)
    assert f"the vLLM server at {servers[1].url} runs with `--logprobs-mode {RAW}`" in message and FLAG in message
    assert servers[0].url not in message  # the first one is fine
    assert all(s.requests["GET", "/server_info"] == 1 for s in servers)
    assert all(nothing_done(s) for s in servers)


def test_a_server_that_reports_no_mode_is_refused(stand_ins, tiny_model_dir, tmp_path):
    """No ``logprobs_mode`` in /server_info (a vLLM older than the field, or not vLLM): refused, as its log-probs
    cannot be shown to be the sampling distribution's."""
    server = stand_ins(logprobs_mode=None)
    with pytest.raises(VLLMLogprobsModeError, match=r"reports no `logprobs_mode` in /server_info") as info:
        build(tiny_model_dir, tmp_path / "out", [server], async_generation=True)
    assert server.url in str(info.value) and FLAG in str(info.value)


def test_where_no_sampler_log_prob_is_used_any_mode_will_do(stand_ins, tiny_model_dir, tmp_path):
    """Synchronous generation without TRL's correction or off-policy mask ignores the sampler's log-probs."""
    server = stand_ins(logprobs_mode=RAW)
    trainer = build(tiny_model_dir, tmp_path / "out", [server], vllm_importance_sampling_correction=False)
    assert trainer.vllm_generation.sampler_logprobs_use is None
    assert server.requests["GET", "/server_info"] == 0


def test_processed_servers_pass(stand_ins, tiny_model_dir, tmp_path):
    servers = [stand_ins(), stand_ins()]
    trainer = build(tiny_model_dir, tmp_path / "out", servers, async_generation=True)
    assert trainer.vllm_generation.sampler_logprobs_use.startswith("async generation")
    assert all(s.requests["GET", "/server_info"] >= 1 for s in servers)


def test_the_check_reads_every_server_through_trls_client_on_cuda_too(stand_ins, monkeypatch):
    """On CUDA TRL builds the client itself (``_cuda_client``: TRL's own ``VLLMClient`` sending the key, a fleet for
    several); the backend checks every server after TRL's ``_init_vllm``. Never run on CUDA here: TRL's part (its
    NCCL communicator) is replaced by building the client as TRL calls it."""
    import trl.generation.vllm_client as trl_client
    import trl.generation.vllm_generation as trl_generation
    from trl.generation.vllm_generation import VLLMGeneration

    servers = [stand_ins(), stand_ins(logprobs_mode=RAW)]
    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)  # only checked, never used here

    def trl_init(self):
        self.vllm_client = trl_generation.VLLMClient(base_url=[s.url for s in servers], group_port=51216,
                                                     connection_timeout=5)

    monkeypatch.setattr(VLLMGeneration, "_init_vllm", trl_init)
    monkeypatch.setattr(BAPOVLLMGeneration, "uses_disk_sync", property(lambda self: False))
    backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
    backend.mode, backend.sampler_logprobs_use = "server", sampler_logprobs_use(SimpleNamespace(async_generation=True))
    backend.accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    with pytest.raises(VLLMLogprobsModeError, match=f"the vLLM server at {servers[1].url} runs with"):
        backend._init_vllm()
    assert type(backend.vllm_client.clients[1]).__name__ == "KeyedVLLMClient"


def test_another_process_raises_the_main_process_refusal_as_the_same_error(monkeypatch):
    """What a rank other than the main one raises when the main process's check failed (broadcast stood in for; the
    2-process launch below runs it for real)."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda box, from_process: box.__setitem__(
        0, ("VLLMLogprobsModeError", "the vLLM server at http://a:1 runs with `--logprobs-mode raw_logprobs`")))
    backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
    backend.accelerator = SimpleNamespace(is_main_process=False, num_processes=2)
    with pytest.raises(VLLMLogprobsModeError, match=r"on the main process: VLLMLogprobsModeError: .*http://a:1"):
        backend._raise_everywhere(None)


def test_a_client_error_names_the_server(stand_ins):
    """A server that answers /server_info with an error (no dev mode: 404) is named in the error."""
    from bapo_trl.generation.http_client import HTTPVLLMClient

    server = stand_ins()

    class NoDevMode(HTTPVLLMClient):
        def get_server_info(self):
            raise Exception("Request failed: 404")  # TRL's client's bare error, which does not name the server

    with pytest.raises(RuntimeError, match=f"the vLLM server at {server.url} failed: Exception: Request failed"):
        check_logprobs_mode(NoDevMode(base_url=server.url, connection_timeout=5, request_timeout=5), "x")


@pytest.mark.slow
def test_every_process_of_a_launch_is_stopped(stand_ins, tiny_model_dir, tmp_path):
    """2 processes (accelerate launch), the second server of two reporting raw log-probs: both ranks raise the
    refusal at construction, none hangs in a collective waiting for the main process."""
    from support.launching import REPO, accelerate_launch

    servers = [stand_ins(), stand_ins(logprobs_mode=RAW)]
    accelerate_launch(REPO / "tests" / "dist_scripts" / "logprobs_mode_refusal.py", tiny_model_dir,
                      ",".join(s.url for s in servers), tmp_path, timeout=600)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2 and record["error"] == "VLLMLogprobsModeError", record
        assert f"{servers[1].url} runs with `--logprobs-mode {RAW}`" in record["message"], record
    assert all(nothing_done(s) for s in servers)


@pytest.mark.slow
def test_the_real_server_reports_processed_logprobs(tiny_server):
    """The project's serve command, on the real vLLM CPU server: the field is where the check reads it."""
    from bapo_trl.generation.http_client import HTTPVLLMClient, server_logprobs_mode

    client = HTTPVLLMClient(base_url=tiny_server.url, connection_timeout=30, request_timeout=30)
    assert server_logprobs_mode(client) == "processed_logprobs"
    check_logprobs_mode(client, "a test")


# -- item 6: a NaN sampling log-prob --------------------------------------------------------------------------------

#: rollout source -> (settings, whether the sampler's log-prob is the behaviour log-prob there)
SOURCES = {
    "sync": (dict(), False),  # TRL's default IS mode (sequence_mask): one weight per completion
    "sync_token_is": (dict(vllm_importance_sampling_mode="token_truncate"), False),  # one weight per token
    "partial_rollout": (dict(partial_rollout_budget=3), False),
    "async": (dict(async_generation=True), True),
    "async_inflight_chunks": (dict(async_generation=True, inflight_update_tokens=3), True),
    "async_partial_rollout": (dict(async_generation=True, partial_rollout_budget=3), True),
}


class FirstLossProbe:
    """Wraps ``trainer.compute_loss``: for the first micro-batch, the batch as it reached the loss, the tokens BAPO's
    loss trained (its loss mask), BAPO's loss and gradient, and those of TRL's own ``_compute_loss`` on
    ``expected(batch)`` (what TRL trains) and on ``other(batch)`` (the other treatment, where TRL can compute it)."""

    def __init__(self, trainer: BAPOTrainer, expected, other=None):
        self.trainer, self.expected, self.other, self.record = trainer, expected, other, None
        self.original, self.trl_inputs = trainer.compute_loss, None
        trainer.compute_loss = self
        trl_loss = trainer._compute_loss

        def seen_by_trl(model, inputs):  # the micro-batch TRL's loss reads: BAPO hands it a copy of the buffer's
            self.trl_inputs = inputs
            return trl_loss(model, inputs)

        trainer._compute_loss = seen_by_trl

    def trl(self, model, batch) -> tuple[torch.Tensor, tuple]:
        params = [p for p in model.parameters() if p.requires_grad]
        loss = GRPOTrainer._compute_loss(self.trainer, model, batch)
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    def __call__(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        loss = self.original(model, inputs, return_outputs, num_items_in_batch)
        if self.record is None:
            params = [p for p in model.parameters() if p.requires_grad]
            ours = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            self.record = SimpleNamespace(batch=batch, trained=loss_mask(self.trl_inputs).clone(), loss=loss.detach(),
                                          ours=ours, expected=self.trl(model, self.expected(batch)),
                                          other=None if self.other is None else self.trl(model, self.other(batch)))
        return loss


def unscored(batch: dict) -> torch.Tensor:
    """The real tokens whose sampling log-prob is NaN."""
    return torch.isnan(batch["sampling_per_token_logps"]) & (batch["completion_mask"] != 0)


def without_unscored(batch: dict) -> dict:
    """The batch with its unscored tokens left out of TRL's loss by hand (its ``tool_mask``; a NaN behaviour
    log-prob there, which TRL's loss cannot take even masked, replaced)."""
    batch = dict(batch)
    batch["tool_mask"] = (~unscored(batch)).long()
    old = batch["old_per_token_logps"]
    batch["old_per_token_logps"] = torch.where(torch.isfinite(old), old, torch.zeros_like(old))
    return batch


def same_gradient(ours, theirs) -> bool:
    scale = max(float(g.abs().max()) for g in theirs if g is not None)
    return all((a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale))
               for a, b in zip(ours, theirs))


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_nan_sampling_log_prob_is_trained_as_trl_trains_it_unless_it_is_the_behaviour_log_prob(
        source, stand_ins, tiny_model_dir, tmp_path):
    settings, sampler_is_behaviour = SOURCES[source]
    server = stand_ins(nan_logprob_every=3)  # every 3rd token sampled has no log-prob
    trainer = build(tiny_model_dir, tmp_path / "out", [server], **settings)
    if sampler_is_behaviour:  # TRL would have to leave them out (its loss is NaN otherwise)
        probe = FirstLossProbe(trainer, without_unscored)
    else:  # TRL trains them; leaving them out (what bapo_trl did) is another gradient
        probe = FirstLossProbe(trainer, lambda batch: batch, other=without_unscored)
    trainer.train()
    seen = probe.record
    batch, real = seen.batch, seen.batch["completion_mask"] != 0
    planted = unscored(batch)
    assert planted.any(), "no NaN sampling log-prob reached the batch: the test tests nothing"
    # BAPO's loss and gradient are TRL's on what TRL trains (the ratios are ~1 here: the window clips nothing)
    trl_loss, trl_gradient = seen.expected
    assert torch.isfinite(seen.loss) and torch.allclose(seen.loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert max(float(g.abs().max()) for g in trl_gradient if g is not None) > 0  # the advantages are not all 0
    assert same_gradient(seen.ours, trl_gradient)
    if seen.other is not None:  # the comparison tells the two treatments apart
        assert not same_gradient(seen.other[1], trl_gradient)
    # TRL's correction counts a NaN difference as 0: a token's IS weight is then 1, a completion's stays finite
    weights = batch["importance_sampling_ratio"]
    assert torch.isfinite(weights).all()
    if weights.shape == planted.shape:
        assert torch.equal(weights[planted], torch.ones(int(planted.sum())))
    behaviour_missing = ~torch.isfinite(batch["old_per_token_logps"]) & real
    nonfinite = [h[NONFINITE] for h in trainer.state.log_history if NONFINITE in h]
    if sampler_is_behaviour:  # the sampler's NaN is the behaviour log-prob's: the token leaves the loss
        assert torch.equal(behaviour_missing, planted)
        assert torch.equal(seen.trained, (real & ~planted).long())
        assert nonfinite and nonfinite[0] > 0
    else:  # the behaviour log-prob is the trainer's own: TRL trains the token, and so does BAPO
        assert not behaviour_missing.any()
        assert torch.equal(seen.trained, batch["completion_mask"])
        assert nonfinite == [0.0]
