"""Length-fair sequence-level balance (the candidate study's, :class:`~.trainer.LengthFairBAPOTrainer`): GSPO's
sequence ratio clipped in a band as wide as the noise of the sequence's own mean, BAPO's search choosing the band's
width per sign.

GSPO clips ``R_i = exp(s_i)``, ``s_i`` the mean token log-ratio of sequence ``i`` over its ``L_i`` tokens, in one fixed
window. The mean of ``L_i`` noisy token log-ratios has a standard error ``sd_i / sqrt(L_i)``, so a fixed window
clips a short answer (a noisy mean) far more often than a long one whose policy moved as much. Here the window is
``log R_i in [-k_low b_i, k_high b_i]`` with ``b_i = max(sd_i / sqrt(L_i), band_floor)`` (``sd_i`` the population
standard deviation of the sequence's token log-ratios; the floor keeps one-token sequences and on-policy data, where
``sd_i = 0``, from a window of no width): per sequence ``c_low_i = exp(-k_low b_i)``, ``c_high_i = exp(k_high b_i)``.
With the defaults (the narrow band the studies kept, ``k_high`` from 0.002, and GSPO's 3e-4 as the floor) a sequence
at the floor starts at a window about 1e-6 wide, far inside GSPO's 4e-4: such sequences are all but clipped at
``R = 1`` until the search widens ``k_high``. That is the candidate as studied (docs/results.md); the floor is a
field.

The search follows Algorithm 1's path on ``(k_low, k_high)`` instead of ``(c_low, c_high)``: first widen the
positives' side (``k_high`` from ``band_upper_start`` up to ``band_upper_max``), then narrow the negatives' side
(``k_low`` from ``band_lower_start`` down to ``band_lower_min``, i.e. ``c_low`` up, as the paper raises ``c_low``),
stopping at the first candidate where the positive share reaches ``rho0``. The shares are those of GSPO's clipped
surrogate (the value share ``min(R, c_high) A`` / ``max(R, c_low) |A|``; the gradient share with TRL's ``delta``), per
token weighted as TRL's loss weighs it, exactly as :func:`bapo_trl.core.clipping.grid_sums` defines them; the
candidates are scored in one ``(sequences x grid)`` pass (the bounds differ per sequence, so the lattice binning of the
token search does not apply; there are few sequences), reduced over processes in one collective, chosen on device by
:func:`bapo_trl.core.clipping.choose_bounds` (whose ``clip_low``/``clip_high`` are then ``k_low``/``k_high``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable

import torch

from ...core.clipping import MODES, SearchPath, SearchResult, _device_grids, _grid, choose_bounds, is_real
from ...trainer.presets import GSPO_DOCUMENTED
from .presets import GSPO_BAND


@dataclass(frozen=True)
class LengthFairSettings:
    """The search settings of the length-fair balance; every bad value raises ``ValueError`` naming the field."""

    positive_contribution_target: float = 0.5
    band_upper_start: float = GSPO_BAND["band_upper_start"]  # the band the studies kept, as the config's defaults
    band_upper_max: float = GSPO_BAND["band_upper_max"]
    band_upper_step: float = GSPO_BAND["band_upper_step"]
    band_lower_start: float = GSPO_BAND["band_lower_start"]
    band_lower_min: float = GSPO_BAND["band_lower_min"]
    band_lower_step: float = GSPO_BAND["band_lower_step"]
    band_floor: float = GSPO_DOCUMENTED["epsilon"]  # TRL's GSPO window, as the config's default
    positive_contribution_mode: str = "value"
    delta: float | None = None

    #: :func:`bapo_trl.core.clipping.choose_bounds` reads it: the paper's rule, a share against ``rho0``.
    bapo_variant = "paper"

    def __post_init__(self):
        for error in length_fair_errors(**asdict(self)):
            raise ValueError(error)


def length_fair_errors(positive_contribution_target, band_upper_start, band_upper_max, band_upper_step,
                       band_lower_start, band_lower_min, band_lower_step, band_floor, positive_contribution_mode,
                       delta=None) -> list[str]:
    """Every problem with a set of settings, as messages naming the field, the value and what is allowed."""
    errors = band_errors(band_upper_start, band_upper_max, band_upper_step, band_lower_start, band_lower_min,
                         band_lower_step, band_floor)
    if not (is_real(positive_contribution_target) and 0.0 < positive_contribution_target < 1.0):
        errors.append(f"`positive_contribution_target` must be in the open interval (0, 1), got "
                      f"{positive_contribution_target!r}.")
    if positive_contribution_mode not in MODES:
        errors.append(f"`positive_contribution_mode` must be one of {MODES}, got {positive_contribution_mode!r}.")
    if delta is not None and not (is_real(delta) and delta >= 1.0):
        errors.append(f"`delta` must be None or a finite number >= 1 (TRL's two-sided clip), got {delta!r}.")
    return errors


def band_errors(band_upper_start, band_upper_max, band_upper_step, band_lower_start, band_lower_min, band_lower_step,
                band_floor) -> list[str]:
    """The problems of the band fields alone (``BAPOConfig`` checks the target and the share's mode once, for both
    windows)."""
    numbers = dict(band_upper_start=band_upper_start, band_upper_max=band_upper_max, band_upper_step=band_upper_step,
                   band_lower_start=band_lower_start, band_lower_min=band_lower_min,
                   band_lower_step=band_lower_step, band_floor=band_floor)
    errors = [f"`{name}` must be a finite number, got {value!r}." for name, value in numbers.items()
              if not is_real(value)]
    if errors:
        return errors
    for name in ("band_upper_start", "band_upper_max", "band_upper_step", "band_lower_start", "band_lower_min",
                 "band_lower_step", "band_floor"):
        if not numbers[name] > 0.0:
            errors.append(f"`{name}` must be > 0 (a band half-width in standard errors, or a step), "
                          f"got {numbers[name]}.")
    if band_upper_start > band_upper_max:
        errors.append(f"`band_upper_start` ({band_upper_start}) must be <= `band_upper_max` ({band_upper_max}).")
    if band_lower_min > band_lower_start:
        errors.append(f"`band_lower_min` ({band_lower_min}) must be <= `band_lower_start` ({band_lower_start}): "
                      f"the search narrows the negatives' side from its start.")
    for side, span, step in (("upper", band_upper_max - band_upper_start, band_upper_step),
                             ("lower", band_lower_start - band_lower_min, band_lower_step)):
        if step > 0 and span / step > 10_000:
            errors.append(f"`band_{side}_step` ({step}) is too small: the search path would have more than 10000 "
                          f"points.")
    return errors


@lru_cache(maxsize=64)
def length_fair_path(settings: LengthFairSettings) -> SearchPath:
    """Algorithm 1's order on the band widths: the start ``(band_lower_start, band_upper_start)``, every ``k_high``
    step up to ``band_upper_max``, then every ``k_low`` step down to ``band_lower_min``. ``low_grid`` holds ``k_low``
    (descending) and ``high_grid`` ``k_high`` (ascending), so the path's ``clip_low``/``clip_high`` are the ``k``
    values."""
    s = settings
    high = _grid(s.band_upper_start, s.band_upper_max, s.band_upper_step)
    low = [s.band_lower_start - k for k in _grid(0.0, s.band_lower_start - s.band_lower_min, s.band_lower_step)]
    low_index = [0] * len(high) + list(range(1, len(low)))
    high_index = list(range(len(high))) + [len(high) - 1] * (len(low) - 1)
    return SearchPath(tuple(low), tuple(high), tuple(low_index), tuple(high_index), s.band_lower_step,
                      s.band_upper_step, delta=s.delta)


def sequence_statistics(log_ratio: torch.Tensor, mask: torch.Tensor, band_floor: float):
    """``(s, b)``, each ``(B,)`` float64: the mean token log-ratio of each sequence over its loss mask (GSPO's
    ``log R``) and its band unit ``max(sd / sqrt(L), band_floor)``; a sequence with no token gets ``s = 0``."""
    x = log_ratio.detach().to(torch.float64)
    m = (mask.detach() != 0).to(torch.float64)
    length = m.sum(-1).clamp(min=1.0)
    x = torch.where(m > 0, x, 0.0)
    s = x.sum(-1) / length
    variance = ((x - s[:, None]) ** 2 * m).sum(-1) / length
    return s, (variance.sqrt() / length.sqrt()).clamp(min=band_floor)


def sequence_bounds(b: torch.Tensor, k_low, k_high, delta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c_low, c_high)`` of every sequence: ``(B, 1)`` each for one pair of widths (for TRL's clamp, which
    broadcasts them over the sequence's ratio), ``(B, L)`` and ``(B, H)`` for vectors of widths (the search's grid);
    ``c_high`` never above ``delta`` (TRL's two-sided clip caps every ratio there, as the token search's upper path
    ends there)."""
    c_high = torch.exp(b[:, None] * k_high)
    if delta is not None:
        c_high = c_high.clamp(max=delta)
    return torch.exp(-b[:, None] * k_low), c_high


