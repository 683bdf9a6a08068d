"""The length-fair sequence-level balance (bapo_trl.experimental.length_fair, issue 53's candidate): its one-pass
search against the plain float64 loop, on random batches of varied lengths, masks, signs, modes, delta and process
splits; and the window's length fairness itself."""

import math

import pytest
import torch

from bapo_trl.experimental.length_fair.presets import GSPO_BAND
from bapo_trl.experimental.length_fair.reference import length_fair_loop_search
from bapo_trl.experimental.length_fair.search import (
    LengthFairSettings,
    length_fair_path,
    length_fair_search,
    length_fair_sums,
    sequence_bounds,
    sequence_statistics,
)

#: The band the studies dropped (1 to 4 standard errors on both sides): its widths are easy to read in a test.
WIDE = dict(band_upper_start=1.0, band_upper_max=4.0, band_upper_step=0.25,
            band_lower_start=4.0, band_lower_min=1.0, band_lower_step=0.25)


def length_fair_config(output_dir, **settings):
    from bapo_trl.experimental.length_fair import LengthFairBAPOConfig
    from support.harness import cpu_config

    return cpu_config(output_dir, config_cls=LengthFairBAPOConfig, **settings)


def length_fair_probe():
    from bapo_trl.experimental.length_fair import LengthFairBAPOTrainer
    from support.harness import probe_of

    return probe_of(LengthFairBAPOTrainer)


def batch(seed, rows=12, width=9, spread=0.3, drift=0.0, token_advantages=False):
    """Log-ratios with a per-sequence drift, masks of lengths 1..width (some empty), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, width, generator=g, dtype=torch.float64) * spread
    log_ratio += torch.randn(rows, 1, generator=g, dtype=torch.float64) * drift
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)
    shape = (rows, width) if token_advantages else (rows,)
    advantages = torch.randn(*shape, generator=g, dtype=torch.float64)
    return log_ratio, advantages, mask


def assert_same(fast, loop):
    got = fast.as_floats()
    for name in ("clip_low", "clip_high", "steps"):
        assert got[name] == pytest.approx(loop[name], abs=1e-12), (name, got, loop)
    assert bool(got["target_met"]) == loop["target_met"]
    for name in ("positive_contribution", "positive_contribution_before"):
        if math.isnan(loop[name]):
            assert math.isnan(got[name])
        else:
            assert got[name] == pytest.approx(loop[name], rel=1e-9, abs=1e-12), (name, got, loop)


SETTINGS = [
    dict(),
    dict(positive_contribution_mode="gradient"),
    dict(positive_contribution_mode="gradient", delta=1.3),
    dict(delta=1.1),
    dict(positive_contribution_target=0.7, band_upper_start=0.5, band_upper_max=3.0, band_upper_step=0.5,
         band_lower_start=3.0, band_lower_min=0.5, band_lower_step=0.5),
    dict(band_floor=0.05),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["value", "gradient", "gradient_delta", "value_delta",
                                                   "custom_path", "floor"])
@pytest.mark.parametrize("token_advantages", [False, True], ids=["row_adv", "token_adv"])
def test_one_pass_matches_the_loop_on_random_batches(settings, token_advantages):
    moved = 0
    for seed in range(30):
        spread, drift = [(0.05, 0.0), (0.3, 0.2), (1.0, 0.8)][seed % 3]
        log_ratio, advantages, mask = batch(seed, spread=spread, drift=drift, token_advantages=token_advantages)
        loop = length_fair_loop_search(log_ratio, advantages, mask, **settings)
        assert_same(length_fair_search(log_ratio, advantages, mask, **settings), loop)
        moved += loop["steps"] > 0
    assert moved >= 3  # the batches do make the search move


def test_a_sequences_statistics_come_from_its_whole_loss_mask_when_the_loss_drops_tokens():
    """TRL takes GSPO's sequence mean over its loss mask, then drops tokens (top-entropy, off-policy masks): the band
    is the whole sequence's, the shares count the kept tokens only."""
    for seed in range(10):
        log_ratio, advantages, mask = batch(seed, spread=0.5, drift=0.4, token_advantages=True)
        g = torch.Generator().manual_seed(100 + seed)
        kept = mask * (torch.rand(mask.shape, generator=g) < 0.6)
        loop = length_fair_loop_search(log_ratio, advantages, kept, statistics_mask=mask)
        assert_same(length_fair_search(log_ratio, advantages, kept, statistics_mask=mask), loop)


