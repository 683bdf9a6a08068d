"""BAPO's window on GMPO's geometric mean (bapo_trl.core.geometric_mean, BAPOGMPOTrainer; issue 53's GMPO
candidate): the one-pass sums against the plain float64 loop on random batches (both search orders, both shares,
masks, empty and non-finite sequences, a two-process split), the per-token terms the metrics read, and TRL's GMPO
loss clipping with the window the plain loop chooses, update by update."""

import math

import pytest
import torch

from bapo_trl.core.clipping import BAPOSettings, search_clip_bounds
from bapo_trl.core.clipping_reference import loop_search
from bapo_trl.experimental.gmpo.geometric_mean import GEOMETRIC_MEAN, gmpo_contributions, gmpo_sums, gmpo_window
from bapo_trl.experimental.gmpo.presets import gmpo_balanced
from bapo_trl.experimental.gmpo.reference import gmpo_contributions_reference

PRESET = {k: v for k, v in gmpo_balanced().items() if k.startswith("ratio_")}


def batch(seed, rows=10, width=8, spread=0.5, drift=0.0, garbage=True):
    """Ratios with a per-sequence drift, masks of lengths 0..width with holes, advantages of both signs (some 0,
    one NaN); NaN / inf on masked-out tokens and one real token of one row non-finite."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, width, generator=g, dtype=torch.float64) * spread
    log_ratio += torch.randn(rows, 1, generator=g, dtype=torch.float64) * drift
    ratio = log_ratio.exp()
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask = mask * (torch.rand(rows, width, generator=g) < 0.9).float()
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    advantages[0] = 0.0
    if garbage:
        ratio = torch.where(mask == 0, torch.tensor(math.nan, dtype=torch.float64), ratio)
        ratio[1, 0] = math.inf  # a real token with a non-finite ratio: left out of its sequence's mean
        advantages[2] = math.nan  # a non-finite advantage: its sequence reaches no sum
    return ratio, advantages, mask


def assert_same(fast, loop):
    got = fast.as_floats()
    assert (got["clip_low"], got["clip_high"]) == pytest.approx((loop["clip_low"], loop["clip_high"]), abs=1e-12)
    assert int(got["steps"]) == loop["steps"] and bool(got["target_met"]) == loop["target_met"]
    for name in ("positive_contribution", "positive_contribution_before"):
        if math.isnan(loop[name]):
            assert math.isnan(got[name])
        else:
            assert got[name] == pytest.approx(loop[name], rel=1e-9, abs=1e-12), (name, got, loop)


def fast_search(ratio, advantages, mask, **settings):
    config = BAPOSettings(**settings)
    return search_clip_bounds(ratio, advantages, mask, config=config, path=GEOMETRIC_MEAN.path(config),
                              sums_fn=GEOMETRIC_MEAN.grid_sums)


@pytest.mark.parametrize("variant", ["paper", "verl"])
@pytest.mark.parametrize("mode", ["value", "gradient"])
@pytest.mark.parametrize("path", ["default", "gmpo_balanced"])
def test_one_pass_matches_the_loop_on_random_batches(variant, mode, path):
    moved = stops = 0
    for seed in range(40):
        spread, drift = [(0.05, 0.0), (0.4, 0.3), (1.2, 0.8), (0.3, -0.6)][seed % 4]
        ratio, advantages, mask = batch(seed, spread=spread, drift=drift)
        settings = dict(bapo_variant=variant, positive_contribution_mode=mode,
                        positive_contribution_target=[0.3, 0.5, 0.7, 0.9][seed % 4],
                        **(PRESET if path == "gmpo_balanced" else {}))
        loop = loop_search(ratio, advantages, mask, contributions_fn=gmpo_contributions_reference(
            ratio, advantages, mask), **settings)
        assert_same(fast_search(ratio, advantages, mask, **settings), loop)
        moved += loop["steps"] > 0
        stops += 0 < loop["steps"] and loop["target_met"]
    # the batches make the search move, and (gradient share: raising c_low takes negatives' gradient away) stop
    # short of the path's end; the value share can only grow through c_high here, so it runs to the end
    assert moved >= 10 and (stops >= 2 or mode == "value")


@pytest.mark.parametrize("variant", ["paper", "verl"])
def test_ratios_on_the_grid_points_follow_the_loops_strict_bounds(variant):
    """A ratio exactly at ``c`` counts as clipped on either side, as the loop's ``r < c_high`` / ``r > c_low`` say
    (the convention, stated in geometric_mean.py; TRL's float32 log-ratios do not land on it in practice)."""
    config = BAPOSettings(bapo_variant=variant, positive_contribution_mode="gradient", **PRESET)
    path = GEOMETRIC_MEAN.path(config)
    points = torch.tensor(sorted(set(path.high_grid) | set(path.low_grid)), dtype=torch.float64)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        ratio = points[torch.randint(0, len(points), (6, 5), generator=g)]
        mask = (torch.rand(6, 5, generator=g) < 0.8).float()
        advantages = torch.randn(6, generator=g, dtype=torch.float64)
        settings = dict(bapo_variant=variant, positive_contribution_mode="gradient",
                        positive_contribution_target=0.3 + 0.03 * seed, **PRESET)
        loop = loop_search(ratio, advantages, mask, contributions_fn=gmpo_contributions_reference(
            ratio, advantages, mask), **settings)
        assert_same(fast_search(ratio, advantages, mask, **settings), loop)


def trl_gmpo_loss_terms(log_ratio, advantages, mask, c_low, c_high):
    """GMPO's loss written as TRL's GMPOTrainer forms it (clamp in log space, the sign-aware minimum / maximum, the
    mean over the loss mask, exp, ``-coef * A``), differentiated by autograd: per sign, the sum of ``|coef A|`` and
    of the gradient's magnitude over the tokens (what the value and the gradient share measure)."""
    log_ratio = log_ratio.clone().requires_grad_(True)
    clamped = torch.clamp(log_ratio, min=math.log(c_low), max=math.log(c_high))
    column = advantages[:, None]
    clipped = torch.where(column > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    coef = torch.exp((clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
    (-coef * advantages).sum().backward()
    grad = log_ratio.grad.abs().sum(-1)
    value = (coef * advantages.abs()).detach()
    keep = mask.sum(-1) > 0
    pos, neg = keep & (advantages > 0), keep & (advantages < 0)
    return value[pos].sum(), grad[pos].sum(), value[neg].sum(), grad[neg].sum()


@pytest.mark.parametrize("seed", range(6))
def test_the_sums_are_trls_gmpo_loss_and_its_gradient(seed):
    """Against GMPO's loss itself (not the plain loop, which reads it the same way this module does): at windows
    along the path, the value sums are ``sum |coef A|`` and the gradient sums the gradient's magnitude w.r.t. each
    token's log-probability, by sign."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(12, 9, generator=g, dtype=torch.float64) * [0.2, 0.6, 1.0][seed % 3]
    mask = (torch.rand(12, 9, generator=g) < 0.8).to(torch.float64)
    mask[3] = 0.0  # a sequence with no loss token: a constant loss, no gradient, left out
    advantages = torch.randn(12, generator=g, dtype=torch.float64)
    advantages[5] = 0.0
    path = GEOMETRIC_MEAN.path(BAPOSettings(**PRESET))
    packed = gmpo_sums(log_ratio.exp(), advantages, mask, path)
    H, L = len(path.high_grid), len(path.low_grid)
    for j, k in ((0, 0), (7, 3), (H - 1, L - 1)):
        c_low, c_high = path.low_grid[k], path.high_grid[j]
        pos_value, pos_grad, neg_value, neg_grad = trl_gmpo_loss_terms(log_ratio, advantages, mask, c_low, c_high)
        assert packed[j].item() == pytest.approx(pos_value.item(), rel=1e-12)
        assert packed[H + j].item() == pytest.approx(pos_grad.item(), rel=1e-12)
        assert packed[2 * H + k].item() == pytest.approx(neg_value.item(), rel=1e-12)
        assert packed[2 * H + L + k].item() == pytest.approx(neg_grad.item(), rel=1e-12)


def test_an_empty_micro_batch_reaches_no_sum():
    path = GEOMETRIC_MEAN.path(BAPOSettings())
    empty = torch.zeros(0, 4, dtype=torch.float64)
    packed = gmpo_sums(empty, torch.zeros(0, dtype=torch.float64), empty, path)
    assert not packed.any()
    result = fast_search(empty, torch.zeros(0), empty)
    assert result.as_floats()["steps"] == 0


def test_the_sums_are_the_definitions_at_every_grid_value():
    """Each grid value's four sums, against the per-sequence definition (value: w |A|; gradient: w |A| times the
    share of tokens inside), and the token counts."""
    ratio, advantages, mask = batch(7, spread=0.8)
    path = GEOMETRIC_MEAN.path(BAPOSettings(**PRESET))
    packed = gmpo_sums(ratio, advantages, mask, path)
    H, L = len(path.high_grid), len(path.low_grid)
    reference = gmpo_contributions_reference(ratio, advantages, mask)
    for j, c in enumerate(path.high_grid):
        for mode, at in (("value", j), ("gradient", H + j)):
            assert packed[at].item() == pytest.approx(reference(None, None, 1.0, c, mode)[0].item(), rel=1e-12)
    for j, c in enumerate(path.low_grid):
        for mode, at in (("value", 2 * H + j), ("gradient", 2 * H + L + j)):
            assert packed[at].item() == pytest.approx(reference(None, None, c, 1.0, mode)[1].item(), rel=1e-12)
    valid = (mask != 0) & torch.isfinite(ratio)
    reaching = valid & (advantages.nan_to_num(0.0) != 0)[:, None]
    assert packed[-2].item() == reaching.sum().item()
    assert packed[-1].item() == (mask != 0).sum().item() - valid.sum().item()


def test_two_processes_choose_what_one_process_chooses_from_the_whole_batch():
    ratio, advantages, mask = batch(11, rows=12, spread=0.7)
    whole = fast_search(ratio, advantages, mask, **PRESET)
    halves = [(ratio[:5], advantages[:5], mask[:5]), (ratio[5:], advantages[5:], mask[5:])]
    config = BAPOSettings(**PRESET)
    path = GEOMETRIC_MEAN.path(config)
    total = sum(gmpo_sums(*part, path) for part in halves)
    for part in halves:  # each rank's search with the other's sums added by the "collective"
        mine = gmpo_sums(*part, path)
        split = search_clip_bounds(*part, config=config, path=path, sums_fn=GEOMETRIC_MEAN.grid_sums,
                                   reduce_fn=lambda local, mine=mine: local - mine + total)
        assert split.as_floats() == pytest.approx(whole.as_floats())


def test_masked_and_nonfinite_tokens_never_reach_a_sum():
    """Changing what sits under the mask, or a real token whose ratio is not finite, changes nothing; a row of
    only masked tokens has no weight (GMPO: a constant loss, no gradient)."""
    ratio, advantages, mask = batch(3, garbage=False)
    path = GEOMETRIC_MEAN.path(BAPOSettings())
    clean = gmpo_sums(ratio, advantages, mask, path)
    dirty = torch.where(mask == 0, torch.tensor(math.inf, dtype=torch.float64), ratio)
    assert torch.equal(gmpo_sums(dirty, advantages, mask, path), clean)
    empty = mask.clone()
    empty[4] = 0
    without = gmpo_sums(ratio, advantages, empty, path)
    kept = torch.ones(len(ratio), dtype=torch.bool)
    kept[4] = False
    assert torch.allclose(without[:-2], gmpo_sums(ratio[kept], advantages[kept], mask[kept], path)[:-2],
                          rtol=1e-14, atol=0)


def test_per_sequence_advantages_only_and_no_two_sided_clip():
    ratio, advantages, mask = batch(5)
    path = GEOMETRIC_MEAN.path(BAPOSettings())
    with pytest.raises(ValueError, match="one advantage per sequence"):
        gmpo_sums(ratio, advantages[:, None].expand_as(ratio), mask, path)
    assert torch.equal(gmpo_sums(ratio, advantages[:, None], mask, path), gmpo_sums(ratio, advantages, mask, path))
    # the dual clip's delta is not GMPO's: the trainer's settings leave it out, and a path with it is refused
    with pytest.raises(ValueError, match="without delta"):
        gmpo_sums(ratio, advantages, mask, GEOMETRIC_MEAN.path(BAPOSettings(delta=3.0)))


def test_the_metrics_terms_add_up_to_each_sequences_share():
    """The per-token terms the metrics sum (fresh / replayed / by age: whole sequences) give the value sums."""
    ratio, advantages, mask = batch(9, garbage=False)
    path = GEOMETRIC_MEAN.path(BAPOSettings(**PRESET))
    packed = gmpo_sums(ratio, advantages, mask, path)
    H = len(path.high_grid)
    c_low, c_high = torch.tensor(path.low_grid[3], dtype=torch.float64), torch.tensor(path.high_grid[5],
                                                                                       dtype=torch.float64)
    valid = mask != 0
    r = torch.where(valid, ratio, 1.0)
    a = torch.where(valid, advantages[:, None].expand_as(ratio), 0.0)
    pos, neg = gmpo_contributions(r, a, c_low, c_high, valid=valid)
    assert pos.sum().item() == pytest.approx(packed[5].item(), rel=1e-12)
    assert neg.sum().item() == pytest.approx(packed[2 * H + 3].item(), rel=1e-12)


def test_the_metrics_shares_count_each_sequence_over_its_own_tokens():
    """The metrics' share sums (fresh / replayed, by age) take the loss type's terms with the valid tokens: a
    sequence's mean is over its own tokens, whatever sits under the mask."""
    from bapo_trl.core.clipping import SearchResult
    from bapo_trl.core.metrics import _share_sums

    ratio, advantages, mask = batch(13)
    path = GEOMETRIC_MEAN.path(BAPOSettings(**PRESET))
    packed = gmpo_sums(ratio, advantages, mask, path)
    H = len(path.high_grid)
    chosen = fast_search(ratio, advantages, mask, **PRESET)
    j, k = path.high_grid.index(chosen.as_floats()["clip_high"]), path.low_grid.index(chosen.as_floats()["clip_low"])
    sums, valid = _share_sums(chosen, ratio, advantages, mask, [torch.ones_like(mask, dtype=torch.bool)],
                              GEOMETRIC_MEAN)
    assert isinstance(chosen, SearchResult)
    assert sums[0].item() == pytest.approx(packed[j].item(), rel=1e-12)
    assert sums[1].item() == pytest.approx(packed[2 * H + k].item(), rel=1e-12)


def test_the_window_reaches_gmpo_as_log_space_bounds():
    assert gmpo_window(0.5, 2.0) == pytest.approx({"epsilon_low": math.log(2.0), "epsilon_high": math.log(2.0)})
    got = gmpo_window(torch.tensor(0.8, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64))
    assert got["epsilon_low"].item() == pytest.approx(-math.log(0.8))
    assert got["epsilon_high"].item() == pytest.approx(math.log(1.5))
    assert gmpo_balanced()["ratio_upper_start"] == pytest.approx(math.exp(0.4))  # TRL's documented GMPO window
    assert gmpo_balanced()["ratio_lower_start"] == pytest.approx(math.exp(-0.4))


@pytest.mark.parametrize("mode", ["value", "gradient"])
def test_trls_gmpo_loss_clips_with_the_window_the_plain_loop_chooses(tiny_model_dir, tmp_path, mode):
    """Stale data (4 updates per generation batch) on BAPOGMPOTrainer: TRL's GMPO loss runs (its clip metrics are
    logged), and at every stale update the window installed where it reads it (``epsilon_low = -log c_low``,
    ``epsilon_high = log c_high``) is the plain loop's choice on that micro-batch; the first update of each batch is
    on-policy (every ratio 1, the batch of the current version) and keeps TRL's documented GMPO window."""
    from bapo_trl.core.numerics import loss_mask
    from bapo_trl.experimental.gmpo import BAPOGMPOTrainer
    from support.harness import Probe, cpu_config, tiny_trainer

    class GMPOProbe(Probe, BAPOGMPOTrainer):
        pass

    calls = []

    def adapt(trainer, real, logps, inputs, *rest):
        real(logps, inputs, *rest)
        calls.append(((logps.detach().double() - inputs["old_per_token_logps"].double()).exp(), loss_mask(inputs),
                      inputs["advantages"].double(), float(trainer.epsilon_low), float(trainer.epsilon_high)))

    from bapo_trl.experimental.gmpo import GMPOBAPOConfig

    args = cpu_config(tmp_path, config_cls=GMPOBAPOConfig, positive_contribution_mode=mode,
                      per_device_train_batch_size=8, num_generations=4, steps_per_generation=4, max_steps=4,
                      max_completion_length=8, learning_rate=5e-2, logging_steps=1, save_strategy="no", seed=3)
    trainer = tiny_trainer(tiny_model_dir, args, cls=GMPOProbe, around={"_adapt_clip_window": adapt})
    trainer.train()
    assert len(calls) == 4
    (ratio, mask, _, eps_low, eps_high), stale = calls[0], calls[1:]
    assert float((ratio[mask.bool()] - 1).abs().max()) < 1e-5 and (eps_low, eps_high) == pytest.approx((0.4, 0.4))
    moved = 0
    for ratio, mask, advantages, eps_low, eps_high in stale:
        loop = loop_search(ratio, advantages, mask, contributions_fn=gmpo_contributions_reference(
            ratio, advantages, mask), positive_contribution_mode=mode, **PRESET)
        assert (eps_low, eps_high) == pytest.approx((-math.log(loop["clip_low"]), math.log(loop["clip_high"])),
                                                   rel=1e-5)
        moved += loop["steps"] > 0
    assert moved >= 1
    logged = [e for e in trainer.state.log_history if "bapo/clip_high" in e]
    assert len(logged) == 4
    for entry in logged:  # TRL's GMPO loss ran, and clipped the tokens BAPO's metrics say the window clips
        assert entry["clip_ratio/low_mean"] == pytest.approx(entry["bapo/clip_fraction_low"], abs=1e-6)
        assert entry["clip_ratio/high_mean"] == pytest.approx(entry["bapo/clip_fraction_high"], abs=1e-6)


@pytest.mark.parametrize("field, value, says", [
    ("importance_sampling_level", "sequence", "`importance_sampling_level` must be 'token'"),
    ("off_policy_mask_threshold", 0.5, "`off_policy_mask_threshold` (0.5) has no effect in GMPO's loss"),
    ("loss_type", "cispo", "`loss_type` ('cispo') has no effect with BAPOGMPOTrainer"),
    ("epsilon", 0.4, "GMPO reads its epsilons as log-space bounds"),  # GMPO's window written as GMPO users write it
    ("epsilon_high", 0.28, "/ `epsilon_high` (0.28) have no effect with BAPOGMPOTrainer"),
])
def test_what_gmpo_never_reads_is_refused_by_name_when_the_config_is_built(field, value, says, tmp_path):
    from bapo_trl.experimental.gmpo import GMPOBAPOConfig
    from support.harness import cpu_config

    settings = {field: value, **({"epsilon_high": 5.0} if value == "cispo" else {})}
    with pytest.raises(ValueError, match="Invalid GMPOBAPOConfig") as error:
        cpu_config(tmp_path, config_cls=GMPOBAPOConfig, **settings)
    assert says in str(error.value)


@pytest.mark.parametrize("config", ["GMPOConfig", "BAPOConfig"])
def test_another_config_is_refused_with_the_config_to_use(tiny_model_dir, tmp_path, config):
    """TRL's GMPOConfig and a plain BAPOConfig (whose path and checks are not GMPO's) are refused by the trainer."""
    from trl.experimental.gmpo import GMPOConfig

    from bapo_trl import BAPOConfig
    from bapo_trl.experimental.gmpo import BAPOGMPOTrainer  # (imports trl.experimental, quietly)
    from support.harness import CPU, tiny_trainer

    cls = GMPOConfig if config == "GMPOConfig" else BAPOConfig
    with pytest.raises(TypeError, match=rf"needs `args` to be a GMPOBAPOConfig, got {config}\..*GMPOBAPOConfig\("):
        tiny_trainer(tiny_model_dir, cls(output_dir=str(tmp_path), **CPU), cls=BAPOGMPOTrainer)


def test_what_gmpo_never_reads_warns_when_left_at_another_losss_value(tiny_model_dir, tmp_path):
    """The dual clip (BAPOConfig's default) and the weighted share act in TRL's clipped losses, not in GMPO's: each
    warns, by name; GMPOBAPOConfig's defaults warn of neither and train on GMPO's path."""
    import warnings

    from bapo_trl.experimental.gmpo import BAPOGMPOTrainer, GMPOBAPOConfig
    from support.harness import cpu_config, tiny_trainer

    with pytest.warns(UserWarning) as caught:
        cpu_config(tmp_path, config_cls=GMPOBAPOConfig, dual_clip=True, positive_contribution_is_weighted=True)
    said = " ".join(str(w.message) for w in caught)
    assert "`delta` (3.0, the dual clip's) has no effect with BAPOGMPOTrainer" in said
    assert "`positive_contribution_is_weighted` has no effect" in said
    with pytest.warns(UserWarning, match=r"`delta` \(2.0"):  # an explicit delta does not end GMPO's path either
        args = cpu_config(tmp_path, config_cls=GMPOBAPOConfig, delta=2.0)
    trainer = tiny_trainer(tiny_model_dir, args, cls=BAPOGMPOTrainer)
    assert trainer._bapo_settings.ratio_upper_max == 3.0 and trainer._bapo_settings.delta is None
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        trainer = tiny_trainer(tiny_model_dir, cpu_config(tmp_path, config_cls=GMPOBAPOConfig), cls=BAPOGMPOTrainer)
    assert not [w for w in quiet if "BAPOGMPOTrainer" in str(w.message)]
    assert trainer.loss is GEOMETRIC_MEAN  # the config's row: the window reaches GMPO's loss as log-space bounds
    assert {k: getattr(trainer.args, k) for k in gmpo_balanced()} == gmpo_balanced()


def test_the_studied_gmpo_settings_are_one_definition(tmp_path):
    """The studies' "BAPO GMPO balanced" and step_overhead's --variant gmpo are gmpo_balanced() on BAPOGMPOTrainer;
    the documented GMPO rival is TRL's GMPOTrainer with GMPOConfig's defaults, its BAPO-side twin that fixed window;
    the path has 37 upper and 16 lower points, as gspo_balanced()'s."""
    import sys

    from support.harness import cpu_config

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    import step_overhead
    import study

    from bapo_trl.experimental.gmpo.presets import GMPO_DOCUMENTED

    methods = study.evidence_methods()
    assert methods["BAPO GMPO balanced"] == dict(trainer="bapo-gmpo", settings=gmpo_balanced())
    rival = methods["TRL GMPO (documented)"]
    assert rival["trainer"] == "gmpo" and rival["settings"] == GMPO_DOCUMENTED
    twin = cpu_config(tmp_path, **rival["bapo"]["settings"]).bapo_settings
    assert (twin.ratio_lower_start, twin.ratio_upper_start) == pytest.approx((math.exp(-0.4), math.exp(0.4)))
    assert (twin.ratio_lower_max, twin.ratio_upper_max) == (twin.ratio_lower_start, twin.ratio_upper_start)
    from trl.experimental.gmpo import GMPOConfig

    documented = GMPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (documented.epsilon, documented.epsilon_high or documented.epsilon) == (0.4, 0.4)  # TRL's defaults
    assert step_overhead.VARIANTS["gmpo"]() == gmpo_balanced()
    assert [c.__name__ for c in step_overhead.CLASSES["gmpo"]] == ["GMPOBAPOConfig", "BAPOGMPOTrainer"]
    assert [c.__name__ for c in study.trainer_classes("bapo-gmpo")] == ["GMPOBAPOConfig", "BAPOGMPOTrainer"]
    path = GEOMETRIC_MEAN.path(cpu_config(tmp_path, **gmpo_balanced()).bapo_settings)
    assert len(path.high_grid) == 37 and len(path.low_grid) == 16 and path.high_grid[-1] == pytest.approx(3.0)


def test_trls_gmpo_runs_as_its_bapo_twin_where_only_bapo_runs(tmp_path):
    """Replay, partial rollout and async are BAPOTrainer's: the documented GMPO rival runs there as
    BAPOGMPOTrainer with its fixed window, as every TRL rival of the study does (a study once stopped at replay)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    import evidence_study
    import study

    for scenario in study.BAPO_ONLY:
        spec = evidence_study.spec_for("TRL GMPO (documented)", scenario, 1e-3, 100, 8)
        assert spec["trainer"] == "bapo-gmpo" and spec["settings"]["ratio_upper_max"] == pytest.approx(math.exp(0.4))
    assert evidence_study.spec_for("TRL GMPO (documented)", "spg 32", 1e-3, 100, 8)["trainer"] == "gmpo"