@dataclass(frozen=True)
class SequenceWindow:
    """Every sequence's window of one update: its band unit ``b`` (``(B,)``) and the chosen widths; what TRL's clamp
    and the metrics read of it."""

    b: torch.Tensor
    k_low: torch.Tensor
    k_high: torch.Tensor
    delta: float | None = None

    def bounds(self, k_low=None, k_high=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c_low, c_high)``, ``(B, 1)`` each, at the chosen widths (or at ``k_low``/``k_high``)."""
        return sequence_bounds(self.b, self.k_low if k_low is None else k_low,
                               self.k_high if k_high is None else k_high, self.delta)

    def sensitive(self, ratio: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                  path: SearchPath) -> torch.Tensor:
        """Tokens some window of the path treats differently (the loss type row's ``sensitive``): a positive above
        its sequence's narrowest ``c_high``, a negative below its sequence's highest ``c_low``."""
        c_low, c_high = self.bounds(min(path.clip_low), path.clip_high[0])
        return (positive & (ratio > c_high.to(ratio.dtype))) | (negative & (ratio < c_low.to(ratio.dtype)))

    def mean_sums(self, rows: torch.Tensor, k_low=None, k_high=None) -> torch.Tensor:
        """Local ``[sum c_low, sum c_high, sequences]`` over the sequences ``rows`` (``(B,)`` bool) at the chosen
        widths (or at ``k_low``/``k_high``), float64, for the logged mean window (the caller reduces it with the
        metrics' other sums)."""
        c_low, c_high = self.bounds(k_low, k_high)
        rows = rows.to(torch.float64)
        return torch.stack([(c_low[:, 0].double() * rows).sum(), (c_high[:, 0].double() * rows).sum(), rows.sum()])


def length_fair_sums(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, path: SearchPath,
                     band_floor: float, statistics_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The local sums of the shares for every grid value, in :func:`bapo_trl.core.clipping.grid_sums`'s layout
    ``[pos_value(H), pos_gradient(H), neg_value(L), neg_gradient(L), num_tokens, num_nonfinite]``.

    ``advantages``: ``(B,)``, ``(B, 1)`` or ``(B, T)``, already times each token's weight in TRL's loss (grpo's
    ``1 / L``, vLLM importance-sampling weights), as the trainer's search sees them. ``statistics_mask``: the tokens
    a sequence's mean and spread are taken over (TRL's loss mask, before the tokens its loss then drops; default
    ``mask``). A sequence with a non-finite log-ratio on a real token is left out whole (its mean is undefined) and
    its tokens are counted as non-finite.
    """
    return _sums_and_scale(log_ratio, advantages, mask, path, band_floor, statistics_mask)[0]


def _sums_and_scale(log_ratio, advantages, mask, path: SearchPath, band_floor: float, statistics_mask=None):
    """:func:`length_fair_sums` and each sequence's band unit ``b`` (``(B,)``), computed once for both."""
    x = log_ratio.detach().to(torch.float64)
    a = advantages.detach().to(torch.float64)
    a = (a[:, None] if a.dim() == 1 else a).expand_as(x)
    real = mask.detach() != 0
    over = real if statistics_mask is None else statistics_mask.detach() != 0
    finite_row = (torch.isfinite(x) | ~over).all(-1)
    valid = real & finite_row[:, None] & torch.isfinite(a)
    s, b = sequence_statistics(torch.where(over & finite_row[:, None], x, 0.0), over, band_floor)
    ratio = torch.exp(s)
    w = torch.where(valid, a, 0.0)
    w_pos, w_neg = w.clamp(min=0.0).sum(-1), (-w).clamp(min=0.0).sum(-1)  # (B,): each sign's weight per sequence
    k_high, k_low = _device_grids(path, x.device)  # made once per path and device: no host copy per call
    c_low, c_high = sequence_bounds(b, k_low, k_high, path.delta)  # (B, L), (B, H)
    r = ratio[:, None]
    pos_value = (torch.minimum(r, c_high) * w_pos[:, None]).sum(0)
    pos_gradient = torch.where(r < c_high, r * w_pos[:, None], 0.0).sum(0)  # (where: an inf ratio times 0 is NaN)
    neg_value = (torch.maximum(r, c_low) * w_neg[:, None]).sum(0)
    keeps = r > c_low
    if path.delta is not None:
        keeps = keeps & (r <= path.delta)
    neg_gradient = torch.where(keeps, r * w_neg[:, None], 0.0).sum(0)
    num_tokens = valid.sum().to(torch.float64)
    counts = torch.stack([num_tokens, real.sum().to(torch.float64) - num_tokens])
    return torch.cat([pos_value, pos_gradient, neg_value, neg_gradient, counts]), b


def length_fair_search(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                       reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       config: LengthFairSettings | None = None, statistics_mask: torch.Tensor | None = None,
                       **settings) -> SearchResult:
    """Choose ``(k_low, k_high)`` for one update (returned as the result's ``clip_low``/``clip_high``; the
    per-sequence windows are :func:`sequence_bounds`). ``reduce_fn`` sums a float64 vector over processes and is
    called exactly once, by every rank, so every rank chooses the same widths."""
    if config is None or settings:
        config = LengthFairSettings(**{**(asdict(config) if config else {}), **settings})
    if log_ratio.dim() != 2 or mask.shape != log_ratio.shape:
        raise ValueError(f"`log_ratio` must be (B, T) and `mask` of its shape, got {tuple(log_ratio.shape)} and "
                         f"{tuple(mask.shape)}.")
    return length_fair_choice(log_ratio, advantages, mask, config, reduce_fn, statistics_mask)[0]


def length_fair_choice(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       config: LengthFairSettings, reduce_fn: Callable | None = None,
                       statistics_mask: torch.Tensor | None = None) -> tuple[SearchResult, SequenceWindow]:
    """:func:`length_fair_search`'s result and every sequence's window at the chosen widths (what the trainer
    installs), the sequences' statistics computed once for both."""
    path = length_fair_path(config)
    packed, b = _sums_and_scale(log_ratio, advantages, mask, path, config.band_floor, statistics_mask)
    if reduce_fn is not None:
        packed = reduce_fn(packed)
    result = choose_bounds(packed, path, config)
    return result, SequenceWindow(b, result.clip_low, result.clip_high, config.delta)
