"""The decoupled off-policy correction (AReaL's decoupled objective; a research candidate that did not beat the method,
docs/results.md): clip against the proximal policy, weight each token by the truncated ``pi_prox / pi_behaviour``.

``DecoupledBAPOTrainer(model, rewards, args=DecoupledBAPOConfig(output_dir, ...))``.
"""

from ...core.lazy import lazy_names

_EXPORTS = {
    "DecoupledBAPOConfig": "config",
    "DecoupledBAPOTrainer": "trainer",
    "WEIGHT_MODES": "weights",
    "METRICS": "weights",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
