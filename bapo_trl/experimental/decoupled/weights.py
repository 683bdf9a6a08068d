"""The decoupled off-policy correction (AReaL's decoupled objective), as pure tensor functions.

A token sampled by an older policy (async generation, replay, partial rollout) or by another engine (vLLM's kernels)
carries two differences from the policy being trained: how far the policy moved since (staleness) and how far the
sampler's numbers are from the trainer's (mismatch). One ratio ``pi_theta / pi_behaviour`` folds both into the clip.
The decoupled objective splits them: the clip acts on ``pi_theta / pi_prox``, where the proximal policy is the
trainer's when the batch starts training (one forward pass), and ``pi_prox / pi_behaviour`` multiplies each token's
loss as a truncated importance weight. Its modes and caps read as TRL's ``vllm_importance_sampling_mode`` does
(token or sequence, truncate or mask; a sequence's weight is the product of its tokens' ratios).

:func:`weight_sums` and :func:`weight_values` are the metrics' halves (local sums, one collective, named values):
the weights' normalised effective sample size (in (0, 1]: 1 when every weight is equal), by origin and by age, the
share of weights the cap changed, and the mismatch and staleness parts of the old ratio apart (``|log prox/behaviour|``
over the tokens sampled by the weights the batch starts from, and over the older ones). The plain float64 loops the
tests compare them with live in :mod:`.reference`.
"""

from __future__ import annotations

import torch

#: TRL's ``vllm_importance_sampling_mode`` values, with the same meaning here.
WEIGHT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: Staleness buckets of the by-age effective sample size (as the search metrics' buckets).
AGE_BUCKETS = ("0", "1", "2", "3+")
#: The parts the sums are split by: every token, the fresh and the replayed ones, then one per age bucket.
PARTS = ("", "/fresh", "/replayed", *(f"/age_{age}" for age in AGE_BUCKETS))
#: Per part: count, sum w, sum w^2; then capped count, mismatch sum and count, staleness sum and count.
_PER_PART = 3

#: Logged once per generation batch by :class:`~.trainer.DecoupledBAPOTrainer`.
METRICS = (
    *(f"decoupled/ess{part}" for part in PARTS),
    "decoupled/capped_fraction",
    "decoupled/weight_mean",
    "decoupled/mismatch",
    "decoupled/staleness",
)


def behaviour_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str,
                      cap: float | None, floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, capped)``, both ``(B, T)``: each token's ``pi_prox / pi_behaviour`` (token modes), or its
    sequence's product of them (sequence modes, on every token of the sequence), truncated to ``[floor, cap]`` or set
    to 0 outside it (mask modes), as TRL forms its vLLM importance weights; ``capped`` marks the weights the bounds
    changed. Tokens outside ``mask`` add nothing to a sequence's product; a NaN behaviour log-prob (a token the
    sampler could not score) counts as ratio 1."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weight mode {mode!r}; one of {', '.join(WEIGHT_MODES)}")
    diff = torch.nan_to_num((proximal.float() - behaviour.float()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = torch.exp(diff)
    low = -torch.inf if floor is None else floor
    high = torch.inf if cap is None else cap
    capped = (weights < low) | (weights > high)
    if mode.endswith("truncate"):
        weights = weights if floor is None and cap is None else weights.clamp(min=floor, max=cap)
    else:
        weights = weights.masked_fill(capped, 0.0)
    return weights.expand_as(proximal), capped.expand_as(proximal)


def _units(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What one weight stands for: each valid token (token modes), or each sequence with a valid token, counted at
    its first valid token (sequence modes)."""
    valid = mask > 0
    if mode.startswith("token"):
        return valid
    first = valid & (valid.long().cumsum(-1) == 1)
    return first


def weight_sums(weights: torch.Tensor, capped: torch.Tensor, mask: torch.Tensor, mode: str, proximal: torch.Tensor,
                behaviour: torch.Tensor, replayed: torch.Tensor | None, staleness: torch.Tensor | None
                ) -> torch.Tensor:
    """Local float64 sums of one batch for :func:`weight_values` (reduce them over processes first). ``replayed``: per
    row (None: nothing replayed); ``staleness``: steps since each token was sampled, ``(B, T)`` (None: all fresh)."""
    units = _units(mask, mode)
    w = weights.double()
    rows = torch.zeros(mask.size(0), dtype=torch.bool, device=mask.device) if replayed is None else replayed.bool()
    age = torch.zeros_like(w) if staleness is None else staleness.double()
    parts = [units, units & ~rows[:, None], units & rows[:, None]]
    parts += [units & (age == a) for a in range(len(AGE_BUCKETS) - 1)]
    parts += [units & (age >= len(AGE_BUCKETS) - 1)]
    sums = []
    for part in parts:
        sums += [part.sum().double(), (w * part).sum(), (w * w * part).sum()]
    gap = torch.nan_to_num((proximal.double() - behaviour.double()).abs(), nan=0.0)
    valid = mask > 0
    fresh, stale = valid & (age == 0), valid & (age > 0)
    sums += [(capped & units).sum().double(), (gap * fresh).sum(), fresh.sum().double(), (gap * stale).sum(),
             stale.sum().double()]
    return torch.stack(sums)


def weight_values(totals: list[float]) -> dict[str, float]:
    """Named values from REDUCED :func:`weight_sums`: ``decoupled/ess{part}`` = ``(sum w)^2 / (n sum w^2)`` (NaN where
    a part is empty or every weight is 0), the capped share and mean weight over all units, and the mean
    ``|log pi_prox - log pi_behaviour|`` of the fresh tokens (``mismatch``) and of the older ones (``staleness``: the
    mismatch and the policy's move since)."""
    values = {}
    for i, part in enumerate(PARTS):
        n, s1, s2 = totals[_PER_PART * i : _PER_PART * i + _PER_PART]
        values[f"decoupled/ess{part}"] = s1 * s1 / (n * s2) if n > 0 and s2 > 0 else float("nan")
    n, s1 = totals[0], totals[1]
    capped, gap_fresh, n_fresh, gap_stale, n_stale = totals[_PER_PART * len(PARTS):]
    values["decoupled/capped_fraction"] = capped / n if n else float("nan")
    values["decoupled/weight_mean"] = s1 / n if n else float("nan")
    values["decoupled/mismatch"] = gap_fresh / n_fresh if n_fresh else float("nan")
    values["decoupled/staleness"] = gap_stale / n_stale if n_stale else float("nan")
    return values
