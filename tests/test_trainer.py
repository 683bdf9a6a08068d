"""BAPOTrainer on the tiny offline model: the loss is TRL's with the chosen window, training runs and logs."""

import dataclasses
import math
import re

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from bapo_trl import BAPOConfig, BAPOTrainer
from bapo_trl.core import metrics
from bapo_trl.recipes.toy import make_reverse_dataset, reverse_reward
from support.harness import cpu_config, tiny_trainer
from support.trainers import COMMON, make_trainer, stale_batch


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_loss_equals_trl_when_window_is_pinned(tiny_model_dir, tmp_path, loss_type):
    """A BAPO path of one point [1 - eps, 1 + eps] must give exactly TRL's GRPO loss and gradient."""
    pinned = dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.28, ratio_upper_max=1.28)
    bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / "b", loss_type=loss_type, **pinned)
    grpo = make_trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "g", loss_type=loss_type,
                        epsilon=0.2, epsilon_high=0.28)
    for seed in range(3):
        batch = stale_batch(bapo, seed)
        loss_b = bapo.compute_loss(bapo.model, dict(batch))
        loss_g = grpo.compute_loss(grpo.model, dict(batch))
        assert torch.allclose(loss_b, loss_g, atol=1e-6), (loss_b, loss_g)
        loss_b.backward()
        loss_g.backward()
    for (name, pb), (_, pg) in zip(bapo.model.named_parameters(), grpo.model.named_parameters()):
        assert torch.allclose(pb.grad, pg.grad, atol=1e-6), name
    assert bapo._metrics["train"]["bapo/clip_low"][-1] == pytest.approx(0.8)
    assert (bapo._metrics["train"]["clip_ratio/region_mean"]
            == pytest.approx(grpo._metrics["train"]["clip_ratio/region_mean"]))


@pytest.mark.parametrize("variant, dual_clip", [("paper", True), ("paper", False), ("verl", True)])
def test_loss_uses_the_chosen_window(tiny_model_dir, tmp_path, variant, dual_clip):
    """With the adaptive search on, the loss equals TRL's loss at the window the search reports (with TRL's
    two-sided clip at delta = 3 where the dual clip is on, the default)."""
    bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / "b", bapo_variant=variant,
                        dual_clip=dual_clip)
    moved = 0
    for seed in range(4):
        batch = stale_batch(bapo, seed, noise=0.9, adv_shift=-0.4)
        loss_b = bapo.compute_loss(bapo.model, dict(batch))
        chosen = bapo.last_search.as_floats()
        moved += chosen["steps"] > 0
        grpo = make_trainer(
            GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / f"g{seed}",
            epsilon=1 - chosen["clip_low"], epsilon_high=chosen["clip_high"] - 1,
            delta=3.0 if dual_clip else None,
        )
        loss_g = grpo.compute_loss(grpo.model, dict(batch))
        assert torch.allclose(loss_b, loss_g, atol=1e-6), (seed, loss_b, loss_g, chosen)
    assert moved, "the scripted stale batches must make the search move"


def test_the_dual_clip_caps_negative_tokens_by_default(tiny_model_dir, tmp_path):
    """Negative-advantage tokens with a huge ratio: by default (``dual_clip``, both variants, as the official code)
    each is capped at delta |A| = 3 |A|; with ``dual_clip=False`` (TRL's one-sided clip) their loss grows with the
    ratio."""
    for variant in ("paper", "verl"):
        assert BAPOConfig(output_dir="unused", use_cpu=True, bapo_variant=variant).effective_delta == 3.0
    assert BAPOConfig(output_dir="unused", use_cpu=True, dual_clip=False).effective_delta is None
    # the path is never cut
    assert BAPOConfig(output_dir="unused", use_cpu=True, ratio_upper_max=4.0).effective_delta == 4.0
    # delta set: kept
    assert BAPOConfig(output_dir="unused", use_cpu=True, dual_clip=False, delta=2.5).effective_delta == 2.5
    losses = {}
    for variant, dual_clip in (("paper", False), ("verl", True), ("paper", True)):
        trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / f"{variant}{dual_clip}",
                               bapo_variant=variant, dual_clip=dual_clip)
        batch = stale_batch(trainer, seed=0, noise=0.0)
        batch["old_per_token_logps"] = batch["old_per_token_logps"] - 5.0  # ratio e^5 ~ 148 on every token
        batch["advantages"] = torch.tensor([-1.0, -1.5, -0.5, -0.8])  # all negative
        losses[variant, dual_clip] = trainer.compute_loss(trainer.model, batch).item()
        mask = batch["completion_mask"]
    capped = (3.0 * batch["advantages"].abs()[:, None] * mask).sum() / mask.sum()  # every token at 3 |A|
    assert losses["verl", True] == pytest.approx(capped.item(), rel=1e-5)
    assert losses["paper", True] == pytest.approx(capped.item(), rel=1e-5)
    assert losses["paper", False] == pytest.approx(math.exp(5.0) * capped.item() / 3.0, rel=1e-3)  # uncapped: r |A|