def test_two_processes_choose_what_one_process_chooses_from_the_whole_batch():
    """Each rank sums its own sequences; the one collective (here: adding the other half's vector, as an all-reduce
    sum would) gives every rank the whole batch's choice."""
    settings = LengthFairSettings()
    path = length_fair_path(settings)
    for seed in range(20):
        log_ratio, advantages, mask = batch(seed, rows=16, spread=0.6, drift=0.5)
        whole = length_fair_search(log_ratio, advantages, mask).as_floats()
        halves = [(log_ratio[:8], advantages[:8], mask[:8]), (log_ratio[8:], advantages[8:], mask[8:])]
        for rank in (0, 1):
            calls = []
            other = length_fair_sums(*halves[1 - rank], path, settings.band_floor)
            result = length_fair_search(*halves[rank], reduce_fn=lambda p: calls.append(1) or p + other).as_floats()
            assert calls == [1]  # exactly one collective
            for name in ("clip_low", "clip_high", "steps", "positive_contribution", "num_tokens"):
                assert result[name] == pytest.approx(whole[name], rel=1e-12, nan_ok=True), (seed, rank, name)


def test_masked_tokens_and_nonfinite_sequences_never_reach_a_sum():
    log_ratio, advantages, mask = batch(3, spread=0.5, drift=0.4)
    before = length_fair_search(log_ratio, advantages, mask).as_floats()
    garbage = log_ratio.clone()
    garbage[mask == 0] = float("nan")
    assert length_fair_search(garbage, advantages, mask).as_floats() == pytest.approx(before, nan_ok=True)
    row = int(mask.sum(-1).argmax())
    broken = log_ratio.clone()
    broken[row, 0] = float("inf")
    got = length_fair_search(broken, advantages, mask).as_floats()
    assert got["num_nonfinite"] == mask[row].sum()  # the sequence's mean is undefined: all its tokens are out
    kept = torch.ones(mask.shape[0], dtype=torch.bool)
    kept[row] = False
    assert got["clip_high"] == length_fair_search(log_ratio[kept], advantages[kept], mask[kept]).as_floats()[
        "clip_high"]


