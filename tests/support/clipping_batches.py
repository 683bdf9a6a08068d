"""Batches for checking the vectorised clipping-bound search against its loop reference (random ones and
Hypothesis' adversarial ones), and the check that both choose the same bounds."""

import math

import pytest
import torch
from hypothesis import strategies as st


def assert_same_choice(fast, ref):
    f = fast.as_floats()
    assert f["clip_low"] == pytest.approx(ref["clip_low"], abs=1e-9)
    assert f["clip_high"] == pytest.approx(ref["clip_high"], abs=1e-9)
    assert int(f["steps"]) == ref["steps"]
    assert bool(f["target_met"]) == ref["target_met"]
    for key in ("positive_contribution", "positive_contribution_before"):
        if math.isnan(ref[key]):
            assert math.isnan(f[key])
        else:
            assert f[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12)


def random_batch(gen, batch, length, spread, positive_bias=0.0, mask_p=0.8, garbage=True):
    log_ratio = torch.randn(batch, length, generator=gen) * spread
    ratio = log_ratio.exp()
    advantages = torch.randn(batch, generator=gen) + positive_bias
    # completions of different lengths (left-aligned like TRL's completion mask)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    mask = mask * (torch.rand(batch, length, generator=gen) < mask_p + 0.2).float()
    if garbage:  # NaN / inf on padding must never leak into the sums
        junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30])
        pick = torch.randint(0, 4, (batch, length), generator=gen)
        ratio = torch.where(mask == 0, junk[pick], ratio)
    return ratio, advantages, mask


finite_ratios = st.floats(min_value=1e-6, max_value=50.0, allow_nan=False, allow_infinity=False)
advantage_values = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]) | st.floats(-5, 5, allow_nan=False)


@st.composite
def adversarial_batches(draw):
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 6))
    n = batch * length
    # ratios sitting exactly on grid points stress the tie rules (min/max are continuous there, but r < c_high
    # and r > c_low are strict in the gradient share)
    grid_points = st.sampled_from([0.6, 0.62, 0.7, 0.9, 1.0, 1.2, 1.25, 2.0, 3.0, 0.5, 3.5])
    ratios = draw(st.lists(finite_ratios | grid_points, min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    per_token = draw(st.booleans())
    adv = draw(st.lists(advantage_values, min_size=n if per_token else batch, max_size=n if per_token else batch))
    ratio = torch.tensor(ratios, dtype=torch.float32).view(batch, length)
    advantages = torch.tensor(adv).view(batch, length) if per_token else torch.tensor(adv)
    return ratio, advantages, torch.tensor(mask).view(batch, length)
