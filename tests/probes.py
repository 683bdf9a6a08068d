"""Test helpers that reach into a trainer's rollout sources (probes around the real objects, not fakes)."""

from bapo_trl.rollout.contract import parts


def source_of(trainer, cls):
    """The part of ``trainer``'s rollout source (the source itself or one it wraps) that is a ``cls``; None if none."""
    return next((p for p in parts(trainer.rollout_source) if isinstance(p, cls)), None)
