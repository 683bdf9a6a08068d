"""The length-fair window's named settings, as plain numbers (no torch, no TRL): the studies build their runs from
them."""

from __future__ import annotations

from ...trainer.presets import GSPO_DOCUMENTED

#: The band path the studies kept ("BAPO length-fair narrow", docs/results.md), in standard errors of a sequence's
#: mean log-ratio: ``k_high`` 0.002 to 0.2 in 37 points, ``k_low`` 0.03 down to 0.0015 in 16 (its step 0.0019 stops
#: short of ``band_lower_min`` 0.001): ``gspo_balanced()``'s ranges over a typical band unit near 0.3. The fields'
#: defaults; the band the studies dropped (1 to 4 standard errors) lives in ``benchmarks/study.py``.
GSPO_BAND = dict(band_upper_start=0.002, band_upper_max=0.2, band_upper_step=0.0055,
                 band_lower_start=0.03, band_lower_min=0.001, band_lower_step=0.0019)


def gspo_length_fair() -> dict:
    """GSPO's sequence-level ratio (loss ``grpo``, ``beta=0``) for :class:`~.config.LengthFairBAPOConfig`:
    ``LengthFairBAPOConfig(output_dir=..., **gspo_length_fair())`` runs the studies' "BAPO length-fair narrow"
    (the candidate study's second-round candidate; its band is the config's default, :data:`GSPO_BAND`)."""
    return {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
