"""The length-fair window's per-update metrics: the core's search metrics (:mod:`bapo_trl.core.metrics`), with every
sequence clipped at its own window, plus the band widths the search chose."""

from __future__ import annotations

import dataclasses

import torch

from ...core.metrics import (
    SearchRecord,
    gate_values,
    origin_and_age_values,
    search_sums,
    search_values,
    token_staleness,
)
from .search import SequenceWindow

#: Logged per update by :class:`~.trainer.LengthFairBAPOTrainer`: the chosen band widths (standard errors).
METRICS = (
    "bapo/band_lower",
    "bapo/band_upper",
)


def length_fair_values(batch: SearchRecord, window: SequenceWindow) -> tuple[dict[str, float], tuple[float, float]]:
    """:func:`bapo_trl.core.metrics.update_values` for the length-fair search (``batch.result`` holds the widths
    ``k_low``/``k_high`` and ``batch.path`` is theirs): clip flags and shares use every sequence's own window; the
    widths are logged as ``bapo/band_lower`` / ``bapo/band_upper`` and ``bapo/clip_low``/``bapo/clip_high`` are the
    sequences' mean window (one more sum in the same collective)."""
    lower, upper = window.bounds()
    flags = dataclasses.replace(  # the flags' window, per sequence
        batch, result=dataclasses.replace(batch.result, clip_low=lower, clip_high=upper),
        loss=dataclasses.replace(batch.loss, sensitive=window.sensitive))
    b, path = flags, flags.path
    staleness = token_staleness(b.inputs, b.step, b.ratio)
    sums, stale_max = search_sums(b.result, path, b.ratio, b.advantages, b.mask, b.logps, b.entropies, staleness,
                                  b.nonfinite_inputs, b.loss)
    rows = ((b.mask != 0) & torch.isfinite(b.ratio)).any(-1)  # the mean window, at the chosen widths and the start's
    sums = torch.cat([sums, window.mean_sums(rows), window.mean_sums(rows, path.clip_low[0], path.clip_high[0])])
    sums, stale_max = b.sum_over_processes(sums).tolist(), b.max_over_processes(stale_max)
    floats = dataclasses.replace(batch.result, clip_low=window.k_low, clip_high=window.k_high).as_floats()
    sums, chosen, start = sums[:-6], sums[-6:-3], sums[-3:]
    values, entropy = search_values(sums, floats, path, float(stale_max), b.target)
    # an update no window changes is reported at the start (search_values), its mean too
    values["bapo/band_lower"], values["bapo/band_upper"] = values["bapo/clip_low"], values["bapo/clip_high"]
    low, high, count = chosen if values["bapo/search_active"] else start
    values["bapo/clip_low"], values["bapo/clip_high"] = low / max(count, 1.0), high / max(count, 1.0)
    values.update(gate_values(b.loss, values["bapo/clip_low"], values["bapo/clip_high"]))
    values.update(origin_and_age_values(flags, staleness))
    return values, entropy
