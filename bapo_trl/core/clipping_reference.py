"""Plain, loop-by-loop versions of the bound search, kept as the ground truth for tests and benchmarks.

Reference code: the trainer never imports it. It ships in the package only so that the tests, the benchmarks and a
user checking the fast path on their own batches can import it (``from bapo_trl.core.clipping_reference import ...``).

* :func:`paper_loop_search` is Algorithm 1 of the paper written as the paper writes it: a ``while`` loop that
  re-scores the batch for every candidate.
* :func:`verl_loop_search` follows the official verl recipe's structure: a Python loop that, for every candidate,
  computes the sums, all-reduces them and reads them back to the host before deciding.
* For the other loss types (``docs/loss_types.md``): :func:`cap_loop_search` (CISPO's cap, upper bound only), the
  two loops above with a soft gate's share (:func:`sapo_contributions`, :func:`vespo_contributions`), and the ratios
  and token weights TRL's loss uses, token by token (:func:`sequence_ratios`, :func:`vespo_sequence_weights`,
  :func:`sequence_mean_weights`).

The research candidates' reference loops live beside each candidate (``bapo_trl/experimental/*/reference.py``).

Both compute every sum directly from the definitions (``min(r, c_high) * A`` ...), in float64, with none of the
bucketing of :mod:`bapo_trl.core.clipping`; they are slow on purpose. Grid points are ``start + k * step`` with integer
``k`` (no accumulated floating drift), the same convention as the fast path.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch

from .clipping import GRID_TOLERANCE, TARGET_TOLERANCE, VERL_EPS, BAPOSettings


def _flat_valid(ratio, advantages, mask):
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.expand_as(ratio)
    valid = (mask != 0) & torch.isfinite(ratio) & torch.isfinite(advantages)
    return ratio[valid].double(), advantages[valid].double()


def contributions(r, a, c_low, c_high, mode, delta=None):
    """``(pos, neg)`` straight from the spec's definitions, for one candidate. ``delta``: TRL's two-sided clip (None:
    off); in the gradient share a negative above it has no gradient (its loss is ``-delta A``) and does not count."""
    if mode == "value":
        pos = (torch.minimum(r, torch.tensor(c_high, dtype=r.dtype)) * a)[a > 0].sum()
        neg = (torch.maximum(r, torch.tensor(c_low, dtype=r.dtype)) * a.abs())[a < 0].sum()
    else:
        # a ratio on a bound keeps its gradient in TRL's loss (both branches of the tie carry it)
        pos = (r * a)[(a > 0) & (r <= c_high)].sum()
        below_delta = torch.ones_like(r, dtype=torch.bool) if delta is None else r <= delta
        neg = (r * a.abs())[(a < 0) & (r >= c_low) & below_delta].sum()
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


def paper_loop_search(ratio, advantages, mask, reduce_fn: Callable | None = None, contributions_fn=None,
                      **settings) -> dict:
    """Algorithm 1, literally (variant "paper"). ``contributions_fn``: the share's ``(pos, neg)`` at one candidate
    (default :func:`contributions`, the clipped surrogate's, with the settings' ``delta``)."""
    s = BAPOSettings(**{**settings, "bapo_variant": "paper"})
    contributions_fn = contributions_fn or partial(contributions, delta=s.delta)
    r, a = _flat_valid(ratio, advantages, mask)
    a_lo, b_lo, d_lo = s.ratio_lower_start, s.ratio_lower_max, s.ratio_lower_step
    a_hi, b_hi, d_hi = s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step
    k_lo = k_hi = steps = 0

    def score(k_lo, k_hi):
        c_low, c_high = min(a_lo + k_lo * d_lo, b_lo), min(a_hi + k_hi * d_hi, b_hi)
        pos, neg = contributions_fn(r, a, c_low, c_high, s.positive_contribution_mode)
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


def verl_loop_search(ratio, advantages, mask, reduce_fn: Callable | None = None, contributions_fn=None,
                     **settings) -> dict:
    """The official code's loop (variant "verl"): lower bound first, ``min(cur + step, max)``, then the upper
    bound; sums all-reduced and read back to the host for every candidate."""
    s = BAPOSettings(**{**settings, "bapo_variant": "verl"})
    contributions_fn = contributions_fn or partial(contributions, delta=s.delta)
    r, a = _flat_valid(ratio, advantages, mask)
    c_low, c_high = s.ratio_lower_start, s.ratio_upper_start
    k_lo = k_hi = steps = 0

    def score(c_low, c_high):
        pos, neg = contributions_fn(r, a, c_low, c_high, s.positive_contribution_mode)
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


def loop_search(ratio, advantages, mask, reduce_fn=None, contributions_fn=None, **settings) -> dict:
    """Dispatch on ``bapo_variant``."""
    variant = settings.get("bapo_variant", "paper")
    fn = paper_loop_search if variant == "paper" else verl_loop_search
    return fn(ratio, advantages, mask, reduce_fn=reduce_fn, contributions_fn=contributions_fn, **settings)


def cap_contributions(r, a, c):
    """CISPO's ``(pos, neg)`` at cap ``c``: ``sum_{A>0} min(r, c) A``, ``sum_{A<0} min(r, c) |A|``, token by token."""
    pos = neg = 0.0
    for ri, ai in zip(r.tolist(), a.tolist()):
        if ai > 0:
            pos += min(ri, c) * ai
        elif ai < 0:
            neg += min(ri, c) * -ai
    return torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)


