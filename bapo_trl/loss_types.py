"""The loss types BAPO balances, one row each: how the chosen window reaches TRL's loss, how the positive share of
that loss is measured, and which tokens the window clips.

Why a table: a loss type touches three places that must agree (the attributes TRL's ``_compute_loss`` reads, the
share the search balances, the clip flags of the metrics and the Entropy-Clip diagnostics). Adding a loss type is a
row here plus its tests; :data:`SUPPORTED_LOSS_TYPES` (what ``BAPOConfig`` accepts) is derived from the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .clipping import grid_sums


def surrogate_window(c_low: torch.Tensor, c_high: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL clips with ``clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)``: the window ``[c_low, c_high]`` is
    ``epsilon_low = 1 - c_low``, ``epsilon_high = c_high - 1``."""
    return {"epsilon_low": 1.0 - c_low, "epsilon_high": c_high - 1.0}


def surrogate_clipped(ratio: torch.Tensor, advantages: torch.Tensor, c_low, c_high) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``: tokens the surrogate ``min(r A, clip(r, c_low, c_high) A)`` takes the gradient from: a
    negative-advantage token below ``c_low``, a positive one above ``c_high``."""
    return (advantages < 0) & (ratio < c_low), (advantages > 0) & (ratio > c_high)


@dataclass(frozen=True)
class LossType:
    """How BAPO acts on one of TRL's loss types.

    Attributes:
        objective: the per-token objective, in the spec's notation (for docs and error messages).
        to_trl: ``(c_low, c_high)`` (0-dim tensors) -> the ``GRPOTrainer`` attributes TRL's loss reads.
        grid_sums: the positive/negative sums of the share for every point of the search path
            (:func:`bapo_trl.clipping.grid_sums` signature), reduced over processes and searched by
            :func:`bapo_trl.clipping.choose_bounds`.
        clipped: ``(ratio, advantages, c_low, c_high)`` -> ``(low, high)`` boolean masks of the clipped tokens.
    """

    objective: str
    to_trl: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    grid_sums: Callable
    clipped: Callable


CLIPPED_SURROGATE = LossType(
    objective="min(r A, clip(r, c_low, c_high) A)",
    to_trl=surrogate_window,
    grid_sums=grid_sums,
    clipped=surrogate_clipped,
)

#: TRL ``loss_type`` -> how BAPO balances it. The four differ only in how TRL aggregates tokens.
LOSS_TYPES: dict[str, LossType] = {
    "dapo": CLIPPED_SURROGATE,
    "bnpo": CLIPPED_SURROGATE,
    "grpo": CLIPPED_SURROGATE,
    "dr_grpo": CLIPPED_SURROGATE,
}
SUPPORTED_LOSS_TYPES = tuple(LOSS_TYPES)
