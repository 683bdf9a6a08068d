"""The length-fair window (the study's second-round candidate; it did not beat ``gspo_balanced()``, docs/results.md):
GSPO's sequence ratio clipped per sequence in a band as wide as the noise of its own mean.

``LengthFairBAPOTrainer(model, rewards, args=LengthFairBAPOConfig(output_dir, **gspo_length_fair()))``.
"""

from ...core.lazy import lazy_names

_EXPORTS = {
    "LengthFairBAPOConfig": "config",
    "LengthFairBAPOTrainer": "trainer",
    "gspo_length_fair": "presets",
    "GSPO_BAND": "presets",
    "LengthFairSettings": "search",
    "length_fair_search": "search",
    "METRICS": "metrics",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