def test_training_moves_bounds_updates_weights_and_logs_every_metric(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, steps_per_generation=4, max_steps=8,
        learning_rate=5e-3, temperature=1.0,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed, "no parameter changed"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 8
    for h in logs:
        assert math.isfinite(h["loss"])
        for name in metrics.UPDATE:
            assert name in h, name
    # staleness grows within a generation: 0, 1, 2, 3 updates since sampling
    assert [h["bapo/staleness_max"] for h in logs[:4]] == [0, 1, 2, 3]
    # the bounds moved: some update trained with a window other than the start window [0.6, 1.2]
    moved = [h for h in logs if (h["bapo/clip_low"], h["bapo/clip_high"]) != (0.6, 1.2)]
    assert moved and all(h["bapo/search_steps"] > 0 for h in moved), [(h["bapo/clip_low"], h["bapo/clip_high"])
                                                                       for h in logs]
    # the window is only ever one of the path's candidates
    for h in logs:
        assert 0.6 - 1e-9 <= h["bapo/clip_low"] <= 0.9 + 1e-9
        assert 1.2 - 1e-9 <= h["bapo/clip_high"] <= 3.0 + 1e-9
        # TRL's own clip metrics are computed against the installed (chosen) window
        assert h["clip_ratio/low_mean"] == pytest.approx(h["bapo/clip_fraction_low"], abs=1e-6)
        assert h["clip_ratio/high_mean"] == pytest.approx(h["bapo/clip_fraction_high"], abs=1e-6)


def test_peft_lora_trains_with_bapo(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    args = cpu_config(tmp_path, steps_per_generation=2, max_steps=2, learning_rate=1e-2, **COMMON)
    trainer = tiny_trainer(tiny_model_dir, args, model=tiny_model_dir, prompts=16, prompt_seed=1,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert any(not torch.equal(lora_before[n], p) for n, p in trainer.model.named_parameters() if n in lora_before)
    assert "bapo/clip_high" in trainer.state.log_history[0]


def test_kl_and_entropy_bonus_keep_working(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, steps_per_generation=2, max_steps=2, beta=0.05,
        entropy_coef=0.01,
    )
    trainer.train()
    h = trainer.state.log_history[0]
    assert "kl" in h and math.isfinite(h["kl"]) and "bapo/clip_low" in h
    assert h["entropy_coef"] == pytest.approx(0.01) and "policy_loss" in h  # TRL's entropy-bonus metrics


def test_entropy_bonus_is_subtracted_from_the_bapo_loss(tiny_model_dir, tmp_path):
    """loss(entropy_coef=c) = loss(entropy_coef=0) - c * mean token entropy, on the same stale batch and window."""
    losses, entropy = {}, None
    for coef in (0.0, 0.5):
        trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / str(coef), entropy_coef=coef)
        losses[coef] = trainer.compute_loss(trainer.model, stale_batch(trainer, seed=1, noise=0.9)).item()
        entropy = trainer._metrics["train"]["entropy"][-1]  # mean entropy over the real completion tokens
    assert entropy > 0.1
    assert losses[0.5] == pytest.approx(losses[0.0] - 0.5 * entropy, abs=1e-5)


def test_wrong_args_type_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="BAPOConfig"):
        BAPOTrainer(model=tiny_model_dir, reward_funcs=reverse_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True))


def test_model_card_names_bapo_and_its_settings(tiny_model_dir, tmp_path):
    trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, steps_per_generation=2, max_steps=2)
    trainer.train()
    trainer.create_model_card(model_name="tiny-bapo")
    card = (tmp_path / "README.md").read_text()
    assert "## BAPO" in card and "2510.18927" in card and "target share rho0 | 0.5" in card
    assert "mean chosen window" in card
    assert "bapo" in card.split("---")[1]  # TRL's front matter carries the tag
    assert "@article{xi2025bapo" in card  # the paper citation comes through TRL's own card template
    # nothing pushed (no hub_model_id): the quick start loads the saved folder, not model="None" (TRL's template)
    assert 'model="None"' not in card and f'model="{tmp_path}"' in card
    trainer.save_model(str(tmp_path / "elsewhere"))  # a model saved to another folder: its card loads that one
    elsewhere = (tmp_path / "elsewhere" / "README.md").read_text()
    assert f'model="{tmp_path / "elsewhere"}"' in elsewhere
    # the quick start asks a prompt of the task (plain text, as trained), not TRL's chat question, and answers
    assert repr(trainer.train_dataset[0]["prompt"]) in elsewhere and "time machine" not in elsewhere
    code = elsewhere.split("## Quick start")[1].split("```python\n")[1].split("```")[0]
    import contextlib
    import io
    import warnings

    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        exec(code, {})
    assert printed.getvalue().strip(), code  # an answer, not the empty string of a chat question
    assert not [w for w in caught if "length" in str(w.message).lower()], [str(w.message) for w in caught]


