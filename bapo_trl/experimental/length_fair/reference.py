"""The length-fair balance as a plain loop (float64, token by token, from the definitions): the ground truth the
tests hold :mod:`.search` to. Reference code: the trainer never imports it."""

from __future__ import annotations

import math

import torch

from ...core.clipping import GRID_TOLERANCE, TARGET_TOLERANCE
from .search import LengthFairSettings


def _share(pos: float, neg: float) -> float:
    return pos / (pos + neg) if pos + neg > 0 else float("nan")


def length_fair_loop_search(log_ratio, advantages, mask, reduce_fn=None, statistics_mask=None, **settings) -> dict:
    """The length-fair balance as a plain loop (float64, token by token, from the definitions): Algorithm 1's
    ``while`` loop on ``(k_low, k_high)``, re-scoring the batch for every candidate. ``statistics_mask``: the tokens
    of each sequence's mean and spread (default ``mask``)."""
    s = LengthFairSettings(**settings)
    over = mask if statistics_mask is None else statistics_mask
    rows = []
    for i in range(log_ratio.shape[0]):
        xs = [float(log_ratio[i, t]) for t in range(log_ratio.shape[1]) if over[i, t] != 0]
        tokens = [t for t in range(log_ratio.shape[1]) if mask[i, t] != 0]
        if not xs or not tokens or not all(math.isfinite(v) for v in xs):
            continue
        mean = sum(xs) / len(xs)
        sd = math.sqrt(sum((v - mean) ** 2 for v in xs) / len(xs))
        b = max(sd / math.sqrt(len(xs)), s.band_floor)
        row = advantages[i]
        weights = [float(row) if row.dim() == 0 else float(row[0] if row.numel() == 1 else row[t]) for t in tokens]
        rows.append((math.exp(mean), b, [w for w in weights if math.isfinite(w)]))

    def score(k_low, k_high):
        pos = neg = 0.0
        for ratio, b, weights in rows:
            c_low, c_high = math.exp(-k_low * b), math.exp(k_high * b)
            c_high = c_high if s.delta is None else min(c_high, s.delta)
            for w in weights:
                if w > 0 and s.positive_contribution_mode == "value":
                    pos += min(ratio, c_high) * w
                elif w > 0 and ratio < c_high:
                    pos += ratio * w
                elif w < 0 and s.positive_contribution_mode == "value":
                    neg += max(ratio, c_low) * -w
                elif w < 0 and ratio > c_low and (s.delta is None or ratio <= s.delta):
                    neg += ratio * -w
        if reduce_fn is not None:
            pos, neg = reduce_fn(torch.tensor([pos, neg], dtype=torch.float64)).tolist()
        return pos, neg

    def meets(pos, neg):
        return pos + neg <= 0 or pos / (pos + neg) >= s.positive_contribution_target - TARGET_TOLERANCE

    k_hi = k_lo = steps = 0
    n_hi = math.floor((s.band_upper_max - s.band_upper_start) / s.band_upper_step + GRID_TOLERANCE)
    n_lo = math.floor((s.band_lower_start - s.band_lower_min) / s.band_lower_step + GRID_TOLERANCE)
    k_high = lambda: min(s.band_upper_start + k_hi * s.band_upper_step, s.band_upper_max)  # noqa: E731
    k_low = lambda: s.band_lower_start - min(k_lo * s.band_lower_step, s.band_lower_start - s.band_lower_min)  # noqa: E731
    pos, neg = score(k_low(), k_high())
    before = _share(pos, neg)
    while not meets(pos, neg) and (k_hi < n_hi or k_lo < n_lo):
        if k_hi < n_hi:
            k_hi += 1
        else:
            k_lo += 1
        steps += 1
        pos, neg = score(k_low(), k_high())
    return {"clip_low": k_low(), "clip_high": k_high(), "positive_contribution": _share(pos, neg),
            "positive_contribution_before": before, "steps": steps, "target_met": meets(pos, neg)}
