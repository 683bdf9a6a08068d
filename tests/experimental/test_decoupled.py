"""The decoupled off-policy correction (``bapo_trl.experimental.decoupled``): its weights and metrics against plain
float64 loops on random inputs, and, through a trainer, what reaches TRL's loss (the proximal log-probs as the clip's
reference, the behaviour ones kept, each token's advantage times its weight) and what a resume restores. The
guarantee rows run every rollout source with it (test_decoupled_guarantees.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from bapo_trl.experimental.decoupled import DecoupledBAPOConfig, DecoupledBAPOTrainer
from bapo_trl.experimental.decoupled.reference import decoupled_weights_reference, effective_sample_size_reference
from bapo_trl.experimental.decoupled.weights import WEIGHT_MODES, behaviour_weights, weight_sums, weight_values
from support.harness import PolicySnapshots, cpu_config, logps_under, probe_of, tiny_trainer

Probe = probe_of(DecoupledBAPOTrainer)


def random_batch(seed: int, rows: int = 6, width: int = 9):
    generator = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, width, generator=generator) * 3
    proximal = behaviour + torch.randn(rows, width, generator=generator) * 0.6
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    behaviour[0, 0] = float("nan")  # a token the sampler could not score
    behaviour[1, -1] = float("nan")
    return proximal, behaviour, mask


@pytest.mark.parametrize("mode", WEIGHT_MODES)
@pytest.mark.parametrize("bounds", [(3.0, None), (1.5, 0.5), (None, 0.8)], ids=["cap", "cap_and_floor", "floor"])
@pytest.mark.parametrize("seed", range(4))
def test_the_weights_are_the_definitions(mode, bounds, seed):
    proximal, behaviour, mask = random_batch(seed)
    cap, floor = bounds
    weights, capped = behaviour_weights(proximal, behaviour, mask, mode, cap, floor)
    expected = torch.tensor(decoupled_weights_reference(proximal, behaviour, mask, mode, cap, floor))
    assert torch.allclose(weights.double(), expected.double(), rtol=1e-5, atol=1e-7)
    outside = torch.zeros_like(weights, dtype=torch.bool)
    raw = torch.tensor(decoupled_weights_reference(proximal, behaviour, mask, mode, None, None))
    if cap is not None:
        outside |= raw > cap
    if floor is not None:
        outside |= raw < floor
    assert torch.equal(capped, outside)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_metrics_are_the_definitions(mode):
    proximal, behaviour, mask = random_batch(7, rows=8)
    weights, capped = behaviour_weights(proximal, behaviour, mask, mode, 1.5, None)
    replayed = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    staleness = torch.tensor([0, 3, 0, 1, 2, 0, 5, 1], dtype=torch.float64)[:, None].expand_as(mask)
    # split over two "processes": the sums add up, the values come from the totals
    halves = [weight_sums(weights[s], capped[s], mask[s], mode, proximal[s], behaviour[s], replayed[s], staleness[s])
              for s in (slice(0, 3), slice(3, 8))]
    values = weight_values((halves[0] + halves[1]).tolist())

    def unit_weights(rows):
        out = []
        for i in rows:
            valid = [t for t in range(mask.size(1)) if mask[i, t] > 0]
            out += [float(weights[i, t]) for t in (valid if mode.startswith("token") else valid[:1])]
        return out

    all_rows = range(8)
    assert math.isclose(values["decoupled/ess"], effective_sample_size_reference(unit_weights(all_rows)),
                        rel_tol=1e-9)
    for name, rows in [("/fresh", [i for i in all_rows if not replayed[i]]),
                       ("/replayed", [i for i in all_rows if replayed[i]]),
                       ("/age_0", [i for i in all_rows if staleness[i, 0] == 0]),
                       ("/age_3+", [i for i in all_rows if staleness[i, 0] >= 3])]:
        assert math.isclose(values[f"decoupled/ess{name}"], effective_sample_size_reference(unit_weights(rows)),
                            rel_tol=1e-9), name
    units = unit_weights(all_rows)
    capped_units = sum(bool(capped[i, t]) for i in all_rows for t in range(mask.size(1)) if mask[i, t] > 0
                       and (mode.startswith("token") or t == 0))
    assert math.isclose(values["decoupled/capped_fraction"], capped_units / len(units), rel_tol=1e-9)
    gaps = {True: [], False: []}
    for i in all_rows:
        for t in range(mask.size(1)):
            if mask[i, t] > 0:
                gap = abs(float(proximal[i, t]) - float(behaviour[i, t]))
                gaps[bool(staleness[i, 0] == 0)].append(0.0 if math.isnan(gap) else gap)
    assert math.isclose(values["decoupled/mismatch"], sum(gaps[True]) / len(gaps[True]), rel_tol=1e-6)
    assert math.isclose(values["decoupled/staleness"], sum(gaps[False]) / len(gaps[False]), rel_tol=1e-6)


def decoupled_config(tmp_path, **overrides) -> DecoupledBAPOConfig:
    return cpu_config(tmp_path / "out", config_cls=DecoupledBAPOConfig, **{**dict(
        save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        logging_steps=1, seed=0, learning_rate=5e-3, lr_scheduler_type="constant", steps_per_generation=2,
        max_steps=6, replay_buffer_size=8, replay_ratio=0.5,
        off_policy_weight_cap=1.2, disable_tqdm=True), **overrides})


def keep_inputs(trainer, compute_loss, model, inputs, *args, **kwargs):
    if model.training:
        trainer.batches.append((trainer.state.global_step, {k: v.detach().clone() if torch.is_tensor(v) else v
                                                            for k, v in inputs.items()}))
    return compute_loss(model, inputs, *args, **kwargs)


def test_what_reaches_trls_loss(tiny_model_dir, tmp_path):
    """Replay (groups up to several steps old), decoupled, a cap of 1.2 that binds: every micro-batch's
    old_per_token_logps is the policy of the step its batch started training at; behaviour_per_token_logps is what
    the batch carried; its advantages are the group advantages times the truncated weight of each token (the plain
    loop), so TRL's loss, linear in the advantage, weights each token's loss by it; and the ESS metrics are logged."""
    snapshots = PolicySnapshots()
    trainer = tiny_trainer(tiny_model_dir, decoupled_config(tmp_path), cls=Probe, callbacks=[snapshots],
                           around={"compute_loss": keep_inputs}, record=("batches",))
    scored = []
    decouple_inputs = trainer.rollout_source.next_batch

    def keep_scored(*args, **kwargs):  # the batch before the correction
        out = decouple_inputs(*args, **kwargs)
        scored.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})
        return out

    trainer.rollout_source.next_batch = keep_scored
    trainer.train()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    stale, capped = 0, 0
    for step, inputs in trainer.batches:
        start = step - step % 2
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        width = inputs["completion_ids"].size(1)
        mask = inputs["completion_mask"].float()
        expected = logps_under(model, snapshots.policies[start], ids, width, attention_mask=attention)
        assert torch.allclose(expected * mask, inputs["old_per_token_logps"] * mask, atol=2e-4), step
        weights = torch.tensor(decoupled_weights_reference(inputs["old_per_token_logps"],
                                                           inputs["behaviour_per_token_logps"], mask,
                                                           "token_truncate", 1.2), dtype=torch.float32)
        group = inputs["advantages"] / torch.where(weights > 0, weights, 1.0)  # the group advantage, per token
        assert torch.allclose(group * mask, (group[:, :1] * mask), atol=1e-5)  # one per completion
        assert torch.allclose(inputs["advantages"] * mask, group[:, :1] * weights * mask, atol=1e-5)
        stale += int(inputs["replayed"].sum())
        capped += int(((weights >= 1.2 - 1e-6) & (mask > 0)).sum())
    assert stale > 0 and capped > 0  # replayed rows trained, and the cap bound somewhere
    behaviour_all = torch.cat([b["old_per_token_logps"].flatten() for b in scored])
    kept_all = torch.cat([b["behaviour_per_token_logps"].flatten() for _, b in trainer.batches])
    assert set(kept_all.tolist()) <= set(behaviour_all.tolist())  # the behaviour log-probs the batches carried
    logged = [h for h in trainer.state.log_history if h.get("decoupled/ess") is not None]  # once per batch
    assert len(logged) == 3 and all(0 < h["decoupled/ess"] <= 1 for h in logged)
    assert any(h["decoupled/capped_fraction"] > 0 for h in logged)
    assert any((h.get("decoupled/ess/replayed") or 1) < 1 for h in logged)


def test_a_resume_mid_batch_trains_the_decoupled_batch_it_saved(tiny_model_dir, tmp_path):
    """A checkpoint in the middle of a generation batch saves the batch as it was decoupled: the resumed run trains
    the same proximal log-probs and weighted advantages (not ones recomputed with the resumed weights)."""
    args = decoupled_config(tmp_path, save_strategy="steps", save_steps=1, max_steps=4)
    full = tiny_trainer(tiny_model_dir, args, cls=Probe, around={"compute_loss": keep_inputs}, record=("batches",))
    full.train()
    resumed = tiny_trainer(tiny_model_dir, decoupled_config(tmp_path / "again", max_steps=4), cls=Probe,
                           around={"compute_loss": keep_inputs}, record=("batches",))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))  # step 3: the batch of steps 2-3
    (step, after), = [b for b in resumed.batches]
    (_, before), = [b for b in full.batches if b[0] == 3]
    assert step == 3
    for key in ("old_per_token_logps", "behaviour_per_token_logps", "advantages", "completion_ids"):
        assert torch.equal(after[key], before[key]), key


def test_bad_settings_are_refused_naming_the_field(tmp_path):
    from bapo_trl import BAPOConfig, BAPOTrainer

    with pytest.raises(ValueError, match="off_policy_weight_mode"):
        DecoupledBAPOConfig(output_dir="unused", use_cpu=True, off_policy_weight_mode="token")
    with pytest.raises(ValueError, match="off_policy_weight_cap"):
        DecoupledBAPOConfig(output_dir="unused", use_cpu=True, off_policy_weight_cap=0)
    with pytest.raises(ValueError, match="off_policy_weight_floor"):
        DecoupledBAPOConfig(output_dir="unused", use_cpu=True, off_policy_weight_floor=5.0)
    with pytest.raises(TypeError, match="off_policy_correction"):  # 0.1's field: the class is the correction now
        BAPOConfig(output_dir="unused", use_cpu=True, off_policy_correction="decoupled")
    assert issubclass(DecoupledBAPOTrainer, BAPOTrainer)
    with pytest.raises(TypeError, match="DecoupledBAPOTrainer needs `args` to be a DecoupledBAPOConfig"):
        DecoupledBAPOTrainer(model="unused", args=cpu_config(tmp_path))


def test_the_behaviour_policy_is_the_samplers_and_trls_weight_steps_aside(tiny_model_dir, tmp_path, monkeypatch):
    """A sampler that is not the trainer's policy (the stand-in server sampling from perturbed logits, as a real
    engine's kernels or quantisation differ): TRL's generation through the server, two steps per batch. The kept
    behaviour log-probs are the SAMPLER's (not the trainer's old log-probs, which differ from them by far more than
    noise), TRL's own vLLM importance weight is 1 on every trained token (the decoupled weight already carries the
    mismatch it corrects), and each token's advantage carries the truncated pi_prox / pi_sampler weight."""
    from support.policy_server import PolicyServer

    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = PolicyServer(tiny_model_dir, perturb=1.0)
    try:
        args = decoupled_config(tmp_path, replay_buffer_size=0, replay_ratio=0.0, max_steps=4, use_vllm=True,
                                vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=30,
                                off_policy_weight_cap=3.0)
        trainer = tiny_trainer(tiny_model_dir, args, cls=Probe, around={"compute_loss": keep_inputs},
                               record=("batches",))
        scored = []
        next_batch = trainer.rollout_source.next_batch

        def keep_scored(*a, **kw):  # the batch as TRL scored it, before the correction
            out = next_batch(*a, **kw)
            scored.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})
            return out

        trainer.rollout_source.next_batch = keep_scored
        trainer.train()
    finally:
        server.close()
    assert len(scored) == 2 and len(trainer.batches) == 4
    for index, (step, inputs) in enumerate(trainer.batches):
        batch = scored[index // 2]  # TRL shuffles a generation batch before it splits it: rows are found by tokens
        where = {(tuple(p.tolist()), tuple(c.tolist())): i
                 for i, (p, c) in enumerate(zip(batch["prompt_ids"], batch["completion_ids"]))}
        rows = [where[(tuple(p.tolist()), tuple(c.tolist()))]
                for p, c in zip(inputs["prompt_ids"], inputs["completion_ids"])]
        mask = inputs["completion_mask"].bool()
        sampler = batch["sampling_per_token_logps"][rows]
        torch.testing.assert_close(inputs["behaviour_per_token_logps"][mask], sampler[mask])
        assert (sampler - batch["old_per_token_logps"][rows])[mask].abs().mean() > 0.1  # the sampler differs
        assert torch.equal(inputs["importance_sampling_ratio"], torch.ones_like(inputs["importance_sampling_ratio"]))
        weights = torch.tensor(decoupled_weights_reference(inputs["old_per_token_logps"], sampler, mask.float(),
                                                           "token_truncate", 3.0), dtype=torch.float32)
        group = batch["advantages"][rows][:, None]
        torch.testing.assert_close(inputs["advantages"] * mask, group * weights * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("settings", [dict(steps_per_generation=2), dict(steps_per_generation=2, num_iterations=2)],
                         ids=["steps_per_generation_2", "num_iterations_2"])
def test_image_batches_reach_the_proximal_forward(tmp_path, settings):
    """LLaVA on image prompts at learning rate 0 (tests/support/tiny_vlm.py): the proximal log-probs (the clip's
    reference) and the stored behaviour ones are the policy's own WITH the batch's images, so every decoupled weight
    is exactly 1 (within float noise)."""
    from bapo_trl.experimental.decoupled.trainer import BEHAVIOUR
    from support.tiny_vlm import train_with_the_policy_still

    trainer, checked = train_with_the_policy_still(tmp_path, settings, classes=(DecoupledBAPOConfig,
                                                                                DecoupledBAPOTrainer),
                                                   also=(BEHAVIOUR,))
    assert checked > 0
    weights = [h["decoupled/capped_fraction"] for h in trainer.state.log_history if "decoupled/ess" in h]
    assert weights and not any(weights)
