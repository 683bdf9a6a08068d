"""GMPO's share as a plain loop (float64, sequence by sequence, from the definition): the ground truth the tests hold
:mod:`.geometric_mean` to, through the core's loop searches (:mod:`bapo_trl.core.clipping_reference`). Reference
code: the trainer never imports it."""

from __future__ import annotations

import math
from typing import Callable

import torch


def gmpo_contributions_reference(ratio, advantages, mask) -> Callable:
    """GMPO's ``(pos, neg)`` at one window, sequence by sequence from the definition (float64, plain loops): each
    sequence weighs ``w = exp(mean_t clip(log r_t))`` over its valid tokens, ``min(log r, log c_high)`` for ``A > 0``,
    ``max(log r, log c_low)`` for ``A < 0``; value share ``w |A|``, gradient share ``w |A|`` times the fraction of its
    tokens strictly inside the bound (``r < c_high``, ``r > c_low``). For :func:`paper_loop_search` /
    :func:`verl_loop_search` as ``contributions_fn`` (they pass the flattened tokens, which this ignores: the
    sequences are bound here)."""
    rows = []
    for i in range(ratio.shape[0]):
        rs = [float(ratio[i, t]) for t in range(ratio.shape[1])
              if mask[i, t] != 0 and math.isfinite(float(ratio[i, t]))]
        a = float(advantages[i])
        if rs and math.isfinite(a) and a != 0:
            rows.append((rs, a))

    def fn(r, a, c_low, c_high, mode):
        pos = neg = 0.0
        for rs, adv in rows:
            c = c_high if adv > 0 else c_low
            clipped = [math.log(max(min(x, c) if adv > 0 else max(x, c), 1e-300)) for x in rs]
            inside = sum(x < c if adv > 0 else x > c for x in rs)
            term = math.exp(sum(clipped) / len(rs)) * abs(adv)
            if mode != "value":
                term *= inside / len(rs)
            if adv > 0:
                pos += term
            else:
                neg += term
        return torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)

    return fn
