"""Where the recipes keep what they build or convert once (the tiny model, SmolLM2's float32 copy)."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """``$BAPO_TRL_CACHE``, else ``~/.cache/bapo_trl``."""
    return os.environ.get("BAPO_TRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "bapo_trl"))
