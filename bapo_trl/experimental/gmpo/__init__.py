"""BAPO's search in front of TRL's experimental GMPO loss (the study's third candidate; it did not beat the method,
docs/results.md).

``BAPOGMPOTrainer(model, rewards, args=GMPOBAPOConfig(output_dir))``.
"""

from ...core.lazy import lazy_names

_EXPORTS = {
    "BAPOGMPOTrainer": "trainer",
    "GMPOBAPOConfig": "config",
    "gmpo_balanced": "presets",
    "GMPO_DOCUMENTED": "presets",
    "GEOMETRIC_MEAN": "geometric_mean",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
