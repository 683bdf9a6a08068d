"""GMPO's named settings: TRL's documented GMPO window, and BAPO's search path around it (plain numbers, no torch)."""

from __future__ import annotations

import math

#: GMPO as TRL documents it (``trl.experimental.gmpo.GMPOConfig``'s defaults, the GMPO paper's recommendation): the
#: token log-ratios clipped to ``[-0.4, 0.4]`` inside the geometric mean, i.e. ratios in ``[exp(-0.4), exp(0.4)]``.
GMPO_DOCUMENTED = dict(epsilon=0.4, epsilon_high=0.4)


def gmpo_balanced() -> dict:
    """BAPO's window on GMPO's geometric mean (for ``BAPOGMPOTrainer``): the search starts at TRL's documented GMPO
    window and widens it as BAPO's default path does, ``c_high`` from ``exp(0.4)`` (1.49) to 3.0 in 37 points and
    ``c_low`` from ``exp(-0.4)`` (0.67) up to 0.9 in 16; token-level ratios (GMPO's own), no dual clip (GMPO's loss
    has no two-sided clip). The candidate study's GMPO candidate (docs/results.md)."""
    high, low = math.exp(GMPO_DOCUMENTED["epsilon_high"]), math.exp(-GMPO_DOCUMENTED["epsilon"])
    return dict(importance_sampling_level="token", dual_clip=False,
                ratio_upper_start=high, ratio_upper_max=3.0, ratio_upper_step=(3.0 - high) / 36,
                ratio_lower_start=low, ratio_lower_max=0.9, ratio_lower_step=(0.9 - low) / 15)
