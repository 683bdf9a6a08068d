"""The paper's Entropy-Clip Rule as a diagnostic: what the chosen window did to the policy's entropy.

The rule (spec, "The Entropy-Clip Rule"): under a PPO-style update the entropy changes by roughly
``-lr * Cov(log pi(y), A * X(y))`` over the tokens, with ``X = 1`` for a token that keeps a gradient (not clipped).
Low-probability positive and high-probability negative tokens raise entropy; high-probability positive and
low-probability negative tokens lower it. A narrow window clips low-probability positives (their ratio runs past
``c_high``) and keeps low-probability negatives, so entropy falls.

Per micro-batch, with the chosen bounds, :func:`entropy_clip_sums` returns local SUMS (so they can be reduced over
processes with the other metrics in one collective) and :func:`entropy_clip_metrics` turns reduced sums into:

* ``entropy_clip/tokens_{pos,neg}_{high,low}``: share of the real tokens in each quadrant, advantage sign x
  probability above / below the micro-batch's geometric-mean probability (``log pi >= mean log pi`` on this
  process's micro-batch: no extra collective is spent on the threshold);
* ``entropy_clip/clipped_{pos,neg}_{high,low}``: share of the quadrant's tokens the window clipped (no gradient;
  with TRL's two-sided clip ``delta``, the dual clip, a negative token above ``delta`` has none either: it counts as
  clipped, :func:`without_gradient`);
* ``entropy_clip/predicted_change``: ``-Cov(log pi, A * X)`` over the real tokens, the rule's predicted entropy
  change per unit learning rate (normalisation: a population covariance over tokens, token-weighted across the
  micro-batch, in nats x advantage units; its sign is what the rule predicts, its scale is comparable across steps
  of one run, not across runs with different advantage scales);
* ``entropy_clip/predicted_change_all``: the same with every token kept (``X = 1``), i.e. without clipping;
* ``entropy_clip/clip_effect``: their difference, what clipping did to the predicted entropy change.

Over a run, :func:`predicted_vs_realised` correlates the predicted change at each logged step with the realised
change of TRL's ``entropy`` metric to the next one (reported by ``bapo plot``, not per step).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from .loss_types import surrogate_clipped

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")
#: Layout of the sums vector: per quadrant (tokens, clipped), then n, sum l, sum AX, sum l*AX, sum A, sum l*A.
NUM_SUMS = 2 * len(QUADRANTS) + 6
METRICS = tuple(f"entropy_clip/tokens_{q}" for q in QUADRANTS) + tuple(
    f"entropy_clip/clipped_{q}" for q in QUADRANTS) + (
    "entropy_clip/predicted_change", "entropy_clip/predicted_change_all", "entropy_clip/clip_effect")


def without_gradient(clipped: Callable, delta: float | None) -> Callable:
    """The clip flags ``clipped`` (the clipped surrogate's, :mod:`bapo_trl.core.loss_types`) with TRL's two-sided clip
    ``delta`` (BAPO's dual clip, on by default) added: TRL's loss forms ``-min(min(r, delta) A, clip(r, c_low, c_high)
    A)``, so a negative-advantage token with ``r > delta`` costs ``-delta A``, a constant: no gradient. Such tokens
    join the HIGH flags (clipped from above, by ``delta``). ``delta`` None (TRL's one-sided clip): ``clipped``."""
    if delta is None:
        return clipped

    def flags(ratio, advantages, c_low, c_high):
        low, high = clipped(ratio, advantages, c_low, c_high)
        return low, high | ((advantages < 0) & (ratio > delta))

    return flags


def entropy_clip_sums(logps: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_low: torch.Tensor | float, clip_high: torch.Tensor | float,
                      clipped: Callable = surrogate_clipped, delta: float | None = None) -> torch.Tensor:
    """Local float64 sums (length :data:`NUM_SUMS`) for one micro-batch. ``logps``/``ratio``/``mask``: ``(B, T)``;
    ``advantages``: ``(B,)``, ``(B, 1)`` or ``(B, T)``. Tokens off the mask, or with a non-finite log-prob, ratio or
    advantage, are left out (NaN on padding is harmless). ``clipped``: the loss type's clip flags
    (:mod:`bapo_trl.core.loss_types`); ``delta``: TRL's two-sided clip of the clipped losses (None: off), whose
    negatives above it keep no gradient either (:func:`without_gradient`)."""
    logps, ratio = logps.detach().double(), ratio.detach().double()
    adv = advantages.detach().double()
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(ratio)
    valid = (mask != 0) & torch.isfinite(logps) & torch.isfinite(ratio) & torch.isfinite(adv)
    l = torch.where(valid, logps, 0.0)
    a = torch.where(valid, adv, 0.0)
    r = torch.where(valid, ratio, 1.0)
    n = valid.sum().double()
    threshold = l.sum() / n.clamp_min(1.0)  # log of the geometric-mean probability of this micro-batch
    high = l >= threshold
    clipped_low, clipped_high = without_gradient(clipped, delta)(r, a, clip_low, clip_high)
    kept = ~(clipped_low | clipped_high)  # tokens that keep a gradient
    quadrant_sums = []
    for sign in (a > 0, a < 0):
        for side in (high, ~high):
            part = valid & sign & side
            quadrant_sums += [part.sum().double(), (part & ~kept).sum().double()]
    ax = torch.where(kept, a, 0.0)
    return torch.stack(quadrant_sums + [n, l.sum(), ax.sum(), (l * ax).sum(), a.sum(), (l * a).sum()])


def _neg_cov(n: float, sum_x: float, sum_y: float, sum_xy: float) -> float:
    return -(sum_xy / n - (sum_x / n) * (sum_y / n)) if n > 0 else float("nan")


def entropy_clip_metrics(sums: Iterable[float]) -> dict[str, float]:
    """Metric values from (reduced) :func:`entropy_clip_sums`; NaN where undefined (no token, empty quadrant)."""
    s = list(sums)
    n, sum_l, sum_ax, sum_lax, sum_a, sum_la = s[2 * len(QUADRANTS):]
    out = {}
    for i, q in enumerate(QUADRANTS):
        tokens, clipped = s[2 * i], s[2 * i + 1]
        out[f"entropy_clip/tokens_{q}"] = tokens / n if n else float("nan")
        out[f"entropy_clip/clipped_{q}"] = clipped / tokens if tokens else float("nan")
    kept, everything = _neg_cov(n, sum_l, sum_ax, sum_lax), _neg_cov(n, sum_l, sum_a, sum_la)
    out["entropy_clip/predicted_change"] = kept
    out["entropy_clip/predicted_change_all"] = everything
    out["entropy_clip/clip_effect"] = kept - everything
    return out


def predicted_vs_realised(log_history: Iterable[dict]) -> tuple[float, int]:
    """Pearson correlation between ``entropy_clip/predicted_change`` logged at a step and the change of TRL's
    ``entropy`` from that step to the next logged one; returns ``(correlation, number of pairs)`` (NaN when fewer
    than 3 pairs or no spread)."""
    points = [(h["entropy_clip/predicted_change"], h["entropy"]) for h in log_history
              if h.get("entropy_clip/predicted_change") is not None and h.get("entropy") is not None
              and math.isfinite(h["entropy_clip/predicted_change"]) and math.isfinite(h["entropy"])]
    pairs = [(p, e_next - e) for (p, e), (_, e_next) in zip(points, points[1:])]
    if len(pairs) < 3:
        return float("nan"), len(pairs)
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return float("nan"), len(pairs)
    return sxy / math.sqrt(sxx * syy), len(pairs)
