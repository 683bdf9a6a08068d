"""BAPO's window on GMPO's geometric-mean objective (TRL's experimental ``GMPOTrainer``): the share's sums for every
candidate of the search path, and its per-token terms for the metrics.

GMPO (arXiv 2507.20673) weights a sequence by the geometric mean of its clipped token ratios instead of summing
per-token terms. TRL writes it as ``w_i = exp(mean_t clip_i(log r_t))`` over the sequence's loss tokens, with the
sign-aware clip ``min(log r, log c_high)`` for ``A_i > 0`` and ``max(log r, log c_low)`` for ``A_i < 0`` (its
``epsilon_high = log c_high``, ``epsilon_low = -log c_low``), and the loss ``-w_i A_i``, a plain mean over sequences.

So a positive sequence's weight depends on ``c_high`` only and a negative's on ``c_low`` only, as in the clipped
surrogate, and BAPO's search applies unchanged to the share of GMPO's own loss:

* value share: ``sum_{A>0} w_i A_i / sum_i w_i |A_i|``;
* gradient share: a token keeps a gradient while its log-ratio is inside its bound (``d w_i / d log pi_t = w_i / L_i``,
  0 once clipped), so a sequence carries ``w_i |A_i|`` times the fraction of its tokens that keep one. A ratio exactly
  at its bound counts as clipped, as the plain loop's strict ``r < c_high`` / ``r > c_low`` say (autograd through
  TRL's clamp splits such a tie; TRL compares float32 log-ratios, so it does not arise in practice).

Unlike the token-level rows, a term is not a sum over tokens (the mean sits inside ``exp``), so the sums bin each
sequence's log-ratios on the grid (one ``bucketize`` and two ``(B, G)`` scatters per side) instead of the batch's.
A sequence without a loss token has a constant loss in GMPO and no gradient: it is left out of the share.
"""

from __future__ import annotations

import math

import torch

from ...core.clipping import _device_grids
from ...core.loss_types import LossType, surrogate_clipped
from .checks import gmpo_config_errors, gmpo_config_warnings

#: Ratios at or below this are taken at it before the log (an underflowed ``exp``): no ``-inf`` in any mean.
TINY_RATIO = 1e-300