def cap_loop_search(ratio, advantages, mask, reduce_fn: Callable | None = None, **settings) -> dict:
    """CISPO's cap: start at ``a+``; while the share misses the target, raise the cap by ``d+`` while it fits under
    ``b+`` (``verl``: ``min(cur + step, max)`` until ``b+``). No lower bound (``clip_low`` 0)."""
    s = BAPOSettings(**settings)
    r, a = _flat_valid(ratio, advantages, mask)
    start, stop, step = s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step

    def score(c):
        pos, neg = cap_contributions(r, a, c)
        if reduce_fn is not None:
            pos, neg = reduce_fn(torch.stack([pos, neg])).tolist()
        return float(pos), float(neg)

    k, c = 0, start
    pos, neg = score(c)
    before = _share(pos, neg)
    while not _meets(pos, neg, s):
        if s.bapo_variant == "paper":
            if not start + (k + 1) * step <= stop + GRID_TOLERANCE * step:
                break
            c = min(start + (k + 1) * step, stop)
        else:
            if c >= stop - GRID_TOLERANCE * step:
                break
            c = min(start + (k + 1) * step, stop)
        k += 1
        pos, neg = score(c)
    return {"clip_low": 0.0, "clip_high": c, "positive_contribution": _share(pos, neg),
            "positive_contribution_before": before, "steps": k, "target_met": _meets(pos, neg, s)}


def _logistic(x: float) -> float:
    """``1 / (1 + e^-x)``, accurate in both tails (``1 - sigmoid(x)`` would cancel to 0)."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def sapo_contributions(tau_pos: float, tau_neg: float, upper_start: float, lower_start: float) -> Callable:
    """SAPO's share at a window, from the definitions: a token weighs ``4 sigmoid(x) (1 - sigmoid(x)) r |A|`` (the
    derivative of ``sigmoid(tau (r - 1)) 4 / tau`` times ``r``), ``x = tau (r - 1)``, with
    ``tau+ = tau_pos (a+ - 1) / (c_high - 1)`` and ``tau- = tau_neg (1 - a-) / (1 - c_low)``. (The mode is ignored:
    value and gradient share are one.)"""

    def fn(r, a, c_low, c_high, mode=None):
        pos = neg = 0.0
        for ri, ai in zip(r.tolist(), a.tolist()):
            tau = tau_pos * (upper_start - 1) / (c_high - 1) if ai > 0 else tau_neg * (1 - lower_start) / (1 - c_low)
            weight = 4 * _logistic(tau * (ri - 1)) * _logistic(-tau * (ri - 1)) * ri * abs(ai)  # s(x)(1 - s(x))
            pos, neg = (pos + weight, neg) if ai > 0 else (pos, neg + weight)
        return torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)

    return fn


def vespo_contributions(k_pos, lambda_pos, k_neg, lambda_neg, upper_start: float, lower_start: float) -> Callable:
    """VESPO's share at a window, from the definitions: a token of a sequence with weight ``w`` weighs
    ``phi(w) |A| = exp(lambda + k log w - lambda w) |A|`` (``lambda`` floored at 1e-4, as TRL does), with each
    sign's ``(k, lambda)`` times ``(a+ - 1) / (c_high - 1)`` (positives) or ``(1 - a-) / (1 - c_low)`` (negatives)."""

    def fn(w, a, c_low, c_high, mode=None):
        pos = neg = 0.0
        for wi, ai in zip(w.tolist(), a.tolist()):
            if ai > 0:
                s, k, lam = (upper_start - 1) / (c_high - 1), k_pos, lambda_pos
            else:
                s, k, lam = (1 - lower_start) / (1 - c_low), k_neg, lambda_neg
            lam = max(s * lam, 1e-4)
            weight = math.exp(lam + s * k * math.log(max(wi, 1e-300)) - lam * wi) * abs(ai)
            pos, neg = (pos + weight, neg) if ai > 0 else (pos, neg + weight)
        return torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)

    return fn


def sequence_ratios(log_ratio, mask) -> list[list[float]]:
    """GSPO's sequence ratio of every row, on each of its tokens: ``exp(mean of the row's log-ratios over its loss
    mask)`` (``exp(0) = 1`` for an empty row)."""
    out = []
    for row, m in zip(log_ratio.tolist(), mask.tolist()):
        total = sum(x * mi for x, mi in zip(row, m))
        out.append([math.exp(total / max(sum(m), 1.0))] * len(row))
    return out


def vespo_sequence_weights(log_ratio, mask, importance_sampling_ratio=None) -> list[float]:
    """VESPO's sequence weight ``w`` of every row: ``exp`` of the sum over the loss mask of the token log-ratios
    (each clamped to [-20, 20]), plus the sum over all tokens of the log IS weights (each clamped to [log 1e-8, 20]),
    the total clamped to [log 1e-8, 20]."""
    low = math.log(1e-8)
    out = []
    for i, (row, m) in enumerate(zip(log_ratio.tolist(), mask.tolist())):
        total = sum(min(max(x, -20.0), 20.0) * mi for x, mi in zip(row, m))
        if importance_sampling_ratio is not None:
            total += sum(min(max(math.log(v), low), 20.0) for v in importance_sampling_ratio[i].tolist())
        out.append(math.exp(min(max(total, low), 20.0)))
    return out


def sequence_mean_weights(mask) -> list[float]:
    """The weight of each token of a row in a loss that averages every sequence over its tokens (grpo, sapo):
    ``1 / max(L, 1)`` with ``L`` the row's tokens in the loss mask."""
    return [1.0 / max(sum(m), 1.0) for m in mask.tolist()]


def entropy_clip_reference(logps, ratio, advantages, mask, clip_low: float, clip_high: float) -> dict[str, float]:
    """:mod:`bapo_trl.core.entropy_clip`'s metrics for one batch, token by token from the definitions
    (Python floats)."""
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
