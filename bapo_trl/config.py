"""``bapo_trl.config.BAPOConfig``: the path under which runs saved before the package's layers became folders pickled
their ``training_args.bin``. Unpickling imports it, so it stays, for good: those runs resume
(``tests/test_legacy_checkpoints.py``). New code imports ``from bapo_trl import BAPOConfig``."""

from .trainer.bapo_config import BAPOConfig

__all__ = ["BAPOConfig"]
