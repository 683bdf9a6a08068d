"""The vectorised bound search against the plain loops, plus the facts the spec states about it."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bapo_trl import search_clip_bounds
from bapo_trl.core.clipping import BAPOSettings, search_path
from bapo_trl.core.clipping_reference import contributions, loop_search
from support.clipping_batches import adversarial_batches, assert_same_choice, random_batch

VARIANT_MODES = [("paper", "value"), ("paper", "gradient"), ("verl", "value"), ("verl", "gradient")]


@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
def test_matches_loop_on_thousands_of_random_batches(variant, mode):
    gen = torch.Generator().manual_seed(0)
    stops = set()
    for case in range(600):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        length = int(torch.randint(1, 12, (1,), generator=gen))
        spread = float(torch.rand(1, generator=gen)) * 1.5
        bias = float(torch.randn(1, generator=gen))
        ratio, adv, mask = random_batch(gen, batch, length, spread, bias)
        target = float(torch.rand(1, generator=gen) * 0.9 + 0.05)
        if case % 2:  # aim the target at a random point of the path so the search stops mid-way
            path = search_path(BAPOSettings(bapo_variant=variant))
            k = int(torch.randint(0, len(path), (1,), generator=gen))
            r, a = ratio[mask != 0].double(), adv[:, None].expand_as(ratio)[mask != 0].double()
            pos, neg = contributions(r, a, path.clip_low[k], path.clip_high[k], mode)
            if pos + neg > 0 and 0.01 < float(pos / (pos + neg)) < 0.99:
                target = float(pos / (pos + neg)) - 1e-7
        kw = dict(bapo_variant=variant, positive_contribution_mode=mode, positive_contribution_target=target)
        stops.add(int(search_clip_bounds(ratio, adv, mask, **kw).steps))
        assert_same_choice(search_clip_bounds(ratio, adv, mask, **kw), loop_search(ratio, adv, mask, **kw))
    assert len(stops) > 20, f"the random cases must stop all along the path, saw {sorted(stops)}"


@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=adversarial_batches(), target=st.floats(0.01, 0.99))
def test_matches_loop_on_adversarial_batches(variant, mode, data, target):
    ratio, adv, mask = data
    kw = dict(bapo_variant=variant, positive_contribution_mode=mode, positive_contribution_target=target)
    assert_same_choice(search_clip_bounds(ratio, adv, mask, **kw), loop_search(ratio, adv, mask, **kw))


@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
def test_matches_loop_with_custom_ranges(variant, mode):
    gen = torch.Generator().manual_seed(1)
    ranges = [
        dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.2, ratio_upper_max=2.0),
        dict(ratio_lower_start=0.5, ratio_lower_max=0.95, ratio_lower_step=0.07, ratio_upper_max=1.2),
        dict(ratio_lower_start=0.6, ratio_lower_max=0.8, ratio_lower_step=0.05, ratio_upper_step=0.05,
             ratio_upper_max=2.0),
        dict(ratio_upper_start=1.0, ratio_upper_max=1.33, ratio_upper_step=0.1),
    ]
    for extra in ranges:
        for _ in range(100):
            ratio, adv, mask = random_batch(gen, 6, 10, 0.8, float(torch.randn(1, generator=gen)))
            kw = dict(bapo_variant=variant, positive_contribution_mode=mode, **extra)
            assert_same_choice(search_clip_bounds(ratio, adv, mask, **kw), loop_search(ratio, adv, mask, **kw))


# -- TRL's two-sided clip `delta`: a negative above it has no gradient (loss -delta A) --------------------------------

#: (delta, settings): at the end of the upper path (as BAPOConfig ends it there) or above it.
DELTAS = [(3.0, {}), (4.5, {}), (2.03, dict(ratio_upper_max=2.03)), (1.2, dict(ratio_upper_max=1.2))]


def same_float(x, y, rel=1e-9):
    return (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=rel, abs=1e-12)


@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
def test_matches_loop_with_delta_on_random_batches(variant, mode):
    """With `delta` the fast path still equals the loops (many ratios above delta, NaN / inf on padding, masked-out
    tokens); the gradient share reported for the metrics (whatever the mode) leaves out the negatives above delta;
    the value share and its choice are the ones without delta."""
    gen = torch.Generator().manual_seed(2)
    stops, excluded = set(), 0
    for case in range(300):
        delta, extra = DELTAS[case % len(DELTAS)]
        batch, length = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        spread = float(torch.rand(1, generator=gen)) * 2.5
        ratio, adv, mask = random_batch(gen, batch, length, spread, float(torch.randn(1, generator=gen)))
        kw = dict(bapo_variant=variant, positive_contribution_mode=mode, delta=delta, **extra,
                  positive_contribution_target=float(torch.rand(1, generator=gen) * 0.9 + 0.05))
        r, a = ratio[mask != 0].double(), adv[:, None].expand_as(ratio)[mask != 0].double()
        if case % 2:  # aim the target at a random point of the path so the search stops mid-way
            path = search_path(BAPOSettings(**{k: v for k, v in kw.items() if k != "positive_contribution_target"}))
            k = int(torch.randint(0, len(path), (1,), generator=gen))
            pos, neg = contributions(r, a, path.clip_low[k], path.clip_high[k], mode, delta)
            if pos + neg > 0 and 0.01 < float(pos / (pos + neg)) < 0.99:
                kw["positive_contribution_target"] = float(pos / (pos + neg)) - 1e-7
        fast = search_clip_bounds(ratio, adv, mask, **kw)
        stops.add(int(fast.steps))
        assert_same_choice(fast, loop_search(ratio, adv, mask, **kw))
        f = fast.as_floats()
        pos, neg = contributions(r, a, f["clip_low"], f["clip_high"], "gradient", delta)
        assert same_float(f["gradient_share"], float(pos / (pos + neg)) if pos + neg > 0 else math.nan)
        excluded += bool(((a < 0) & (r > delta)).any())
        if mode == "value":
            without = search_clip_bounds(ratio, adv, mask, **{**kw, "delta": None}).as_floats()
            for key in ("clip_low", "clip_high", "steps", "value_share", "positive_contribution_before"):
                assert same_float(f[key], without[key]), key
    assert len(stops) > 15 and excluded > 100, (sorted(stops), excluded)


@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=adversarial_batches(), target=st.floats(0.01, 0.99), delta=st.sampled_from(range(3)))
def test_matches_loop_with_delta_on_adversarial_batches(variant, mode, data, target, delta):
    """Ratios exactly at delta (3.0, 3.5, 2.0 are among the adversarial grid points) keep their gradient: TRL's clamp
    passes it at the bound."""
    ratio, adv, mask = data
    delta, extra = [(3.0, {}), (3.5, {}), (2.0, dict(ratio_upper_max=2.0))][delta]
    kw = dict(bapo_variant=variant, positive_contribution_mode=mode, positive_contribution_target=target,
              delta=delta, **extra)
    assert_same_choice(search_clip_bounds(ratio, adv, mask, **kw), loop_search(ratio, adv, mask, **kw))


def test_delta_takes_negatives_above_it_out_of_the_gradient_share_only():
    ratio = torch.tensor([[1.0, 1.0], [5.0, 1.0]])  # one negative token far above delta = 3
    adv = torch.tensor([1.0, -1.0])
    kw = dict(positive_contribution_mode="gradient", positive_contribution_target=0.1)
    plain = search_clip_bounds(ratio, adv, torch.ones(2, 2), **kw).as_floats()
    dual = search_clip_bounds(ratio, adv, torch.ones(2, 2), delta=3.0, **kw).as_floats()
    assert plain["gradient_share"] == pytest.approx(2 / 8) and dual["gradient_share"] == pytest.approx(2 / 3)
    assert plain["value_share"] == dual["value_share"] == pytest.approx(2 / 8)
    at_delta = search_clip_bounds(ratio.clamp(max=3.0), adv, torch.ones(2, 2), delta=3.0, **kw).as_floats()
    assert at_delta["gradient_share"] == pytest.approx(2 / 6)  # r == delta: the clamp still passes the gradient


def test_delta_below_the_upper_path_is_refused():
    for bad in (2.0, float("nan"), "3"):
        with pytest.raises(ValueError, match=r"`delta` must be None or a finite number >= `ratio_upper_max` \(3.0\)"):
            BAPOSettings(delta=bad)
    assert search_path(BAPOSettings(delta=2.0, ratio_upper_max=2.0)).delta == 2.0

def test_default_path_has_52_points_and_reaches_the_maxima():
    path = search_path(BAPOSettings())
    assert len(path) == 1 + 36 + 15
    assert path.clip_high[36] == pytest.approx(3.0) and path.clip_low[36] == 0.6
    assert path.clip_low[-1] == pytest.approx(0.9)  # 0.6 + 15 * 0.02 must reach 0.9
    # the upper bound moves first in the paper; the lower bound first in the official code
    verl = search_path(BAPOSettings(bapo_variant="verl"))
    assert verl.clip_low[1] > 0.6 and verl.clip_high[1] == 1.2
    assert verl.clip_low[-1] == pytest.approx(0.9) and verl.clip_high[-1] == pytest.approx(3.0)


def test_no_lower_room_means_no_move_at_all_in_the_paper_loop():
    # Algorithm 1's loop condition is `c_low + d- <= b-`: with no room below, even c_high stays.
    path = search_path(BAPOSettings(ratio_lower_start=0.8, ratio_lower_max=0.8))
    assert len(path) == 1


def _ratio_adv(values, advs):
    return torch.tensor([values]), torch.tensor([advs]), torch.ones(1, len(values))


def test_value_share_falls_when_c_low_rises_and_gradient_share_rises():
    """The spec's caveat: under the value share raising c_low LOWERS rho; under the gradient share it raises it."""
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(2000, generator=gen, dtype=torch.float64) * 2.5 + 0.05
    a = torch.randn(2000, generator=gen, dtype=torch.float64)
    for c_high in (1.2, 2.0, 3.0):
        shares = {"value": [], "gradient": []}
        for c_low in (0.6, 0.7, 0.8, 0.9):
            for mode in shares:
                pos, neg = contributions(r, a, c_low, c_high, mode)
                shares[mode].append(float(pos / (pos + neg)))
        assert all(x > y for x, y in zip(shares["value"], shares["value"][1:]))
        assert all(x < y for x, y in zip(shares["gradient"], shares["gradient"][1:]))
    # raising c_high raises the share in both modes
    for mode in ("value", "gradient"):
        values = [contributions(r, a, 0.6, c, mode) for c in (1.2, 1.5, 2.0, 3.0)]
        shares = [float(p / (p + n)) for p, n in values]
        assert all(x < y for x, y in zip(shares, shares[1:]))


