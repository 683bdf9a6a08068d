"""Plain, loop-by-loop versions of the bound search, kept as the ground truth for tests and benchmarks.

Reference code: the trainer never imports it. It ships in the package only so that the tests, the benchmarks and a
user checking the fast path on their own batches can import it (``from bapo_trl.clipping_reference import ...``).

* :func:`paper_loop_search` is Algorithm 1 of the paper written as the paper writes it: a ``while`` loop that
  re-scores the batch for every candidate.
* :func:`verl_loop_search` follows the official verl recipe's structure: a Python loop that, for every candidate,
  computes the sums, all-reduces them and reads them back to the host before deciding.

Both compute every sum directly from the definitions (``min(r, c_high) * A`` ...), in float64, with none of the
bucketing of :mod:`bapo_trl.clipping`; they are slow on purpose. Grid points are ``start + k * step`` with integer
``k`` (no accumulated floating drift), the same convention as the fast path.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .clipping import GRID_TOLERANCE, TARGET_TOLERANCE, VERL_EPS, BAPOSettings


def _flat_valid(ratio, advantages, mask):
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.expand_as(ratio)
    valid = (mask != 0) & torch.isfinite(ratio) & torch.isfinite(advantages)
    return ratio[valid].double(), advantages[valid].double()


def contributions(r, a, c_low, c_high, mode):
    """``(pos, neg)`` straight from the spec's definitions, for one candidate."""
    if mode == "value":
        pos = (torch.minimum(r, torch.tensor(c_high, dtype=r.dtype)) * a)[a > 0].sum()
        neg = (torch.maximum(r, torch.tensor(c_low, dtype=r.dtype)) * a.abs())[a < 0].sum()
    else:
        pos = (r * a)[(a > 0) & (r < c_high)].sum()
        neg = (r * a.abs())[(a < 0) & (r > c_low)].sum()
    return pos, neg


def _meets(pos, neg, settings):
    if pos + neg <= 0:
        return True
    rho0 = settings.positive_contribution_target
    if settings.bapo_variant == "paper":
        return pos / (pos + neg) >= rho0 - TARGET_TOLERANCE
    return pos / (neg + VERL_EPS) >= rho0 / (1 - rho0) - TARGET_TOLERANCE


def _share(pos, neg):
    return pos / (pos + neg) if pos + neg > 0 else math.nan


def paper_loop_search(ratio, advantages, mask, reduce_fn: Callable | None = None, **settings) -> dict:
    """Algorithm 1, literally (variant "paper")."""
    s = BAPOSettings(**{**settings, "bapo_variant": "paper"})
    r, a = _flat_valid(ratio, advantages, mask)
    a_lo, b_lo, d_lo = s.ratio_lower_start, s.ratio_lower_max, s.ratio_lower_step
    a_hi, b_hi, d_hi = s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step
    k_lo = k_hi = steps = 0

    def score(k_lo, k_hi):
        c_low, c_high = min(a_lo + k_lo * d_lo, b_lo), min(a_hi + k_hi * d_hi, b_hi)
        pos, neg = contributions(r, a, c_low, c_high, s.positive_contribution_mode)
        if reduce_fn is not None:
            pos, neg = reduce_fn(torch.stack([pos, neg])).tolist()
        return c_low, c_high, float(pos), float(neg)

    c_low, c_high, pos, neg = score(0, 0)
    before = _share(pos, neg)
    fits = lambda start, k, step, stop: start + k * step <= stop + GRID_TOLERANCE * step  # noqa: E731
    while not _meets(pos, neg, s) and fits(a_lo, k_lo + 1, d_lo, b_lo):
        if fits(a_hi, k_hi + 1, d_hi, b_hi):
            k_hi += 1
        else:
            k_lo += 1
        steps += 1
        c_low, c_high, pos, neg = score(k_lo, k_hi)
    return {
        "clip_low": c_low,
        "clip_high": c_high,
        "positive_contribution": _share(pos, neg),
        "positive_contribution_before": before,
        "steps": steps,
        "target_met": _meets(pos, neg, s),
    }