def test_the_band_is_as_wide_as_the_noise_of_the_sequences_mean():
    """Same token spread, lengths 2 and 32: the short sequence's band (in log R) is 4x the long one's; a one-token
    sequence and an on-policy one (no spread) get the floor."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 32, generator=g, dtype=torch.float64)
    tokens[0, :2] = torch.tensor([0.5, -0.5], dtype=torch.float64)
    tokens[1] = tokens[1] - tokens[1].mean()
    tokens[1] = tokens[1] / tokens[1].std(unbiased=False) * 0.5
    mask = torch.zeros(2, 32)
    mask[0, :2], mask[1] = 1, 1
    _, b = sequence_statistics(tokens, mask, band_floor=1e-6)
    assert b.tolist() == pytest.approx([0.5 / math.sqrt(2), 0.5 / math.sqrt(32)])
    one = torch.zeros(2, 4, dtype=torch.float64)
    _, floor = sequence_statistics(one, torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]]), band_floor=3e-4)
    assert floor.tolist() == [3e-4, 3e-4]
    c_low, c_high = sequence_bounds(b, torch.tensor(2.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    assert c_high[:, 0].log().tolist() == pytest.approx(b.tolist())
    assert c_low[:, 0].log().tolist() == pytest.approx((-2 * b).tolist())


def test_the_search_settings_default_to_the_band_the_studies_kept_as_the_config_does():
    """One source for the defaults (issue 78): the search's settings are the config's, GSPO_BAND and TRL's GSPO window
    as the band floor."""
    from bapo_trl.experimental.length_fair import LengthFairBAPOConfig

    config = LengthFairBAPOConfig(output_dir="unused", use_cpu=True, importance_sampling_level="sequence")
    settings = LengthFairSettings()
    for name in [*GSPO_BAND, "band_floor"]:
        assert getattr(settings, name) == getattr(config, name), name


def test_the_path_widens_the_positives_first_then_narrows_the_negatives():
    path = length_fair_path(LengthFairSettings(**WIDE))
    assert path.clip_high[:13] == [1.0 + 0.25 * k for k in range(13)] and path.clip_low[:13] == [4.0] * 13
    assert path.clip_low[13:] == [4.0 - 0.25 * k for k in range(1, 13)] and set(path.clip_high[13:]) == {4.0}
    assert len(path) == 25


def test_a_batch_of_only_negatives_runs_to_the_end_and_an_empty_one_meets_the_target():
    log_ratio, _, mask = batch(5, spread=0.5, drift=0.5)
    mask[:] = 1
    got = length_fair_search(log_ratio, -torch.ones(12, dtype=torch.float64), mask, **WIDE).as_floats()
    assert got["steps"] == 24 and not got["target_met"] and (got["clip_low"], got["clip_high"]) == (1.0, 4.0)
    empty = length_fair_search(log_ratio, torch.ones(12, dtype=torch.float64), torch.zeros_like(mask)).as_floats()
    assert empty["steps"] == 0 and empty["target_met"] and math.isnan(empty["positive_contribution"])


@pytest.mark.parametrize("field, value, says", [
    ("positive_contribution_target", 1.0, "`positive_contribution_target` must be in the open interval (0, 1)"),
    ("band_upper_step", 0.0, "`band_upper_step` must be > 0"),
    ("band_lower_step", 1e-5, "`band_lower_step` (1e-05) is too small"),
    ("band_lower_min", 5.0, "`band_lower_min` (5.0) must be <= `band_lower_start` (4.0)"),
    ("band_upper_start", 9.0, "`band_upper_start` (9.0) must be <= `band_upper_max` (4.0)"),
    ("band_floor", float("nan"), "`band_floor` must be a finite number"),
    ("positive_contribution_mode", "share", "`positive_contribution_mode` must be one of"),
    ("delta", 0.5, "`delta` must be None or a finite number >= 1"),
])
def test_a_bad_setting_is_refused_by_name(field, value, says):
    with pytest.raises(ValueError) as error:
        LengthFairSettings(**{**WIDE, field: value})
    assert says in str(error.value)


# -- in the trainer ---------------------------------------------------------------------------------------------------


def expected_windows(log_ratio, mask, k_low, k_high, floor=3e-4, delta=3.0):
    """Every sequence's window from the definitions, row by row."""
    rows = []
    for i in range(log_ratio.shape[0]):
        xs = [float(x) for x, m in zip(log_ratio[i], mask[i]) if m != 0]
        mean = sum(xs) / max(len(xs), 1)
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(len(xs), 1))
        b = max(sd / math.sqrt(max(len(xs), 1)), floor)
        rows.append((math.exp(-k_low * b), min(math.exp(k_high * b), delta)))
    return rows


