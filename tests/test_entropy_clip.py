"""Entropy-Clip Rule diagnostics (against the plain-loop reference), the IS-weighted share option and the
closed-loop target controller."""

import math
import random

import pytest
import torch

from bapo_trl import search_clip_bounds
from bapo_trl.cli.plot import main as plot_main
from bapo_trl.core.clipping_reference import entropy_clip_reference
from bapo_trl.core.entropy_clip import METRICS, entropy_clip_metrics, entropy_clip_sums, predicted_vs_realised
from bapo_trl.core.target_controller import TargetController
from support.harness import cpu_config, tiny_trainer


def random_batch(rng: random.Random):
    b, t = rng.randint(1, 6), rng.randint(1, 8)
    g = torch.Generator().manual_seed(rng.randint(0, 10**6))
    logps = -torch.rand(b, t, generator=g, dtype=torch.float64) * rng.choice([0.5, 3.0, 12.0])
    ratio = torch.exp(torch.randn(b, t, generator=g, dtype=torch.float64) * rng.choice([0.05, 0.4, 1.5]))
    mask = torch.rand(b, t, generator=g) < rng.choice([0.3, 0.8, 1.0])
    per_token = rng.random() < 0.3
    adv = torch.randn((b, t) if per_token else (b,), generator=g, dtype=torch.float64)
    if rng.random() < 0.2:
        adv = adv.clamp_min(0.0)  # some batches without negatives (empty quadrants)
    # garbage where the mask is off: NaN and inf must not reach any sum
    logps = torch.where(mask, logps, torch.tensor(math.nan, dtype=torch.float64))
    ratio = torch.where(mask, ratio, torch.tensor(math.inf, dtype=torch.float64))
    c_low, c_high = rng.choice([0.6, 0.8, 0.9]), rng.choice([1.2, 1.5, 3.0])
    return logps, ratio, adv, mask, c_low, c_high


def test_diagnostics_match_the_plain_loop_reference_on_random_batches():
    rng = random.Random(0)
    for case in range(300):
        logps, ratio, adv, mask, c_low, c_high = random_batch(rng)
        fast = entropy_clip_metrics(entropy_clip_sums(logps, ratio, adv, mask, c_low, c_high).tolist())
        slow = entropy_clip_reference(logps.tolist(), ratio.tolist(), adv.tolist(), mask.tolist(), c_low, c_high)
        assert set(fast) == set(slow) == set(METRICS)
        for name in METRICS:
            a, b = fast[name], slow[name]
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), (case, name, a, b)