def verl_loop_search(ratio, advantages, mask, reduce_fn: Callable | None = None, **settings) -> dict:
    """The official code's loop (variant "verl"): lower bound first, ``min(cur + step, max)``, then the upper
    bound; sums all-reduced and read back to the host for every candidate."""
    s = BAPOSettings(**{**settings, "bapo_variant": "verl"})
    r, a = _flat_valid(ratio, advantages, mask)
    c_low, c_high = s.ratio_lower_start, s.ratio_upper_start
    k_lo = k_hi = steps = 0

    def score(c_low, c_high):
        pos, neg = contributions(r, a, c_low, c_high, s.positive_contribution_mode)
        pair = torch.stack([pos, neg])
        if reduce_fn is not None:
            pair = reduce_fn(pair)
        pos, neg = pair.tolist()  # host sync, once per candidate, as in the official code
        return pos, neg

    pos, neg = score(c_low, c_high)
    before = _share(pos, neg)
    lo_done = lambda: c_low >= s.ratio_lower_max - GRID_TOLERANCE * s.ratio_lower_step  # noqa: E731
    hi_done = lambda: c_high >= s.ratio_upper_max - GRID_TOLERANCE * s.ratio_upper_step  # noqa: E731
    while not _meets(pos, neg, s) and not (lo_done() and hi_done()):
        if not lo_done():
            k_lo += 1
            c_low = min(s.ratio_lower_start + k_lo * s.ratio_lower_step, s.ratio_lower_max)
        else:
            k_hi += 1
            c_high = min(s.ratio_upper_start + k_hi * s.ratio_upper_step, s.ratio_upper_max)
        steps += 1
        pos, neg = score(c_low, c_high)
    return {
        "clip_low": c_low,
        "clip_high": c_high,
        "positive_contribution": _share(pos, neg),
        "positive_contribution_before": before,
        "steps": steps,
        "target_met": _meets(pos, neg, s),
    }


def loop_search(ratio, advantages, mask, reduce_fn=None, **settings) -> dict:
    """Dispatch on ``bapo_variant``."""
    variant = settings.get("bapo_variant", "paper")
    fn = paper_loop_search if variant == "paper" else verl_loop_search
    return fn(ratio, advantages, mask, reduce_fn=reduce_fn, **settings)


def entropy_clip_reference(logps, ratio, advantages, mask, clip_low: float, clip_high: float) -> dict[str, float]:
    """:mod:`bapo_trl.entropy_clip`'s metrics for one batch, token by token from the definitions (Python floats)."""
    from .entropy_clip import QUADRANTS

    rows, cols = len(ratio), len(ratio[0])
    tokens = []
    for i in range(rows):
        for j in range(cols):
            a = advantages[i] if not isinstance(advantages[i], (list, tuple)) else advantages[i][j]
            l, r = float(logps[i][j]), float(ratio[i][j])
            if mask[i][j] and all(math.isfinite(x) for x in (l, r, float(a))):
                tokens.append((l, r, float(a)))
    out = {}
    if not tokens:
        return {**{f"entropy_clip/tokens_{q}": math.nan for q in QUADRANTS},
                **{f"entropy_clip/clipped_{q}": math.nan for q in QUADRANTS},
                "entropy_clip/predicted_change": math.nan, "entropy_clip/predicted_change_all": math.nan,
                "entropy_clip/clip_effect": math.nan}
    mean_l = sum(l for l, _, _ in tokens) / len(tokens)
    for q in QUADRANTS:
        sign, side = q.split("_")
        members = [(l, r, a) for l, r, a in tokens
                   if (a > 0 if sign == "pos" else a < 0) and ((l >= mean_l) == (side == "high"))]
        clipped = [t for t in members if (t[2] > 0 and t[1] > clip_high) or (t[2] < 0 and t[1] < clip_low)]
        out[f"entropy_clip/tokens_{q}"] = len(members) / len(tokens)
        out[f"entropy_clip/clipped_{q}"] = len(clipped) / len(members) if members else math.nan

    def neg_cov(ys):
        my = sum(ys) / len(ys)
        return -sum((l - mean_l) * (y - my) for (l, _, _), y in zip(tokens, ys)) / len(tokens)

    kept = [0.0 if (a > 0 and r > clip_high) or (a < 0 and r < clip_low) else a for _, r, a in tokens]
    out["entropy_clip/predicted_change"] = neg_cov(kept)
    out["entropy_clip/predicted_change_all"] = neg_cov([a for _, _, a in tokens])
    out["entropy_clip/clip_effect"] = out["entropy_clip/predicted_change"] - out["entropy_clip/predicted_change_all"]
    return out