@pytest.mark.parametrize("mode", ["value", "gradient"])
def test_trls_loss_clips_each_sequence_in_the_window_the_plain_loop_chooses(tiny_model_dir, tmp_path, mode):
    """Stale data (4 updates per generation batch), GSPO's ratio, loss grpo: at every update the widths the trainer
    chose are the plain loop's on that micro-batch (advantages weighted 1/L, as grpo's loss weighs tokens), and the
    window installed where TRL's clamp reads it (epsilon_low/high, one per sequence) is each sequence's own, from
    the definitions; the run logs the widths and the mean window."""
    from bapo_trl.core.numerics import loss_mask
    from support.harness import tiny_trainer

    calls, reductions = [], []

    def adapt(trainer, real, logps, inputs, *rest):
        port, counted = trainer.port, []
        reduce = port.sum_over_processes
        port.sum_over_processes = lambda tensor: counted.append(tensor.numel()) or reduce(tensor)
        try:
            real(logps, inputs, *rest)
        finally:
            port.sum_over_processes = reduce
        reductions.append(counted)
        calls.append((logps.detach().double(), inputs["old_per_token_logps"].double(), loss_mask(inputs),
                      inputs["advantages"].double(), trainer.epsilon_low.detach().double().clone(),
                      trainer.epsilon_high.detach().double().clone(), trainer.last_search.as_floats()))

    args = length_fair_config(tmp_path, loss_type="grpo", importance_sampling_level="sequence", **WIDE,
                              positive_contribution_mode=mode, per_device_train_batch_size=8, num_generations=4,
                              steps_per_generation=4, max_steps=4, max_completion_length=8, learning_rate=5e-2,
                              logging_steps=1, save_strategy="no", seed=3)
    trainer = tiny_trainer(tiny_model_dir, args, cls=length_fair_probe(), around={"_adapt_clip_window": adapt})
    trainer.train()
    assert len(calls) == 4
    distinct = moved = 0
    for logps, old, mask, advantages, eps_low, eps_high, chosen in calls:
        log_ratio = logps - old
        weighted = advantages[:, None] / mask.sum(-1, keepdim=True).clamp(min=1.0)
        loop = length_fair_loop_search(log_ratio, weighted, mask, positive_contribution_mode=mode, delta=3.0, **WIDE)
        assert (chosen["clip_low"], chosen["clip_high"], chosen["steps"]) == pytest.approx(
            (loop["clip_low"], loop["clip_high"], loop["steps"]))
        assert eps_low.shape == eps_high.shape == (8, 1)
        windows = expected_windows(log_ratio, mask, loop["clip_low"], loop["clip_high"])
        assert (1 - eps_low[:, 0]).tolist() == pytest.approx([w[0] for w in windows], rel=1e-5, abs=1e-6)
        assert (1 + eps_high[:, 0]).tolist() == pytest.approx([w[1] for w in windows], rel=1e-5, abs=1e-6)
        distinct += len({(round(w[0], 9), round(w[1], 9)) for w in windows}) > 1
        moved += loop["steps"] > 0
    assert distinct >= 3 and moved >= 1  # stale updates: the sequences' windows differ, the search moves
    logged = [e for e in trainer.state.log_history if "bapo/band_upper" in e]
    assert len(logged) == 4 and all(1.0 <= e["bapo/band_upper"] <= 4.0 and 1.0 <= e["bapo/band_lower"] <= 4.0
                                    and e["bapo/clip_low"] < 1.0 < e["bapo/clip_high"] for e in logged)
    active = 0
    for entry, (logps, old, mask, _, eps_low, eps_high, chosen) in zip(logged, calls):
        rows = mask.sum(-1) > 0  # the logged mean window: over the sequences with a token in the loss
        if entry["bapo/search_active"]:  # the installed window and the chosen widths
            active += 1
            low, high = (1 - eps_low[rows, 0]).mean().item(), (1 + eps_high[rows, 0]).mean().item()
            widths = chosen["clip_low"], chosen["clip_high"]
        else:  # no window of the path changes this update: reported at the path's start, as the fixed search is
            widths = (4.0, 1.0)
            windows = expected_windows(logps - old, mask, *widths)
            low, high = (sum(w[i] for w, keep in zip(windows, rows) if keep) / int(rows.sum()) for i in (0, 1))
        assert (entry["bapo/clip_low"], entry["bapo/clip_high"]) == pytest.approx((low, high), rel=1e-4)
        assert (entry["bapo/band_lower"], entry["bapo/band_upper"]) == pytest.approx(widths, rel=1e-4)
    assert active >= 1
    # one sum for the search, one for every metric (the mean window's three sums ride in it): 2 per update
    assert [len(counted) for counted in reductions] == [2] * 4, reductions


@pytest.mark.parametrize("settings, says", [
    (dict(), "it needs `importance_sampling_level='sequence'` (GSPO's ratio), got 'token'"),
    (dict(importance_sampling_level="sequence", loss_type="cispo"),
     "needs a clipped loss (grpo, bnpo, dr_grpo, dapo, luspo), got loss_type='cispo'"),
    (dict(importance_sampling_level="sequence", band_upper_step=-1.0), "`band_upper_step` must be > 0"),
])
def test_a_bad_length_fair_setting_is_refused_by_name(settings, says, tmp_path):
    with pytest.raises(ValueError) as error:
        length_fair_config(tmp_path, **settings)
    assert says in str(error.value)


def test_the_old_fields_are_refused_and_the_old_paths_are_gone(tmp_path):
    """BAPOConfig(sequence_window=...) of the development versions is an unknown argument (the command line's flag
    too); the candidate's old paths are gone, not aliased (issue 78: nothing deprecated before the first release)."""
    import bapo_trl
    from bapo_trl.cli.train import make_parser, run
    from support.harness import cpu_config

    with pytest.raises(TypeError, match="sequence_window"):
        cpu_config(tmp_path, sequence_window="length_fair")
    with pytest.raises(SystemExit):
        run(["--sequence_window", "length_fair", "--output_dir", str(tmp_path), "--use_cpu"], parser=make_parser())
    with pytest.raises(ImportError):
        from bapo_trl.core import length_fair  # noqa: F401
    assert not hasattr(bapo_trl, "gspo_length_fair")


