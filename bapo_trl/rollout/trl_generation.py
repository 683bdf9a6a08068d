"""TRL's own generation as a rollout source (the default): every completion is sampled by the current policy."""

from __future__ import annotations

from typing import Any

from .contract import NothingInBackground, ScoreFn, TrainerPort, stamp_policy_version


class TRLGeneration(NothingInBackground):
    """``GRPOTrainer``'s generation and scoring, unchanged; the batch is stamped with the current policy version."""

    def __init__(self, port: TrainerPort):
        self.port = port

    def next_batch(self, inputs: list[dict], score: ScoreFn) -> dict[str, Any]:
        return stamp_policy_version(score(inputs), self.port.global_step)
