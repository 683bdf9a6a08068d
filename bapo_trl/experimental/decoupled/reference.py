"""The decoupled correction's truncated importance weights and their effective sample size, row by row from the
definitions (float64): the ground truth the tests hold :mod:`.weights` to. Reference code: the trainer never imports
it."""

from __future__ import annotations

import math


def decoupled_weights_reference(proximal, behaviour, mask, mode: str, cap, floor=None) -> list[list[float]]:
    """The decoupled correction's weight of every token, row by row from the definition, in float64: the token's
    ``exp(log pi_prox - log pi_behaviour)`` (token modes) or its sequence's ``exp(sum over valid tokens of the
    same)`` (sequence modes), a NaN behaviour log-prob counting 0, then truncated to ``[floor, cap]`` or 0 outside it
    (mask modes); tokens outside ``mask`` get their sequence's weight too (0 difference in token modes: ratio 1)."""
    out = []
    for p_row, b_row, m_row in zip(proximal.tolist(), behaviour.tolist(), mask.tolist()):
        diffs = [0.0 if (not m or math.isnan(b - p)) else p - b for p, b, m in zip(p_row, b_row, m_row)]
        raw = [math.exp(math.fsum(diffs))] * len(diffs) if mode.startswith("sequence") else [math.exp(d)
                                                                                            for d in diffs]
        row = []
        for w in raw:
            outside = (floor is not None and w < floor) or (cap is not None and w > cap)
            if mode.endswith("mask"):
                row.append(0.0 if outside else w)
            else:
                low = w if floor is None else max(w, floor)
                row.append(low if cap is None else min(low, cap))
        out.append(row)
    return out


def effective_sample_size_reference(weights: list[float]) -> float:
    """``(sum w)^2 / (n sum w^2)`` of a list of weights, in float64 (NaN: empty or all 0)."""
    n, total, squares = len(weights), math.fsum(weights), math.fsum(w * w for w in weights)
    return total * total / (n * squares) if n and squares > 0 else float("nan")
