"""``DecoupledBAPOConfig``: ``BAPOConfig`` plus the decoupled correction's weight fields (:mod:`.weights`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.clipping import is_real
from ...trainer.bapo_config import BAPOConfig
from .weights import WEIGHT_MODES


@dataclass
class DecoupledBAPOConfig(BAPOConfig):
    r"""
    Configuration for [`DecoupledBAPOTrainer`] (a research candidate, AReaL's decoupled objective,
    ``docs/off_policy.md``; it did not beat the method in the studies of docs/results.md): when a generation batch
    starts training, one forward pass gives the proximal log-probs ``pi_prox`` (the trainer's policy then); the search
    and TRL's loss act on ``pi_theta / pi_prox``, and each token's loss is multiplied by the truncated weight
    ``pi_prox / pi_behaviour``, which carries staleness and sampler mismatch (it replaces TRL's vLLM
    importance-sampling weight, the mismatch part alone). Logged as ``decoupled/*``.

    Parameters:
        off_policy_weight_mode (`str`, *optional*, defaults to `"token_truncate"`):
            How the decoupled weight is formed, as TRL's ``vllm_importance_sampling_mode`` reads: per token or per
            sequence (the product of its tokens' ratios), truncated to the bounds or set to 0 outside them.
        off_policy_weight_cap (`float`, *optional*, defaults to `3.0`):
            Upper bound of the decoupled weight (TRL's ``vllm_importance_sampling_clip_max`` default), > 0.
        off_policy_weight_floor (`float` or `None`, *optional*, defaults to `None`):
            Lower bound of the decoupled weight, in [0, cap); None: none.
    """

    off_policy_weight_mode: str = field(
        default="token_truncate",
        metadata={"help": "The decoupled weight, as TRL's vllm_importance_sampling_mode: per token or sequence, "
                  "truncated or masked outside the bounds.", "choices": list(WEIGHT_MODES)},
    )
    off_policy_weight_cap: float = field(default=3.0, metadata={"help": "Upper bound of the decoupled weight, > 0."})
    off_policy_weight_floor: float | None = field(
        default=None, metadata={"help": "Lower bound of the decoupled weight, in [0, cap); None: none."})

    def bapo_errors(self) -> list[str]:
        errors = super().bapo_errors()
        if self.off_policy_weight_mode not in WEIGHT_MODES:
            errors.append(f"`off_policy_weight_mode` must be one of {WEIGHT_MODES} (TRL's "
                          f"vllm_importance_sampling_mode values), got {self.off_policy_weight_mode!r}.")
        cap, floor = self.off_policy_weight_cap, self.off_policy_weight_floor
        if not (is_real(cap) and cap > 0):
            errors.append(f"`off_policy_weight_cap` must be a finite number > 0, got {cap!r}.")
        elif floor is not None and not (is_real(floor) and 0 <= floor < cap):
            errors.append(f"`off_policy_weight_floor` must be None or in [0, off_policy_weight_cap = {cap}), got "
                          f"{floor!r}.")
        return errors