def test_num_iterations_makes_the_second_pass_off_policy_and_bapo_acts(tiny_model_dir, tmp_path, monkeypatch):
    """num_iterations=2: each generation batch is trained twice; the first pass is on-policy (ratio 1: TRL computed
    its old log-probs with the current policy, and the batch is of the current version), so it keeps the user's
    window (the path's start: TRL's loss exactly, also for a gate's loss value); the second comes after an optimizer
    step, so the ratio the search sees differs from 1, the run's target is searched for and the window can move."""
    import bapo_trl.trainer.bapo_trainer as trainer_module
    from bapo_trl.trainer.loss_hook import ON_POLICY_TARGET

    seen = []
    search = trainer_module.search_clip_bounds

    def recording_search(ratio, advantages, mask, **kwargs):  # a probe around the real search
        result = search(ratio, advantages, mask, **kwargs)
        real = mask.bool()
        seen.append((float((ratio[real].double() - 1).abs().max()), result.as_floats(),
                     kwargs["config"].positive_contribution_target))
        return result

    monkeypatch.setattr(trainer_module, "search_clip_bounds", recording_search)
    trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, num_iterations=2, max_steps=8,
                           learning_rate=5e-3, temperature=1.0)
    trainer.train()
    assert len(seen) == 8  # one search per update (one micro-batch each)
    first, second = seen[0::2], seen[1::2]
    assert all(gap < 1e-5 for gap, _, _ in first), [gap for gap, _, _ in first]
    assert all(gap > 1e-3 for gap, _, _ in second), [gap for gap, _, _ in second]
    assert all(target == ON_POLICY_TARGET and (r["clip_low"], r["clip_high"]) == (0.6, 1.2) for _, r, target in first)
    assert all(target == 0.5 for _, _, target in second)
    assert any((r["clip_low"], r["clip_high"]) != (0.6, 1.2) for _, r, _ in second)  # BAPO's window moved
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["bapo/staleness_max"] for h in logs] == [0, 1] * 4


@pytest.mark.parametrize("settings,kwargs,message", [
    (dict(partial_rollout_budget=3), dict(rollout_func=lambda prompts, trainer: {}),
     "pass either `rollout_func` or `partial_rollout_budget`"),
    (dict(partial_rollout_budget=3), dict(iterable=True), "which a IterableDataset does not allow"),
    (dict(replay_buffer_size=8, replay_ratio=0.5, steps_per_generation=2), dict(tools=[len]),
     "cannot hold tool-calling or environment rollouts"),
    (dict(partial_rollout_budget=3), dict(tools=[len]), "cannot continue tool-calling or environment rollouts"),
], ids=["rollout_func", "iterable_dataset", "replay_tools", "partial_tools"])
def test_conflicting_arguments_are_refused_at_construction(tiny_model_dir, tmp_path, settings, kwargs, message):
    """Before anything is loaded: the model path does not even have to be valid for the error to come first."""
    dataset = make_reverse_dataset(32, seed=0)
    if kwargs.pop("iterable", False):
        dataset = dataset.to_iterable_dataset()
    args = cpu_config(tmp_path, **{**COMMON, **settings})
    with pytest.raises(ValueError, match=re.escape(message)):
        BAPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reverse_reward, args=args,
                    train_dataset=dataset, **kwargs)


