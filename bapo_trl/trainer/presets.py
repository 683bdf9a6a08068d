"""Named settings: ``BAPOConfig`` fields that belong together, under one name, so that a user runs what the studies
ran (``BAPOConfig(output_dir=..., **gspo_balanced())``).

Why a function of plain numbers: the studies (``benchmarks/study.py``) build their runs from the same function, so
the published results and a user's run cannot drift apart; nothing here imports torch or TRL.
"""

from __future__ import annotations

import math

from ..core.window_rule import SEQUENCE_SCALE, sequence_widening, window_path

#: GSPO as TRL documents it for the GSPO paper's setting (TRL's paper index): the sequence-level ratio, loss ``grpo``,
#: a narrow window (the mean log-ratio of a sequence moves far less than a token's), no KL term.
GSPO_DOCUMENTED = dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                       beta=0.0)


def gspo_balanced(scale: float = SEQUENCE_SCALE) -> dict:
    """BAPO's balance of GSPO's sequence-level ratio, on a search path around TRL's documented GSPO window:
    ``c_high`` from ``1 + epsilon_high`` to ``1 + 10 x scale x epsilon_high`` (37 points), ``c_low`` from
    ``1 - 3 x scale x epsilon`` to ``1 - epsilon`` (16 points), with GSPO's ``epsilon = 3e-4``, ``epsilon_high =
    4e-4``; loss ``grpo``, sequence level, ``beta=0``, the dual clip on (``BAPOConfig``'s default). ``c_high`` starts
    at GSPO's own bound; ``c_low`` starts 3 x scale times wider than GSPO's and reaches GSPO's bound at the path's end.
    The default ``scale=10``: ``c_high`` from 1.0004 up to 1.04, ``c_low`` from 0.991 up to 0.9997, which is the path
    ``BAPOConfig`` derives from GSPO's documented window by itself (:mod:`bapo_trl.core.window_rule`).

    ``scale=10`` is the setting issue 53's study chose ("BAPO GSPO-scale x10" in docs/results.md: of the scales 1, 2,
    4, 10 and 25 it had the largest paired difference against the documented GSPO on the development seeds)."""
    if not (isinstance(scale, (int, float)) and scale >= 1):
        raise ValueError(f"gspo_balanced: `scale` must be a number >= 1, got {scale!r}")
    gspo = {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
    return dict(gspo, **window_path(GSPO_DOCUMENTED["epsilon"], GSPO_DOCUMENTED["epsilon_high"],
                                    sequence_widening(scale)))


#: The length-fair window's band paths (``BAPOConfig``'s ``band_*`` fields), in standard errors of a sequence's mean
#: log-ratio. ``"gspo"``: scaled to the documented GSPO's width (``k_high`` 0.002 to 0.2 in 37 points, ``k_low`` 0.03
#: down to 0.0015 in 16, its step 0.0019 stopping short of ``band_lower_min`` 0.001: gspo_balanced's ranges over a
#: typical band unit near 0.3), the studies' "BAPO length-fair narrow".
#: ``"wide"``: 1 to 4 standard errors on both sides (BAPOConfig's field defaults), the studies' "BAPO length-fair".
LENGTH_FAIR_BANDS = {
    "gspo": dict(band_upper_start=0.002, band_upper_max=0.2, band_upper_step=0.0055,
                 band_lower_start=0.03, band_lower_min=0.001, band_lower_step=0.0019),
    "wide": dict(band_upper_start=1.0, band_upper_max=4.0, band_upper_step=0.25,
                 band_lower_start=4.0, band_lower_min=1.0, band_lower_step=0.25),
}


def gspo_length_fair(band: str = "gspo") -> dict:
    """GSPO's sequence-level ratio (loss ``grpo``, ``beta=0``) with the length-fair window
    (``sequence_window="length_fair"``: each sequence clipped in ``log R in [-k_low b, k_high b]``, ``b`` the standard
    error of its mean token log-ratio), on one of :data:`LENGTH_FAIR_BANDS`: issue 53's second-round candidate.
    ``band="gspo"`` is the studies' "BAPO length-fair narrow"; ``band="wide"`` their "BAPO length-fair", which lost
    on the development seeds and was dropped (docs/results.md)."""
    if band not in LENGTH_FAIR_BANDS:
        raise ValueError(f"gspo_length_fair: `band` must be one of {sorted(LENGTH_FAIR_BANDS)}, got {band!r}")
    gspo = {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
    return dict(gspo, sequence_window="length_fair", **LENGTH_FAIR_BANDS[band])


#: GMPO as TRL documents it (``trl.experimental.gmpo.GMPOConfig``'s defaults, the GMPO paper's recommendation): the
#: token log-ratios clipped to ``[-0.4, 0.4]`` inside the geometric mean, i.e. ratios in ``[exp(-0.4), exp(0.4)]``.
GMPO_DOCUMENTED = dict(epsilon=0.4, epsilon_high=0.4)


def gmpo_balanced() -> dict:
    """BAPO's window on GMPO's geometric mean (for ``BAPOGMPOTrainer``): the search starts at TRL's documented GMPO
    window and widens it as BAPO's default path does, ``c_high`` from ``exp(0.4)`` (1.49) to 3.0 in 37 points and
    ``c_low`` from ``exp(-0.4)`` (0.67) up to 0.9 in 16; token-level ratios (GMPO's own), no dual clip (GMPO's loss
    has no two-sided clip). Issue 53's GMPO candidate (docs/results.md)."""
    high, low = math.exp(GMPO_DOCUMENTED["epsilon_high"]), math.exp(-GMPO_DOCUMENTED["epsilon"])
    return dict(importance_sampling_level="token", dual_clip=False,
                ratio_upper_start=high, ratio_upper_max=3.0, ratio_upper_step=(3.0 - high) / 36,
                ratio_lower_start=low, ratio_lower_max=0.9, ratio_lower_step=(0.9 - low) / 15)