def test_clipping_low_probability_positives_lowers_the_predicted_change():
    """The rule's textbook case: a narrow window clips the low-probability positive tokens (large ratios), so the
    kept tokens predict less entropy growth than all tokens would (clip effect < 0)."""
    logps = torch.tensor([[-0.1, -0.1, -4.0, -4.0]], dtype=torch.float64).repeat(2, 1)
    ratio = torch.tensor([[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    out = entropy_clip_metrics(entropy_clip_sums(logps, ratio, adv, torch.ones(2, 4), 0.8, 1.2).tolist())
    assert out["entropy_clip/clipped_pos_low"] == 1.0 and out["entropy_clip/clipped_pos_high"] == 0.0
    assert out["entropy_clip/predicted_change_all"] > out["entropy_clip/predicted_change"]
    assert out["entropy_clip/clip_effect"] < 0
    wide = entropy_clip_metrics(entropy_clip_sums(logps, ratio, adv, torch.ones(2, 4), 0.8, 3.0).tolist())
    assert wide["entropy_clip/clip_effect"] == 0.0  # raising c_high lets them back in


def test_predicted_vs_realised_correlation():
    history = [{"entropy_clip/predicted_change": p, "entropy": e}
               for p, e in [(0.1, 1.0), (0.3, 1.1), (-0.2, 1.4), (0.5, 1.2), (0.0, 1.7), (0.2, 1.7)]]
    corr, pairs = predicted_vs_realised(history)
    changes = [0.1, 0.3, -0.2, 0.5, 0.0]
    realised = [1.1 - 1.0, 1.4 - 1.1, 1.2 - 1.4, 1.7 - 1.2, 1.7 - 1.7]
    expected = torch.corrcoef(torch.tensor([changes, realised]))[0, 1].item()
    assert pairs == 5 and corr == pytest.approx(expected, abs=1e-9)
    assert predicted_vs_realised(history[:3]) == (pytest.approx(float("nan"), nan_ok=True), 2)


ARGS = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=10, logging_steps=1, seed=0,
            learning_rate=5e-3, steps_per_generation=2, lr_scheduler_type="constant")


def build(model_dir, out, **overrides):
    return tiny_trainer(model_dir, cpu_config(out, **{**ARGS, **overrides}), prompts=256)


def test_a_run_logs_and_plots_the_diagnostics(tiny_model_dir, tmp_path, capsys):
    trainer = build(tiny_model_dir, tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=8)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(name in h for h in logs for name in METRICS)
    assert all(math.isfinite(h["entropy_clip/predicted_change_all"]) for h in logs)
    shares = [sum(h[f"entropy_clip/tokens_{q}"] for q in ("pos_high", "pos_low", "neg_high", "neg_low")) for h in logs]
    assert all(s <= 1.0 + 1e-9 for s in shares)  # zero-advantage tokens are in no quadrant
    assert plot_main([str(tmp_path / "run"), "-o", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out
    assert "entropy_clip" in out and "Entropy-Clip Rule, correlation of the predicted change" in out
    # bad input is one error naming the flag (was: a caption "over 0 points", or an OSError traceback)
    for flags, named in ((["--smooth", "0"], "--smooth must be >= 1"),
                         (["-o", str(tmp_path / "d.png" / "x.png")], "-o/--output")):  # under a file
        with pytest.raises(SystemExit) as exit_:
            plot_main([str(tmp_path / "run"), *flags])
        assert exit_.value.code == 2 and named in capsys.readouterr().err, flags


def test_is_weighted_share_balances_what_the_loss_weights(tiny_model_dir, tmp_path):
    """With TRL's IS weights in the batch, the option makes the search see A x w (what TRL's loss weights); off, it
    sees A. On a batch where the weights shrink the positive tokens, the two choose different windows."""
    chosen = {}
    for weighted in (False, True):
        trainer = build(tiny_model_dir, tmp_path / str(weighted), positive_contribution_is_weighted=weighted)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        tok = trainer.processing_class
        prompts = tok(["123>", "456>", "789>", "012>"], return_tensors="pt", padding=True)
        g = torch.Generator().manual_seed(0)
        completions = torch.randint(3, len(tok), (4, 6), generator=g)
        inputs = {"prompt_ids": prompts.input_ids, "prompt_mask": prompts.attention_mask,
                  "completion_ids": completions, "completion_mask": torch.ones(4, 6),
                  "advantages": torch.tensor([1.0, 1.0, -1.0, -1.0]), "num_items_in_batch": torch.tensor(24.0)}
        with torch.no_grad():
            logps, _, _ = (trainer.port.policy_logps(torch.cat([prompts.input_ids, completions], 1),
                                                     torch.cat([prompts.attention_mask, torch.ones(4, 6)], 1), 6),
                           None, None)
        # positives at ratio ~2 (share 0.55 at the start window, unweighted), negatives on-policy
        inputs["old_per_token_logps"] = logps - torch.tensor([[0.7] * 6, [0.7] * 6, [0.0] * 6, [0.0] * 6])
        inputs["importance_sampling_ratio"] = torch.tensor([[0.2] * 6, [0.2] * 6, [1.0] * 6, [1.0] * 6])
        with torch.no_grad():
            trainer.compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()})
        chosen[weighted] = trainer.last_search.as_floats()
        ratio = torch.exp(logps - inputs["old_per_token_logps"])
        expect = search_clip_bounds(ratio, inputs["advantages"][:, None] * (inputs["importance_sampling_ratio"]
                                    if weighted else 1.0), torch.ones(4, 6), config=trainer._bapo_settings).as_floats()
        assert chosen[weighted]["clip_high"] == pytest.approx(expect["clip_high"])
        assert chosen[weighted]["clip_low"] == pytest.approx(expect["clip_low"])
    assert chosen[True]["clip_high"] > chosen[False]["clip_high"]  # weighted positives need a wider window


def test_controller_moves_toward_the_target_within_its_range():
    c = TargetController(target_entropy=1.0, rate=0.1, low=0.3, high=0.55, value=0.5)
    assert c.update(0.5) == pytest.approx(0.55)  # entropy below target: raise rho0 ...
    assert c.update(0.5) == pytest.approx(0.55)  # ... but never past `high`
    assert c.update(2.0) == pytest.approx(0.45)
    assert c.update(float("nan")) == pytest.approx(0.45)  # undefined entropy: no move
    d = TargetController(1.0, 0.1, 0.3, 0.55, 0.5)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value


def test_closed_loop_target_moves_and_survives_a_resume(tiny_model_dir, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, target_entropy=50.0, target_adapt_rate=0.02,
                  target_max=0.7)  # an entropy no model reaches: rho0 must rise every update
    full = build(tiny_model_dir, tmp_path / "full", **common)
    full.train()
    targets = [h["bapo/positive_contribution_target"] for h in full.state.log_history if "loss" in h]
    assert targets == pytest.approx([0.5 + 0.02 * k for k in range(6)])  # logged before each update's move
    resumed = build(tiny_model_dir, tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    after = [h["bapo/positive_contribution_target"] for h in resumed.state.log_history if "loss" in h][3:]
    assert after == pytest.approx(targets[3:])  # a fresh controller would restart at 0.5
    assert resumed.target_controller.value == pytest.approx(full.target_controller.value)


def test_a_second_train_restarts_the_closed_loop_target(tiny_model_dir, tmp_path):
    """A second ``train()`` on the same object starts from ``positive_contribution_target``, as a new trainer does
    (the controller is run state), not from where the first run left it."""
    trainer = build(tiny_model_dir, tmp_path / "run", max_steps=3, save_strategy="no", target_entropy=50.0,
                    target_adapt_rate=0.02, target_max=0.7)
    runs = []
    for _ in range(2):
        trainer.train()
        runs.append([h["bapo/positive_contribution_target"] for h in trainer.state.log_history if "loss" in h])
    assert runs[0] == runs[1] == pytest.approx([0.5, 0.52, 0.54])


def test_negatives_above_the_dual_clips_delta_count_as_clipped():
    """TRL's two-sided clip (``delta``, BAPO's dual clip) leaves a negative token above delta no gradient: the
    diagnostics count it as clipped and leave it out of ``predicted_change`` (issue 52: 4 of 8 negatives have no
    gradient; counted without delta, 1)."""
    logps = torch.tensor([[-0.2, -0.4, -3.0, -2.5, -0.1, -0.3, -4.0, -1.0]], dtype=torch.float64)
    ratio = torch.tensor([[5.0, 4.0, 0.5, 1.0, 1.1, 8.0, 0.95, 1.05]], dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    kept = (ratio >= 0.8) & (ratio <= 3.0)  # below c_low or above delta: no gradient (4 of the 8)
    out = entropy_clip_metrics(entropy_clip_sums(logps, ratio, adv, torch.ones(1, 8), 0.8, 1.2, delta=3.0).tolist())
    high = logps >= logps.mean()
    assert out["entropy_clip/clipped_neg_high"] == pytest.approx((~kept & high).sum().item() / high.sum().item())
    assert out["entropy_clip/clipped_neg_low"] == pytest.approx((~kept & ~high).sum().item() / (~high).sum().item())
    ax = torch.where(kept, adv, 0.0)
    assert out["entropy_clip/predicted_change"] == pytest.approx(-((logps - logps.mean()) * (ax - ax.mean())).mean())
    without = entropy_clip_metrics(entropy_clip_sums(logps, ratio, adv, torch.ones(1, 8), 0.8, 1.2).tolist())
    assert without["entropy_clip/clipped_neg_high"] + without["entropy_clip/clipped_neg_low"] < (
        out["entropy_clip/clipped_neg_high"] + out["entropy_clip/clipped_neg_low"])  # delta off: only r < c_low