@pytest.mark.parametrize("setting", ["top_entropy_quantile", "off_policy_mask_threshold"])
def test_the_search_balances_only_the_tokens_trls_loss_keeps(tiny_model_dir, tmp_path, setting):
    """TRL's loss drops tokens after the clip (the low-entropy ones with ``top_entropy_quantile`` < 1, the
    negative-advantage sequences far off-policy with ``off_policy_mask_threshold``): the search must balance the loss
    that is optimised, so it sees exactly the tokens TRL keeps, masked as TRL masks them."""
    overrides = {"top_entropy_quantile": 0.5} if setting == "top_entropy_quantile" else {
        "off_policy_mask_threshold": 0.5}
    trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, **overrides)
    batch = stale_batch(trainer, seed=1, noise=0.9, adv_shift=-0.4)
    if setting == "off_policy_mask_threshold":  # sequence 1 (negative advantage) far off-policy: TRL drops it
        batch["old_per_token_logps"][1] += 3.0
    seen = {}
    search = trainer.loss.grid_sums

    def recording(ratio, advantages, mask, path):
        seen["mask"] = mask.clone()
        return search(ratio, advantages, mask, path)

    trainer.loss = dataclasses.replace(trainer.loss, grid_sums=recording)
    with torch.no_grad():
        trainer.compute_loss(trainer.model, dict(batch))
    mask = batch["completion_mask"]
    if setting == "top_entropy_quantile":
        with torch.no_grad():
            _, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                torch.cat([batch["prompt_mask"], mask.long()], 1), 6, compute_entropy=True)
        kept = trainer.get_high_entropy_mask(entropies, mask, 0.5)
        assert 0 < kept.sum() < mask.sum()
    else:
        kept = torch.ones_like(mask)
        kept[1] = 0
    assert torch.equal(seen["mask"].bool(), (mask * kept).bool())


def test_with_both_masks_the_off_policy_mask_reads_every_loss_token_as_trls_does():
    """``top_entropy_quantile`` < 1 and ``off_policy_mask_threshold`` together: TRL computes the off-policy mask from
    the loss mask (the sequence's divergence over all its tokens) and multiplies the entropy mask in after. One
    negative sequence whose divergence sits on its low-entropy tokens: TRL drops it, and so must the search's tokens
    (it balanced the sequence's high-entropy tokens when the off-policy mask read the entropy-masked mask). TRL's own
    mask functions, on a STAND-IN trainer (one process: TRL's gather and pad are identities)."""
    from types import SimpleNamespace

    from bapo_trl.trainer.loss_hook import LossHookMixin

    mask = torch.ones(1, 4)
    entropies = torch.tensor([[2.0, 2.0, 0.1, 0.1]])  # the top half keeps tokens 0 and 1
    logps = torch.full((1, 4), -1.0)
    sampling = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])  # no divergence on the kept tokens, 2 nats on the others
    inputs = {"advantages": torch.tensor([-1.0]), "old_per_token_logps": sampling, "completion_mask": mask}
    accelerator = SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t)
    trainer = SimpleNamespace(top_entropy_quantile=0.5, off_policy_mask_threshold=0.5, accelerator=accelerator,
                              get_off_policy_mask=GRPOTrainer.get_off_policy_mask)
    trainer.get_high_entropy_mask = lambda e, m, q: GRPOTrainer.get_high_entropy_mask(trainer, e, m, q)
    trls = GRPOTrainer.get_off_policy_mask(inputs["advantages"][:, None], logps, sampling, mask, 0.5) \
        * trainer.get_high_entropy_mask(entropies, mask, 0.5)
    assert trls.sum() == 0  # TRL drops the sequence
    searched = LossHookMixin._optimised_tokens(trainer, mask, logps, entropies, inputs)
    assert torch.equal(searched.bool(), trls.bool()), searched


def test_the_closed_loop_target_moves_once_per_update(tiny_model_dir, tmp_path):
    """With gradient accumulation the target moves by at most ``target_adapt_rate`` per optimizer step (it moved
    once per micro-batch before: 0.135 over 4 updates at GA 4 and rate 0.01)."""
    trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, gradient_accumulation_steps=4,
                           steps_per_generation=4, per_device_train_batch_size=4, max_steps=4, target_entropy=50.0,
                           target_adapt_rate=0.01, learning_rate=1e-3)
    trainer.train()
    targets = [h["bapo/positive_contribution_target"] for h in trainer.state.log_history if "loss" in h]
    assert targets == pytest.approx([0.5, 0.51, 0.52, 0.53])  # logged during each update: its micro-batches agree
    assert trainer.target_controller.value == pytest.approx(0.54)


