"""bapo_trl: BAPO (Balanced Policy Optimization with Adaptive Clipping) for TRL.

``BAPOConfig`` / ``BAPOTrainer`` subclass TRL's ``GRPOConfig`` / ``GRPOTrainer``; ``search_clip_bounds`` is the
bound search as a pure function. Every name is imported lazily, on first use: the math stays importable without
loading TRL, and a command that needs neither (``bapo plot``, ``bapo --help``) does not load torch.
"""

from . import _compat

__version__ = "0.1.0"

__all__ = ["BAPOConfig", "BAPOSettings", "BAPOTrainer", "SearchResult", "search_clip_bounds", "__version__"]


def __getattr__(name):
    if name in ("BAPOSettings", "SearchResult", "search_clip_bounds"):
        from .core import clipping

        return getattr(clipping, name)
    if name == "BAPOConfig":
        from .trainer.bapo_config import BAPOConfig

        return BAPOConfig
    if name == "BAPOTrainer":
        from .trainer.bapo_trainer import BAPOTrainer

        return BAPOTrainer
    raise AttributeError(f"module 'bapo_trl' has no attribute {name!r}")


_compat.install()  # the 0.1 import paths (bapo_trl.clipping, bapo_trl.config, ...): see _compat.py
