"""The BAPO clipping-bound search (Xi et al., 2025, arXiv 2510.18927, Algorithm 1), as pure tensor functions.

For one update, BAPO moves the PPO ratio window ``[c_low, c_high]`` along a fixed path of candidates until the
positive-advantage tokens hold at least a share ``rho0`` of the loss. Because the path is fixed, every candidate
is scored in one vectorised pass:

* positive tokens are binned by their ratio against the ``c_high`` grid, negative tokens against the ``c_low``
  grid (arithmetically: the grids are lattices, so no binary search per token), and prefix / suffix sums over
  the bins give, for every grid value ``c``, ``sum min(r, c) * A`` and ``sum max(r, c) * |A|`` at once. Memory is
  O(tokens + grid), never O(tokens x candidates);
* the per-grid sums of all processes are reduced in ONE collective (``reduce_fn``), so every rank picks the
  same bounds;
* the first candidate meeting the target is picked on device (``argmax`` over a boolean vector): no Python loop
  over candidates and no host sync.

The plain loops this replaces live in :mod:`bapo_trl.core.clipping_reference` and the tests compare the two.

Caveat (documented on purpose): under the *value* share, raising ``c_low`` LOWERS rho, because a clipped
negative token counts ``c_low * |A|``; only raising ``c_high`` raises it. Under the *gradient* share, raising
``c_low`` removes negatives from the gradient and so raises rho.

TRL's two-sided clip ``delta`` (``coef_1 = clamp(r, max=delta)`` before ``-min(coef_1 A, coef_2 A)``; the ``verl``
variant's dual clip) takes the gradient from a negative token with ``r > delta`` (its loss is ``-delta A``), so the
gradient share leaves such tokens out (:attr:`BAPOSettings.delta`; one more bin in the same pass, still one
collective). Positives are untouched (their gradient stops at ``c_high <= delta``), and so is the value share.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable

import torch

VARIANTS = ("paper", "verl")
MODES = ("value", "gradient")

#: Grid counts are ``floor((max - start) / step + GRID_TOLERANCE)`` so that ``0.6 + 15 * 0.02`` reaches ``0.9``.
GRID_TOLERANCE = 1e-6
#: A candidate meets the target when ``rho >= rho0 - TARGET_TOLERANCE``.
TARGET_TOLERANCE = 1e-9
#: The official code divides by ``neg + VERL_EPS`` when it forms the pos/neg ratio.
VERL_EPS = 1e-8


@dataclass(frozen=True)
class BAPOSettings:
    """The search settings; field names and defaults match :class:`bapo_trl.BAPOConfig`.

    Validated at construction: every bad value raises ``ValueError`` naming the field, the value and the allowed
    range, so a bad setting fails before any model is loaded.

    ``delta``: TRL's two-sided clip of the clipped losses (None: none), which :attr:`BAPOConfig.bapo_settings` sets
    only for those losses (TRL ignores it elsewhere), with ``ratio_upper_max <= delta``. The gradient share leaves
    out the negative tokens above it (no gradient there); the value share and the path do not read it.
    """

    positive_contribution_target: float = 0.5
    ratio_lower_start: float = 0.6
    ratio_lower_max: float = 0.9
    ratio_lower_step: float = 0.02
    ratio_upper_start: float = 1.2
    ratio_upper_max: float = 3.0
    ratio_upper_step: float = 0.05
    bapo_variant: str = "paper"
    positive_contribution_mode: str = "value"
    delta: float | None = None

    def __post_init__(self):
        for error in settings_errors(**asdict(self)):
            raise ValueError(error)


def is_real(value) -> bool:
    """A finite int or float, not a bool (a setting's number: the config's checks and these share it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def settings_errors(
    positive_contribution_target,
    ratio_lower_start,
    ratio_lower_max,
    ratio_lower_step,
    ratio_upper_start,
    ratio_upper_max,
    ratio_upper_step,
    bapo_variant,
    positive_contribution_mode,
    delta=None,
) -> list[str]:
    """Every problem with a set of search settings, as messages naming the field, the value and the allowed range."""
    errors = []
    numbers = {
        "positive_contribution_target": positive_contribution_target,
        "ratio_lower_start": ratio_lower_start,
        "ratio_lower_max": ratio_lower_max,
        "ratio_lower_step": ratio_lower_step,
        "ratio_upper_start": ratio_upper_start,
        "ratio_upper_max": ratio_upper_max,
        "ratio_upper_step": ratio_upper_step,
    }
    for name, value in numbers.items():
        if not is_real(value):
            errors.append(f"`{name}` must be a finite number, got {value!r}.")
    if errors:
        return errors
    if not 0.0 < positive_contribution_target < 1.0:
        errors.append(
            f"`positive_contribution_target` must be in the open interval (0, 1) (it is a share of the loss), "
            f"got {positive_contribution_target}."
        )
    for name in ("ratio_lower_start", "ratio_lower_max"):
        if not 0.0 < numbers[name] <= 1.0:
            errors.append(f"`{name}` must be in (0, 1] (a lower ratio bound), got {numbers[name]}.")
    for name in ("ratio_upper_start", "ratio_upper_max"):
        if not 1.0 <= numbers[name] < 1e6:
            errors.append(f"`{name}` must be in [1, 1e6) (an upper ratio bound), got {numbers[name]}.")
    for name in ("ratio_lower_step", "ratio_upper_step"):
        if not numbers[name] > 0.0:
            errors.append(f"`{name}` must be > 0, got {numbers[name]}.")
    if ratio_lower_start > ratio_lower_max:
        errors.append(
            f"`ratio_lower_start` ({ratio_lower_start}) must be <= `ratio_lower_max` ({ratio_lower_max})."
        )
    if ratio_upper_start > ratio_upper_max:
        errors.append(
            f"`ratio_upper_start` ({ratio_upper_start}) must be <= `ratio_upper_max` ({ratio_upper_max})."
        )
    for side in ("lower", "upper"):
        start, stop, step = (numbers[f"ratio_{side}_{k}"] for k in ("start", "max", "step"))
        if step > 0 and (stop - start) / step > 10_000:
            errors.append(
                f"`ratio_{side}_step` ({step}) is too small for the range [{start}, {stop}]: the search path would "
                f"have more than 10000 points; allowed: (max - start) / step <= 10000."
            )
    if bapo_variant not in VARIANTS:
        errors.append(f"`bapo_variant` must be one of {VARIANTS}, got {bapo_variant!r}.")
    if positive_contribution_mode not in MODES:
        errors.append(f"`positive_contribution_mode` must be one of {MODES}, got {positive_contribution_mode!r}.")
    if delta is not None and not (is_real(delta) and delta >= ratio_upper_max):
        errors.append(
            f"`delta` must be None or a finite number >= `ratio_upper_max` ({ratio_upper_max}) (TRL's two-sided clip "
            f"caps every ratio there, so no c_high may exceed it), got {delta!r}."
        )
    return errors


def _grid(start: float, stop: float, step: float) -> list[float]:
    """``start, start + step, ...`` up to ``stop`` (inclusive within tolerance); the last point may be ``stop``
    itself when ``stop - start`` is not a whole number of steps (the official code's ``min(cur + step, max)``)."""
    count = math.floor((stop - start) / step + GRID_TOLERANCE)
    points = [min(start + k * step, stop) for k in range(count + 1)]
    return points


@dataclass(frozen=True)
class SearchPath:
    """The fixed candidate path: candidate ``k`` is ``(low_grid[low_index[k]], high_grid[high_index[k]])``.

    ``negatives_on_high``: the negative tokens' sums depend on the UPPER bound too (a cap on every ratio, as CISPO's;
    :func:`cap_path`): they are then measured on ``high_grid`` and indexed by ``high_index``, and ``low_grid`` is
    ``(0.0,)``, a lower bound of 0 on a ratio, i.e. none.

    ``delta``: TRL's two-sided clip (:attr:`BAPOSettings.delta`), None when off: the negatives above it carry no
    gradient (:func:`grid_sums` bins them apart).
    """

    low_grid: tuple[float, ...]
    high_grid: tuple[float, ...]
    low_index: tuple[int, ...]
    high_index: tuple[int, ...]
    low_step: float
    high_step: float
    negatives_on_high: bool = False
    delta: float | None = None

    def __len__(self) -> int:
        return len(self.low_index)

    @property
    def clip_low(self) -> list[float]:
        return [self.low_grid[i] for i in self.low_index]

    @property
    def clip_high(self) -> list[float]:
        return [self.high_grid[i] for i in self.high_index]


@lru_cache(maxsize=64)
def search_path(settings: BAPOSettings) -> SearchPath:
    """The candidates the search visits, in order.

    * ``paper`` (Algorithm 1): start at ``(a-, a+)``; while the lower bound can still take a step
      (``c_low + d- <= b-``), raise ``c_high`` by ``d+`` while it fits under ``b+``, else raise ``c_low`` by ``d-``.
      So: the start, every upper step, then every lower step. Note the loop condition: if the lower range has no
      room for one step, the paper's loop never runs and the upper bound never moves either.
    * ``verl`` (official code): raise ``c_low`` by ``min(c_low + step, max)`` up to its max first, then ``c_high``.
    """
    s = settings
    if s.bapo_variant == "paper":
        low = _grid(s.ratio_lower_start, s.ratio_lower_max, s.ratio_lower_step)
        high = _grid(s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step)
        if len(low) == 1:  # `c_low + d- <= b-` fails at once: Algorithm 1 takes no step at all
            return SearchPath(tuple(low), tuple(high[:1]), (0,), (0,), s.ratio_lower_step, s.ratio_upper_step,
                              delta=s.delta)
        low_index = [0] * len(high) + list(range(1, len(low)))
        high_index = list(range(len(high))) + [len(high) - 1] * (len(low) - 1)
    else:
        low = _ceil_grid(s.ratio_lower_start, s.ratio_lower_max, s.ratio_lower_step)
        high = _ceil_grid(s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step)
        low_index = list(range(len(low))) + [len(low) - 1] * (len(high) - 1)
        high_index = [0] * len(low) + list(range(1, len(high)))
    return SearchPath(
        tuple(low), tuple(high), tuple(low_index), tuple(high_index), s.ratio_lower_step, s.ratio_upper_step,
        delta=s.delta,
    )


@lru_cache(maxsize=64)
def cap_path(settings: BAPOSettings) -> SearchPath:
    """The candidates of a loss with an upper cap and no lower bound (CISPO: ``min(r, c)`` on every token): only the
    upper grid, ``a+`` then every step ``d+`` up to ``b+`` (``verl``: ``min(cur + step, max)``, so ``b+`` itself
    ends the path). The lower-bound settings play no part; the path reports ``c_low = 0`` (no lower bound)."""
    s = settings
    grid = _grid if s.bapo_variant == "paper" else _ceil_grid
    high = grid(s.ratio_upper_start, s.ratio_upper_max, s.ratio_upper_step)
    return SearchPath((0.0,), tuple(high), (0,) * len(high), tuple(range(len(high))), s.ratio_lower_step,
                      s.ratio_upper_step, negatives_on_high=True)


def _ceil_grid(start: float, stop: float, step: float) -> list[float]:
    """The official code's ``cur = min(cur + step, max)`` sequence: whole steps, then ``max`` itself."""
    points = _grid(start, stop, step)
    if points[-1] < stop - GRID_TOLERANCE * step:
        points.append(stop)
    return points


@dataclass
class SearchResult:
    """What the search chose, as 0-dim tensors on the input's device (no host sync needed to use them).

    ``positive_contribution`` is rho as a SHARE ``pos / (pos + neg)`` under the configured mode (also for the
    ``verl`` variant, whose decision uses ``pos / neg``); it is NaN when ``pos + neg == 0`` (nothing to balance,
    which counts as meeting the target). ``value_share`` and ``gradient_share`` are both shares at the chosen
    bounds whatever the mode, for logging.
    """

    clip_low: torch.Tensor
    clip_high: torch.Tensor
    positive_contribution: torch.Tensor
    positive_contribution_before: torch.Tensor
    steps: torch.Tensor
    target_met: torch.Tensor
    value_share: torch.Tensor
    gradient_share: torch.Tensor
    num_tokens: torch.Tensor
    num_nonfinite: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        """All fields as Python floats, with ONE host transfer."""
        names = list(self.__dataclass_fields__)
        values = torch.stack([getattr(self, n).to(torch.float64) for n in names]).tolist()
        return dict(zip(names, values))


def _side_table(grid: tuple[float, ...], step: float, positive: bool, offset: int,
                delta: float | None = None) -> list[float]:
    """Per-side constants for :func:`_histogram`: ``[start, 1/step, step, k_max, last, nudge, offset, beyond]``.

    Points ``0 .. n-2`` of a grid lie on the lattice ``start + k * step`` (built with that very expression, so the
    lattice recomputed on device is bit-identical); the last point (``max``, off the lattice in the ``verl`` path
    when the range is not a whole number of steps) is compared on its own. ``nudge`` turns ``c <= r`` into
    ``c < r`` for positives: ``r * (1 - 2**-53)`` is the double just below a positive ``r``. So a ratio exactly on a
    bound counts where TRL's loss puts it: inside the window, with its full gradient (torch's ``min``/``max`` split
    the gradient at a tie between two branches that both carry it). ``beyond`` (``delta``, else inf; the double
    above it): a negative with ``r > delta`` goes one bin past the last (at ``delta`` it keeps its gradient).
    """
    n = len(grid)
    assert all(grid[0] + k * step == grid[k] for k in range(n - 1)), "grid points 0 .. n-2 must be on the lattice"
    last = grid[-1] if n > 1 else math.inf
    nudge = 1.0 - 2.0**-53 if positive else 1.0
    beyond = math.inf if delta is None else math.nextafter(float(delta), math.inf)
    return [grid[0], 1.0 / step, step, float(max(n - 2, 0)), last, nudge, float(offset), beyond]


def _negative_grid(path: SearchPath) -> tuple[float, ...]:
    """The grid the negative tokens' sums are measured on."""
    return path.high_grid if path.negatives_on_high else path.low_grid


@lru_cache(maxsize=64)
def _device_table(path: SearchPath, device: torch.device) -> torch.Tensor:
    """``(2, 8)`` rows ``(negative side, positive side)`` of :func:`_side_table`, on ``device``, made once:
    negatives bin against the ``c_low`` grid (the ``c_high`` grid for a cap path, with the positives' rule
    ``#{c < r}``) after the ``H + 1`` positive bins; with ``path.delta``, negatives above it in one more bin."""
    high = _side_table(path.high_grid, path.high_step, positive=True, offset=0)
    if path.negatives_on_high:
        low = _side_table(path.high_grid, path.high_step, positive=True, offset=len(path.high_grid) + 1)
    else:
        low = _side_table(path.low_grid, path.low_step, positive=False, offset=len(path.high_grid) + 1,
                          delta=path.delta)
    return torch.tensor([low, high], dtype=torch.float64, device=device)


def _at_or_above(r: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``1.0`` where ``c <= r``, else ``0.0``, written to ``out``: float arithmetic, several times cheaper on CPU
    than a boolean comparison converted back to float. Exact: ``r - c`` is zero only when ``r == c``."""
    return torch.sub(r, c, out=out).sign_().add_(1.0).clamp_max_(1.0)


def _histogram(r: torch.Tensor, side: torch.Tensor, weight: torch.Tensor, path: SearchPath) -> torch.Tensor:
    """``(2, H + 1 + L + 1)`` sums of ``weight`` and ``r * weight`` per bin: bin ``j <= H`` holds positives with
    ``#{c_high < r} = j``, bin ``H + 1 + j`` negatives with ``#{c_low <= r} = j`` (on a cap path: ``L = H`` and
    ``#{c_high < r} = j``): a ratio on a bound is inside the window, as TRL's loss gives it its gradient. With
    ``path.delta`` one more bin, ``H + 1 + L + 1``, holds the negatives with ``r > delta`` (above every ``c_low``:
    ``delta >= 1``). ``r`` (float64, finite) is overwritten.

    Replaces a binary search per token (``torch.bucketize``, formerly the slowest step) by arithmetic: round ``r``
    to the nearest lattice point ``k`` (its neighbours then lie on known sides), compare exactly with that one grid
    value and with the last one. ``side`` (``A > 0``) picks the constants per row (or per token).
    """
    table = _device_table(path, r.device)
    start, inv_step, step, k_max, last, nudge, offset, beyond = torch.where(
        side[..., None], table[1], table[0]).unbind(-1)
    r.mul_(nudge)  # moves positives' ratios by one ulp (relative 1e-16), which no sum can notice
    k = (r - start).mul_(inv_step).round_().clamp_min_(0.0).clamp_max_(k_max)
    scratch = torch.mul(k, step).add_(start)  # exactly grid[k]: the same float expression the grid was built with
    k.add_(_at_or_above(r, scratch, out=scratch))
    k.add_(_at_or_above(r, last, out=scratch))
    if path.delta is not None:  # negatives above TRL's two-sided clip: one bin further (positives: beyond = inf)
        k.add_(_at_or_above(r, beyond, out=scratch))
    k.add_(offset)
    bins = scratch.view(torch.int64).copy_(k).flatten()  # reuses the scratch memory: fresh pages cost on CPU
    weight = weight.flatten()
    n_bins = len(path.high_grid) + len(_negative_grid(path)) + 2 + (path.delta is not None)
    sums = torch.zeros(2, n_bins, dtype=torch.float64, device=r.device)
    sums[0].scatter_add_(0, bins, weight)  # (deterministic on CUDA when asked, unlike a weighted bincount)
    sums[1].scatter_add_(0, bins, r.flatten().mul_(weight))
    return sums


@lru_cache(maxsize=64)
def _device_grids(path: SearchPath, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(path.high_grid, dtype=torch.float64, device=device),
            torch.tensor(path.low_grid, dtype=torch.float64, device=device))


def _below_above(sums: torch.Tensor):
    """Per grid value ``c_j`` from per-bin sums: ``(sum_below w, sum_below r*w, sum_above w, sum_above r*w)``, where
    a token in bin ``i`` is below ``c_j`` when ``i <= j``. Suffix sums rather than ``total - prefix`` so huge ratios
    cannot cancel small ones."""
    below = sums.cumsum(dim=1)[:, :-1]
    above = sums.flip(1).cumsum(dim=1).flip(1)[:, 1:]
    return below[0], below[1], above[0], above[1]


def prepared(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    """The search's view of a batch: ``(r, a, weight, counts)`` with ``r`` a float64 copy of the ratios (``(B, T)``,
    ours to change in place), ``a`` the float64 advantages (``(B, 1)`` or ``(B, T)``), ``weight = |A|`` on the valid
    tokens and 0 elsewhere, and ``counts = [num_tokens, num_nonfinite]``. NaN or inf in ``r`` and ``A`` are replaced
    by 0 and their tokens have weight 0, so they cannot reach any sum.

    Written for memory traffic, which is what this costs on CPU: few token-sized buffers, updated in place, masks
    as float factors (a boolean ``where`` over the tokens costs as much as ten float operations).
    """
    r = ratio.detach().to(torch.float64, copy=True)  # our own buffer: changed in place below
    a = advantages.detach().to(torch.float64)
    if a.dim() == 1:
        a = a.unsqueeze(1)  # (B, 1): what is per row stays per row
    # 1.0 where finite (inf * 0 and NaN * 0 are NaN), times 1.0 where the mask is nonzero (|m| / |m|, as a sign)
    finite_a = a.mul(0.0).add_(1.0).nan_to_num_(nan=0.0)
    valid = r.mul(0.0).add_(1.0).nan_to_num_(nan=0.0).mul_(mask.detach()).abs_().sign_().mul_(finite_a)
    # from here on NaN or inf in r and A cannot reach any arithmetic; masked-out tokens have weight 0
    r.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    a = a.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    num_tokens = valid.sum()
    counts = torch.stack([num_tokens, torch.count_nonzero(mask).to(torch.float64) - num_tokens])
    return r, a, valid.mul_(a.abs()), counts


def grid_sums(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, path: SearchPath) -> torch.Tensor:
    """The clipped surrogate's local (un-reduced) sums for every grid value, packed into ONE float64 vector for a
    single collective.

    Layout: ``[pos_value(H), pos_gradient(H), neg_value(L), neg_gradient(L), num_tokens, num_nonfinite]`` with
    ``H = len(high_grid)``, ``L = len(low_grid)``.
    """
    r, a, weight, counts = prepared(ratio, advantages, mask)
    # Positives: value min(r, c_high) * A; they keep a gradient while r <= c_high (weight r * A).
    # Negatives: value max(r, c_low) * |A|; they keep a gradient while c_low <= r (<= delta, TRL's two-sided clip,
    # when set: above it the loss is -delta * A, a constant) (weight r * |A|).
    sums = _histogram(r, a > 0, weight, path)
    H = len(path.high_grid)
    high_grid, low_grid = _device_grids(path, sums.device)
    below_w, below_rw, above_w, _ = _below_above(sums[:, : H + 1])
    pos_value = below_rw + high_grid * above_w
    pos_gradient = below_rw
    negatives = sums[:, H + 1 :]
    if path.delta is not None:  # the last bin: negatives above delta, in every value sum, in no gradient sum
        negatives, beyond = negatives[:, :-1], negatives[1, -1]
    below_w, _, _, above_rw = _below_above(negatives)
    neg_value = low_grid * below_w + above_rw
    if path.delta is not None:
        neg_value = neg_value + beyond
    neg_gradient = above_rw
    return torch.cat([pos_value, pos_gradient, neg_value, neg_gradient, counts])


def cap_sums(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, path: SearchPath) -> torch.Tensor:
    """The sums of a capped importance weight (CISPO: ``sg(min(r, c)) A log pi``) for every ``c`` of a
    :func:`cap_path`: ``pos = sum_{A>0} min(r, c) A``, ``neg = sum_{A<0} min(r, c) |A|``, the weight each token's
    gradient ``min(r, c) A grad log pi`` carries. Every token keeps a gradient, so the value and the gradient share
    are one: the layout of :func:`grid_sums` with ``L = H`` and each share twice."""
    if not path.negatives_on_high:
        raise ValueError(
            "cap_sums needs a cap path (bapo_trl.core.clipping.cap_path): its negatives are capped by c too."
        )
    r, a, weight, counts = prepared(ratio, advantages, mask)
    sums = _histogram(r, a > 0, weight, path)
    H = len(path.high_grid)
    high_grid, _ = _device_grids(path, sums.device)
    shares = []
    for part in (sums[:, : H + 1], sums[:, H + 1 :]):  # positives, negatives: both binned on the c grid
        _, below_rw, above_w, _ = _below_above(part)
        shares.append(below_rw + high_grid * above_w)
    pos, neg = shares
    return torch.cat([pos, pos, neg, neg, counts])


@lru_cache(maxsize=64)
def _path_tensors(path: SearchPath, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per candidate, made once per path and device (a small search is dominated by per-op costs):
    the positions in the packed vector of ``(pos_value, neg_value, pos_gradient, neg_gradient)``, shape (4, K),
    and the bounds ``(c_low, c_high)``, shape (2, K)."""
    H, L = len(path.high_grid), len(_negative_grid(path))
    hi = torch.tensor(path.high_index)
    lo = hi if path.negatives_on_high else torch.tensor(path.low_index)
    index = torch.stack([hi, 2 * H + lo, H + hi, 2 * H + L + lo]).to(device)
    bounds = torch.tensor([path.clip_low, path.clip_high], dtype=torch.float64, device=device)
    return index, bounds


def choose_bounds(packed: torch.Tensor, path: SearchPath, settings: BAPOSettings) -> SearchResult:
    """Pick the first candidate of ``path`` that meets the target, from (already reduced) :func:`grid_sums`."""
    index, bounds = _path_tensors(path, packed.device)
    sums = packed[index]
    pos, neg = sums[0::2], sums[1::2]  # rows: value, gradient; one column per candidate
    total = pos + neg
    shares = torch.where(total > 0, pos / total, torch.nan)  # NaN: nothing to balance
    row = 0 if settings.positive_contribution_mode == "value" else 1

    rho0 = settings.positive_contribution_target
    if settings.bapo_variant == "paper":
        meets = shares[row] >= rho0 - TARGET_TOLERANCE
    else:  # official code: pos / (neg + eps) against the ratio target q = rho0 / (1 - rho0)
        meets = pos[row] / (neg[row] + VERL_EPS) >= rho0 / (1.0 - rho0) - TARGET_TOLERANCE
    meets = meets | (total[row] <= 0)
    chosen = torch.where(meets.any(), torch.argmax(meets.to(torch.uint8)), len(path) - 1)  # first one that meets

    # index_select, not ``[:, chosen]``: indexing with a 0-dim integer tensor calls ``.item()`` (a host sync on CUDA)
    at = chosen.view(1)
    clip_low, clip_high, value_share, gradient_share = (
        torch.cat([bounds, shares]).index_select(1, at).view(-1).unbind()
    )
    return SearchResult(
        clip_low=clip_low,
        clip_high=clip_high,
        positive_contribution=(value_share, gradient_share)[row],
        positive_contribution_before=shares[row, 0],
        steps=chosen,
        target_met=meets.index_select(0, at).view(()),
        value_share=value_share,
        gradient_share=gradient_share,
        num_tokens=packed[-2],
        num_nonfinite=packed[-1],
    )


def search_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    config: BAPOSettings | None = None,
    sums_fn: Callable | None = None,
    path: SearchPath | None = None,
    **settings,
) -> SearchResult:
    """Choose ``(c_low, c_high)`` for one update with BAPO's bound search.

    Args:
        ratio: ``(B, T)`` importance ratios ``pi_theta / pi_behaviour`` (detached; any float dtype).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages.
        mask: ``(B, T)``; nonzero marks real completion tokens. NaN or inf on masked-out tokens are ignored; on real
            tokens they are left out of the sums and counted in ``num_nonfinite``.
        reduce_fn: sums a float64 vector over processes (e.g. ``lambda t: accelerator.reduce(t, "sum")``). Called
            exactly once, by every rank, even with an empty batch, so ranks always agree on the bounds.
        config: a ready :class:`BAPOSettings` (the trainer passes its own); keyword ``settings`` override it.
        sums_fn: the share's per-grid sums (the loss type's, :mod:`bapo_trl.core.loss_types`); default
            :func:`grid_sums`, the clipped surrogate's.
        path: the candidates (the loss type's path of ``config``); default :func:`search_path`.
        **settings: :class:`BAPOSettings` fields (``positive_contribution_target``, ``ratio_lower_start``, ...).

    Returns:
        A :class:`SearchResult` of 0-dim tensors on ``ratio.device``.
    """
    if config is None or settings:
        config = BAPOSettings(**{**(asdict(config) if config else {}), **settings})
    if ratio.dim() != 2:
        raise ValueError(f"`ratio` must have shape (B, T), got {tuple(ratio.shape)}.")
    if mask.shape != ratio.shape:
        raise ValueError(f"`mask` must have the shape of `ratio` {tuple(ratio.shape)}, got {tuple(mask.shape)}.")
    if advantages.shape not in (ratio.shape[:1], (ratio.shape[0], 1), ratio.shape):
        raise ValueError(
            f"`advantages` must have shape (B,), (B, 1) or (B, T) with (B, T) = {tuple(ratio.shape)}, got "
            f"{tuple(advantages.shape)}."
        )
    path = path or search_path(config)
    packed = (sums_fn or grid_sums)(ratio, advantages, mask, path)
    if reduce_fn is not None:
        packed = reduce_fn(packed)
    return choose_bounds(packed, path, config)
