"""Named settings: ``BAPOConfig`` fields that belong together, under one name, so that a user runs what the studies
ran (``BAPOConfig(output_dir=..., **gspo_balanced())``).

Why a function of plain numbers: the studies (``benchmarks/study.py``) build their runs from the same function, so
the published results and a user's run cannot drift apart; nothing here imports torch or TRL.
"""

from __future__ import annotations

#: GSPO as TRL documents it for the GSPO paper's setting (TRL's paper index): the sequence-level ratio, loss ``grpo``,
#: a narrow window (the mean log-ratio of a sequence moves far less than a token's), no KL term.
GSPO_DOCUMENTED = dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                       beta=0.0)


def gspo_balanced(scale: float = 10.0) -> dict:
    """BAPO's balance of GSPO's sequence-level ratio, on a search path around TRL's documented GSPO window:
    ``c_high`` from ``1 + epsilon_high`` to ``1 + 10 x scale x epsilon_high`` (37 points), ``c_low`` from
    ``1 - 3 x scale x epsilon`` to ``1 - epsilon`` (16 points), with GSPO's ``epsilon = 3e-4``, ``epsilon_high =
    4e-4``; loss ``grpo``, sequence level, ``beta=0``, the dual clip on (``BAPOConfig``'s default). The search starts
    at GSPO's own window and widens it only as far as the positive share needs. The default ``scale=10``: ``c_high``
    in [1.0004, 1.04], ``c_low`` in [0.991, 0.9997].

    ``scale=10`` is the setting issue 53's study chose ("BAPO GSPO-scale x10" in docs/results.md: of the scales 1, 2,
    4, 10 and 25 it had the largest paired difference against the documented GSPO on the development seeds)."""
    if not (isinstance(scale, (int, float)) and scale >= 1):
        raise ValueError(f"gspo_balanced: `scale` must be a number >= 1, got {scale!r}")
    low, high = GSPO_DOCUMENTED["epsilon"], GSPO_DOCUMENTED["epsilon_high"]
    upper, lower = 10 * scale, 3 * scale
    gspo = {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
    return dict(gspo, ratio_upper_start=1 + high, ratio_upper_max=1 + high * upper,
                ratio_upper_step=high * (upper - 1) / 36,
                ratio_lower_start=1 - low * lower, ratio_lower_max=1 - low, ratio_lower_step=low * (lower - 1) / 15)


def gspo_length_fair() -> dict:
    """GSPO's sequence-level ratio (loss ``grpo``, ``beta=0``) with the length-fair window
    (``sequence_window="length_fair"``, its default band path): issue 53's second-round candidate, "BAPO length-fair"
    in the studies. Not a recommendation: it has no study results yet (docs/results.md)."""
    gspo = {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
    return dict(gspo, sequence_window="length_fair")
