"""Honest BAPO metrics: an update on which no window of the path can change the loss is reported as inactive (start
window, ``bapo/search_active`` 0) and left out of the summary's and the model card's means; a metric that is
undefined on one micro-batch (NaN) does not turn the logged average NaN."""

import math

import pytest

from bapo_trl.reporting.summary import format_summary
from bapo_trl.trainer.model_card import bapo_card_section, target_from_card
from support.harness import cpu_config, tiny_trainer

#: A run whose every stale update moves some ratio past a path bound (without the dual clip, which slows the policy:
#: with it, one of the three stale updates of this seed stays inside the path's start window).
ARGS = dict(save_strategy="no", per_device_train_batch_size=16, num_generations=8, max_completion_length=10,
            logging_steps=1, seed=0, learning_rate=5e-3, steps_per_generation=2, max_steps=6, dual_clip=False)


def train(model_dir, tmp_path, **overrides):
    trainer = tiny_trainer(model_dir, cpu_config(tmp_path, **{**ARGS, **overrides}), prompts=256)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "bapo/clip_low" in h]


def test_on_policy_updates_are_inactive_and_report_the_start_window(tiny_model_dir, tmp_path):
    trainer, logs = train(tiny_model_dir, tmp_path)
    assert len(logs) == 6
    first_of_batch, later = logs[0::2], logs[1::2]  # steps_per_generation=2: every other update is on-policy
    for h in first_of_batch:  # ratio exactly 1: no window on the path changes the loss
        assert h["bapo/search_active"] == 0.0
        assert (h["bapo/clip_low"], h["bapo/clip_high"], h["bapo/search_steps"]) == (0.6, 1.2, 0.0)
    assert all(h["bapo/search_active"] == 1.0 for h in later)  # stale: some ratio moved past a path bound
    summary = format_summary(trainer.state.log_history, trainer.args)
    assert "search active (some window on the path changes the loss) in 50% of updates" in summary
    moved = sum(h["bapo/search_steps"] > 0 for h in later)
    assert f"bounds moved in {100 * moved / 6:.0f}% of updates" in summary
    card = bapo_card_section(trainer.args, trainer.state.log_history)
    assert "| updates where some window changed the loss | 50% |" in card
    mean_high = sum(h["bapo/clip_high"] for h in later) / len(later)  # over active updates only
    assert f"[{sum(h['bapo/clip_low'] for h in later) / len(later):.3f}, {mean_high:.3f}]" in card
    assert target_from_card(card) == trainer.args.positive_contribution_target  # what `bapo plot` reads back
    assert target_from_card(card.replace("target share", "goal")) is None


def test_undefined_metric_on_one_micro_batch_does_not_turn_the_logged_mean_nan(tiny_model_dir, tmp_path):
    """TRL averages ``_metrics`` over the logging window leaving NaN out (checked as a TRL seam); BAPO's metrics
    that can be undefined on a micro-batch (no positive token: NaN clip fraction) rely on it."""
    trainer, _ = train(tiny_model_dir, tmp_path, max_steps=1)
    trainer._metrics["train"]["bapo/clip_fraction_positive"] += [float("nan"), 0.25]
    trainer._metrics["train"]["bapo/positive_loss_share/replayed"] += [float("nan")]
    trainer.log({})
    last = trainer.state.log_history[-1]
    assert last["bapo/clip_fraction_positive"] == 0.25
    assert last["bapo/positive_loss_share/replayed"] is None  # nothing defined in the window: None, never NaN
    assert not any(isinstance(v, float) and math.isnan(v) for v in last.values())


@pytest.mark.parametrize("extra,groups", [
    (dict(replay_buffer_size=32, replay_ratio=0.5, replay_max_staleness=8),
     ("search", "entropy_clip", "replay", "rewards")),
    (dict(partial_rollout_budget=4), ("search", "entropy_clip", "partial", "rewards")),
], ids=["replay", "partial_rollout"])
def test_every_logged_metric_is_registered_and_every_registered_one_logged(tiny_model_dir, tmp_path, extra, groups):
    from bapo_trl.core.metrics import REGISTRY

    trainer, _ = train(tiny_model_dir, tmp_path, max_steps=4, **extra)
    logged = {k for h in trainer.state.log_history for k in h
              if k.split("/")[0] in ("bapo", "replay", "partial", "entropy_clip")}
    registered = {name for names in REGISTRY.values() for name in names}
    assert logged <= registered, logged - registered
    expected = {name for g in groups for name in REGISTRY[g]}
    assert expected <= logged, expected - logged