def test_settings_the_chosen_window_never_reads_warn(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        length_fair_config(tmp_path, importance_sampling_level="sequence", ratio_upper_max=2.0)
    said = [str(w.message) for w in caught if "no effect" in str(w.message)]
    assert any("`ratio_upper_max` has no effect: the length-fair window's path is band_upper_*" in s
               for s in said), said


def test_the_studied_settings_are_one_definition_and_valid_configs(tmp_path):
    """The studies' "BAPO length-fair narrow" is LengthFairBAPOConfig(**gspo_length_fair()) with the config's default
    band (GSPO_BAND) and "BAPO length-fair" the wide band on top; step_overhead's --variant length-fair is
    gspo_length_fair()."""
    import sys

    from bapo_trl.experimental.length_fair import gspo_length_fair

    config = length_fair_config(tmp_path, **gspo_length_fair())
    settings = config.length_fair_settings
    assert config.importance_sampling_level == "sequence" and config.loss_type == "grpo" and config.beta == 0
    assert {f: getattr(settings, f) for f in GSPO_BAND} == GSPO_BAND
    path = length_fair_path(settings)
    assert len(path.high_grid) == 37 and len(path.low_grid) == 16  # gspo_balanced's 37 and 16 points
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    import step_overhead
    import study

    methods = study.evidence_methods()
    assert methods["BAPO length-fair narrow"] == dict(trainer="bapo-length-fair", settings=gspo_length_fair())
    assert methods["BAPO length-fair"] == dict(trainer="bapo-length-fair", settings=dict(gspo_length_fair(), **WIDE))
    assert study.LENGTH_FAIR_WIDE == WIDE
    assert step_overhead.VARIANTS["length-fair"]() == gspo_length_fair()


NARROW = GSPO_BAND  # the narrow band: its widths move with small changes of a sequence's band


def test_with_tokens_the_loss_drops_the_band_still_comes_from_the_whole_loss_mask(tiny_model_dir, tmp_path):
    """TRL's ``top_entropy_quantile`` < 1 drops tokens from the loss: the search balances the kept tokens, but each
    sequence's band (its mean log-ratio's standard error) comes from its whole loss mask, as GSPO's sequence mean
    does. At every update the trainer's widths and share are the plain loop's with exactly that split, and on this
    run the split matters (with the band over the kept tokens only, the loop's choice or share differs somewhere)."""
    from bapo_trl.core.numerics import loss_mask
    from support.harness import tiny_trainer

    calls = []

    def adapt(trainer, real, logps, inputs, entropies, *rest):
        real(logps, inputs, entropies, *rest)
        mask = loss_mask(inputs)
        kept = mask * trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        calls.append((logps.detach().double() - inputs["old_per_token_logps"].double(), mask, kept,
                      inputs["advantages"].double(), trainer.last_search.as_floats()))

    args = length_fair_config(tmp_path, loss_type="grpo", importance_sampling_level="sequence",
                              top_entropy_quantile=0.5, per_device_train_batch_size=8, num_generations=4, **NARROW,
                              steps_per_generation=4, max_steps=4, max_completion_length=8, learning_rate=5e-2,
                              logging_steps=1, save_strategy="no", seed=3)
    trainer = tiny_trainer(tiny_model_dir, args, cls=length_fair_probe(), around={"_adapt_clip_window": adapt})
    trainer.train()
    assert len(calls) == 4
    differs = 0
    for log_ratio, mask, kept, advantages, chosen in calls:
        weighted = advantages[:, None] / mask.sum(-1, keepdim=True).clamp(min=1.0)
        assert kept.sum() < mask.sum()  # the quantile dropped tokens
        loop = length_fair_loop_search(log_ratio, weighted, kept, statistics_mask=mask, delta=3.0, **NARROW)
        figures = ("clip_low", "clip_high", "steps", "positive_contribution")
        assert [chosen[k] for k in figures] == pytest.approx([loop[k] for k in figures], rel=1e-6)
        kept_only = length_fair_loop_search(log_ratio, weighted, kept, delta=3.0, **NARROW)
        differs += [kept_only[k] for k in figures] != pytest.approx([loop[k] for k in figures], rel=1e-6)
    assert differs >= 1