def test_age_buckets_count_tokens_by_their_own_version_when_replayed_rows_are_mixed_in():
    """Async partial rollout with replay: a completion spans policies, so its tokens fall in different age buckets;
    the replay split (per completion) must not replace the per-token ages."""
    from bapo_trl.core.clipping import BAPOSettings, search_clip_bounds, search_path
    from bapo_trl.core.loss_types import CLIPPED_SURROGATE
    from bapo_trl.core.metrics import SearchRecord, update_values

    ratio = torch.ones(2, 4)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    inputs = {"token_policy_version": torch.tensor([[10, 10, 9, 9], [8, 8, 8, 8]]),
              "policy_version": torch.tensor([9, 8]), "replayed": torch.tensor([False, True])}
    result = search_clip_bounds(ratio, advantages, mask)
    values, _ = update_values(SearchRecord(
        result=result, path=search_path(BAPOSettings()), loss=CLIPPED_SURROGATE, ratio=ratio, advantages=advantages,
        mask=mask, inputs=inputs, logps=torch.zeros(2, 4), entropies=None, step=10, nonfinite_inputs=torch.tensor(0.0),
        target=0.5, sum_over_processes=lambda t: t, max_over_processes=lambda t: t, by_age=True))
    assert values["bapo/token_fraction/age_0"] == pytest.approx(2 / 8)  # per token: two at age 0 ...
    assert values["bapo/token_fraction/age_1"] == pytest.approx(2 / 8)  # ... two at age 1
    assert values["bapo/token_fraction/age_2"] == pytest.approx(4 / 8)
    assert values["replay/staleness_max"] == 2.0  # the replay split stays per completion


@pytest.mark.parametrize("dual_clip, level", [(True, "token"), (False, "token"), (True, "sequence")])
def test_clip_metrics_count_the_tokens_trls_loss_gives_no_gradient(tiny_model_dir, tmp_path, dual_clip, level):
    """The clip fractions (by sign, fresh/replayed) and the Entropy-Clip diagnostics count exactly the tokens that get
    no gradient through TRL's own loss, found with autograd: with the dual clip (the default, TRL's two-sided clip at
    delta = 3) a negative token above delta is one of them (issue 52: 4 of 8 negatives dropped, metric 0.125)."""
    trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, dual_clip=dual_clip,
                           importance_sampling_level=level)
    batch = stale_batch(trainer, seed=0, noise=0.0, adv_shift=0.0)  # advantages [1, -1.5, 0.5, -0.8]
    log_ratio = torch.tensor([[2.0, 0.0, 0.1, -0.3, 1.0, 0.0],  # a positive above any c_high, others inside
                              [5.0, 5.0, -1.0, 0.05, 0.0, 0.0],  # negatives: two above delta, one below c_low
                              [0.0, 0.3, -2.0, 0.0, 0.6, 0.0],
                              [4.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # one above delta (mask keeps two tokens)
    batch["old_per_token_logps"] = batch["old_per_token_logps"] - log_ratio
    batch["replayed"], batch["policy_version"] = torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long)
    seen = {}
    forward = trainer._get_per_token_logps_and_entropies

    def keep_logps(*args, **kwargs):
        logps, entropies, aux = forward(*args, **kwargs)
        logps.retain_grad()
        seen["logps"] = logps
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = keep_logps
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    logps, mask = seen["logps"], batch["completion_mask"].bool()
    adv = batch["advantages"][:, None].expand_as(logps)
    kept = seen["logps"].grad != 0  # the plain reference: TRL's loss, differentiated
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    if dual_clip and level == "token":
        assert (neg & ~kept & (torch.exp(log_ratio) > 3.0)).sum() == 3  # the case the metrics missed
    metric = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert metric["bapo/clip_fraction_positive"] == pytest.approx(((pos & ~kept).sum() / pos.sum()).item())
    assert metric["bapo/clip_fraction_negative"] == pytest.approx(((neg & ~kept).sum() / neg.sum()).item())
    assert metric["bapo/clip_fraction/fresh"] == pytest.approx(((mask & ~kept).sum() / mask.sum()).item())
    # Entropy-Clip, token by token: quadrants around the mean log-prob, -Cov(log pi, A X) with X = 1 where kept
    tokens = [(logps[i, j].item(), adv[i, j].item(), bool(kept[i, j])) for i, j in mask.nonzero().tolist()]
    mean_l = sum(l for l, _, _ in tokens) / len(tokens)
    for name, sign in (("pos", 1), ("neg", -1)):
        for side, is_high in (("high", True), ("low", False)):
            part = [k for l, a, k in tokens if a * sign > 0 and (l >= mean_l) == is_high]
            expected = sum(not k for k in part) / len(part) if part else math.nan
            assert metric[f"entropy_clip/clipped_{name}_{side}"] == pytest.approx(expected, nan_ok=True), (name, side)
    ax = [a if k else 0.0 for _, a, k in tokens]
    cov = sum((l - mean_l) * (x - sum(ax) / len(ax)) for (l, _, _), x in zip(tokens, ax)) / len(tokens)
    assert metric["entropy_clip/predicted_change"] == pytest.approx(-cov, rel=1e-6)