def _per_sequence(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    """``(r, log_r, valid, length, a)``: float64 ratios (1 off the valid tokens) and their logs (0 there), the valid
    tokens (in the mask, finite), each sequence's count of them, and one finite advantage per sequence (0 for a
    non-finite one or a sequence without valid tokens, which so reaches no sum)."""
    a = advantages.detach().to(torch.float64)
    a = a.reshape(ratio.shape[0], -1) if a.numel() else a.reshape(0, 1)  # an empty micro-batch: no sequence
    if a.shape[1] != 1:
        raise ValueError(f"GMPO's loss takes one advantage per sequence; got advantages of shape "
                         f"{tuple(advantages.shape)} for ratios of shape {tuple(ratio.shape)}.")
    r = ratio.detach().to(torch.float64)
    is_valid = (mask.detach() != 0) & torch.isfinite(r)
    r = torch.where(is_valid, r, 1.0)
    valid = is_valid.to(torch.float64)
    log_r = torch.log(r.clamp_min(TINY_RATIO))
    length = valid.sum(-1)
    a = a[:, 0]
    a = torch.where(torch.isfinite(a) & (length > 0), a, 0.0)
    return r, log_r, valid, length, a


def _clipped_means(r, log_r, valid, length, grid: torch.Tensor, upper: bool):
    """``(mean, kept)``, each ``(B, G)``: every sequence's mean clipped log-ratio at each grid value ``c`` (``min(log
    r, log c)`` when ``upper``, else ``max(log r, log c)``) and the fraction of its tokens strictly inside the bound
    (they keep a gradient).

    A token's bin is ``#{c <= r}`` (upper) or ``#{c < r}`` (lower), compared as ratios, as the plain loop compares
    them; at grid value ``j`` the tokens of bins ``<= j`` are below it and the others above, so prefix and suffix
    sums of the per-bin counts and log-ratio sums give every grid value at once."""
    G = grid.numel()
    bins = torch.bucketize(r, grid, right=upper)
    counts = torch.zeros(r.shape[0], G + 1, dtype=torch.float64, device=r.device)
    sums = torch.zeros_like(counts)
    counts.scatter_add_(1, bins, valid)
    sums.scatter_add_(1, bins, log_r * valid)
    if upper:  # r < c keeps its log-ratio (and its gradient); r >= c is clipped to c
        inside_count, inside_sum = counts.cumsum(1)[:, :G], sums.cumsum(1)[:, :G]
    else:  # r > c keeps its log-ratio; r <= c is clipped to c
        inside_count = counts.flip(1).cumsum(1).flip(1)[:, 1:]
        inside_sum = sums.flip(1).cumsum(1).flip(1)[:, 1:]
    per = length.clamp(min=1.0)[:, None]
    mean = (inside_sum + torch.log(grid)[None, :] * (length[:, None] - inside_count)) / per
    return mean, inside_count / per


def gmpo_sums(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, path) -> torch.Tensor:
    """The share's local sums for every grid value, in :func:`bapo_trl.core.clipping.grid_sums`' packed layout
    ``[pos_value(H), pos_gradient(H), neg_value(L), neg_gradient(L), num_tokens, num_nonfinite]``. ``ratio``:
    ``(B, T)`` per-token ratios; ``advantages``: one per sequence; ``path``: a window path without a two-sided clip
    (GMPO has none)."""
    if path.delta is not None or path.negatives_on_high:
        raise ValueError("gmpo_sums needs a window path without delta (GMPO's loss has no two-sided clip).")
    r, log_r, valid, length, a = _per_sequence(ratio, advantages, mask)
    high_grid, low_grid = _device_grids(path, r.device)
    sums = []
    for grid, upper, weight in ((high_grid, True, a.clamp(min=0.0)), (low_grid, False, (-a).clamp(min=0.0))):
        mean, kept = _clipped_means(r, log_r, valid, length, grid, upper)
        terms = torch.exp(mean) * weight[:, None]  # w_i |A_i| at every grid value
        sums += [terms.sum(0), (terms * kept).sum(0)]
    num_tokens = (valid * (a != 0)[:, None]).sum()  # tokens of the sequences that reach the share
    counts = torch.stack([num_tokens, torch.count_nonzero(mask).to(torch.float64) - valid.sum()])
    return torch.cat([*sums, counts])


def gmpo_contributions(r: torch.Tensor, a: torch.Tensor, c_low, c_high, valid: torch.Tensor | None = None):
    """Per-token ``(pos, neg)`` terms of the value share at one window (``(B, T)``; ``a`` the sequence's advantage on
    each token): a sequence's ``w_i |A_i|`` spread evenly over its valid tokens, so any subset of whole sequences
    (fresh / replayed, an age) sums to its share of the loss."""
    v = torch.ones_like(r) if valid is None else valid.to(r.dtype)
    log_r = torch.log(r.clamp_min(TINY_RATIO))
    per = v.sum(-1, keepdim=True).clamp(min=1.0)
    log_high = torch.log(torch.as_tensor(c_high, dtype=r.dtype, device=r.device))
    log_low = torch.log(torch.as_tensor(c_low, dtype=r.dtype, device=r.device))
    w_pos = torch.exp((torch.minimum(log_r, log_high) * v).sum(-1, keepdim=True) / per)
    w_neg = torch.exp((torch.maximum(log_r, log_low) * v).sum(-1, keepdim=True) / per)
    return (torch.where(a > 0, w_pos * a / per, 0.0) * v, torch.where(a < 0, w_neg * -a / per, 0.0) * v)


def gmpo_window(c_low, c_high) -> dict:
    """TRL's GMPO clips log-ratios to ``[-epsilon_low, epsilon_high]``: ``epsilon_low = -log c_low``,
    ``epsilon_high = log c_high``."""
    log = torch.log if isinstance(c_high, torch.Tensor) else math.log
    return {"epsilon_low": -log(c_low), "epsilon_high": log(c_high)}


#: TRL's experimental GMPO (``trl.experimental.gmpo.GMPOTrainer``): not a ``loss_type`` but a trainer of its own, so
#: this row is chosen by ``BAPOGMPOTrainer`` (:mod:`.trainer`), not by the config's ``loss_type``.
GEOMETRIC_MEAN = LossType(
    objective="exp(mean_t clip(log r_t, log c_low, log c_high)) A (GMPO, sign-aware clip in log space)",
    kind="clip",
    to_trl=gmpo_window,
    grid_sums=gmpo_sums,
    clipped=surrogate_clipped,
    contributions=gmpo_contributions,
    uses_is_weights=False,
    config_errors=gmpo_config_errors,
    config_warnings=gmpo_config_warnings,
)