def test_more_positive_weight_never_needs_a_wider_window():
    """Monotonicity along the path: scaling up positive advantages can only stop the search earlier."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        ratio, adv, mask = random_batch(gen, 8, 16, 0.7, -0.3, garbage=False)
        base = int(search_clip_bounds(ratio, adv, mask).steps)
        boosted = int(search_clip_bounds(ratio, torch.where(adv > 0, adv * 2, adv), mask).steps)
        assert boosted <= base


def test_on_policy_batch_stays_at_start_unless_negatives_dominate():
    ones = torch.ones(4, 5)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    res = search_clip_bounds(ones, adv, torch.ones(4, 5)).as_floats()
    assert (res["clip_low"], res["clip_high"], res["steps"]) == (0.6, 1.2, 0)
    assert res["positive_contribution"] == pytest.approx(0.5)


def test_negatives_dominating_with_high_ratios_moves_c_high():
    ratio = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.5])
    res = search_clip_bounds(ratio, adv, torch.ones(2, 3)).as_floats()
    # pos = 3 * min(2, c_high); neg = 3 * 1.5; share >= 0.5 needs min(2, c_high) >= 1.5 -> c_high = 1.5
    assert res["clip_high"] == pytest.approx(1.5) and res["clip_low"] == 0.6 and res["target_met"] == 1.0
    assert res["steps"] == 6


def test_edge_cases_count_as_meeting_the_target():
    empty = search_clip_bounds(torch.ones(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3)).as_floats()
    assert empty["steps"] == 0 and empty["target_met"] == 1.0 and math.isnan(empty["positive_contribution"])
    zero = search_clip_bounds(torch.ones(2, 3), torch.zeros(2), torch.ones(2, 3)).as_floats()
    assert zero["steps"] == 0 and zero["target_met"] == 1.0
    no_tokens = search_clip_bounds(torch.ones(0, 0), torch.zeros(0), torch.ones(0, 0)).as_floats()
    assert no_tokens["steps"] == 0 and no_tokens["num_tokens"] == 0


def test_all_negative_runs_to_the_end_of_the_path():
    res = search_clip_bounds(torch.ones(2, 3), torch.tensor([-1.0, -2.0]), torch.ones(2, 3)).as_floats()
    assert res["steps"] == 51 and res["target_met"] == 0.0
    assert res["clip_low"] == pytest.approx(0.9) and res["clip_high"] == pytest.approx(3.0)


def test_nonfinite_real_tokens_are_counted_not_summed():
    ratio = torch.tensor([[1.0, math.nan, math.inf], [1.0, 1.0, 1.0]])
    res = search_clip_bounds(ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 3)).as_floats()
    assert res["num_nonfinite"] == 2 and res["num_tokens"] == 4
    assert math.isfinite(res["positive_contribution"])


def test_reduce_fn_is_called_exactly_once_and_decides():
    calls = []

    def fake_world_of_two(t):  # stands in for an all-reduce over 2 ranks holding the same data
        calls.append(t.shape)
        return t * 2

    ratio, adv, mask = random_batch(torch.Generator().manual_seed(5), 8, 8, 0.5, -0.5, garbage=False)
    res = search_clip_bounds(ratio, adv, mask, reduce_fn=fake_world_of_two)
    assert len(calls) == 1
    # doubling every sum changes no share, so the choice is the local one; token counts double
    local = search_clip_bounds(ratio, adv, mask)
    assert res.as_floats()["clip_high"] == local.as_floats()["clip_high"]
    assert res.as_floats()["num_tokens"] == 2 * local.as_floats()["num_tokens"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_inputs(dtype):
    ratio, adv, mask = random_batch(torch.Generator().manual_seed(6), 8, 8, 0.6, -0.4, garbage=False)
    fast = search_clip_bounds(ratio.to(dtype), adv.to(dtype), mask)
    ref = loop_search(ratio.to(dtype), adv.to(dtype), mask)
    assert_same_choice(fast, ref)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="`mask`"):
        search_clip_bounds(torch.ones(2, 3), torch.ones(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="`advantages`"):
        search_clip_bounds(torch.ones(2, 3), torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="positive_contribution_target"):
        search_clip_bounds(torch.ones(2, 3), torch.ones(2), torch.ones(2, 3), positive_contribution_target=1.5)


@pytest.mark.parametrize("search", ["fast", "loop"])
@pytest.mark.parametrize("variant", ["paper", "verl"])
def test_the_target_tolerance_is_the_documented_literal_on_a_hand_computed_batch(variant, search):
    """Issue 75, finding 10: the plain loops import the fast path's tolerance, so a change of it (1e-9 -> 1e-3) left
    every comparison of the two equal. Here the numbers are written out: every ratio is 1 (no bound clips), so the
    share is 0.49975 / (0.49975 + 0.50025) = 0.49975 (verl: pos / neg = 0.999) at every point of the path. Against
    the target 0.5 (verl: 1.0) with the documented tolerance 1e-9 that is NOT met: the search walks the whole path
    (36 upper steps, then 15 lower) and ends unmet; a share of exactly 0.5 meets at the start (paper), but not for
    the verl variant, whose ``pos / (neg + 1e-8)`` stays below 1 - 1e-9 (the official code's epsilon). A tolerance of
    1e-3 would count 0.49975 as met and take no step; an epsilon of 0 would meet the exact balance."""
    run = search_clip_bounds if search == "fast" else loop_search
    ratio, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2)
    short = torch.tensor([[0.49975, -0.50025]], dtype=torch.float64)
    result = run(ratio, short, mask, bapo_variant=variant)
    chosen = result.as_floats() if hasattr(result, "as_floats") else result
    assert chosen["target_met"] == 0.0 and chosen["steps"] == 36 + 15, chosen
    assert chosen["positive_contribution"] == pytest.approx(0.49975, abs=1e-12)
    even = run(ratio, torch.tensor([[0.5, -0.5]], dtype=torch.float64), mask, bapo_variant=variant)
    even = even.as_floats() if hasattr(even, "as_floats") else even
    if variant == "paper":
        assert even["target_met"] == 1.0 and even["steps"] == 0 and even["clip_high"] == pytest.approx(1.2)
    else:  # the official code's pos / (neg + 1e-8) = 1 - 2e-8 < 1 - 1e-9: exact balance is not met there
        assert even["target_met"] == 0.0 and even["steps"] == 15 + 36, even


@pytest.mark.parametrize("window", [(0.8, 1.0), (1.0, 1.2), (0.8, 1.2), (1.0, 1.0)])
def test_a_ratio_exactly_on_a_bound_counts_as_trls_loss_gives_it_its_gradient(window):
    """Issue 75 (11): on-policy tokens (ratio exactly 1.0) and tokens exactly on a bound get TRL's full gradient (the
    clipped and the unclipped branch are equal there and both carry it; torch splits the tie between them), so the
    gradient share counts them. The truth is autograd through TRL's token loss ``-min(r A, clip(r) A)``, with the path
    pinned to one window; seen failing with the old rule (a positive on ``c_high`` or a negative on ``c_low`` left
    out)."""
    c_low, c_high = window
    ratio = torch.tensor([[1.0, c_high, c_low, 1.1, 0.9, 2.0], [1.0, c_low, c_high, 0.7, 1.3, 0.95]],
                         dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    a = adv[:, None]
    loss = -torch.min(ratio * a, ratio.clamp(c_low, c_high) * a).sum()
    loss.backward()
    weight = ratio.detach() * ratio.grad.abs()  # r |A| on the tokens that carry a gradient, 0 elsewhere
    expected = float(weight[0].sum() / weight.sum())
    pinned = dict(ratio_lower_start=c_low, ratio_lower_max=c_low, ratio_upper_start=c_high, ratio_upper_max=c_high,
                  positive_contribution_mode="gradient")
    fast = search_clip_bounds(ratio.detach(), adv, torch.ones(2, 6), **pinned).as_floats()
    assert (fast["clip_low"], fast["clip_high"]) == window
    assert fast["gradient_share"] == pytest.approx(expected, rel=1e-12)
    pos, neg = contributions(ratio.detach().flatten(), a.expand(2, 6).flatten(), c_low, c_high, "gradient")
    assert float(pos / (pos + neg)) == pytest.approx(expected, rel=1e-12)
