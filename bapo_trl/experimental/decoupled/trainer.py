"""``DecoupledBAPOTrainer``: the decoupled correction on a generation batch as it starts training (the math, and why:
:mod:`.weights`). It overrides one hook of ``BAPOTrainer``, the batch as it starts training.

Once per generation batch, before TRL splits it into the micro-batches of its updates: the batch's behaviour
log-probs (the sampler's, ``sampling_per_token_logps``, where vLLM reported them; else ``old_per_token_logps`` as the
rollout source stored them) are kept as ``behaviour_per_token_logps``; one forward pass of the current policy gives
the proximal log-probs, which become ``old_per_token_logps`` (the ratio BAPO's search and TRL's clip act on); the
truncated weight ``pi_prox / pi_behaviour`` multiplies the advantages token by token (every loss type is linear in
the advantage, and the weight is positive, so this weights each token's loss as TRL's vLLM importance weight would,
for every source, with or without vLLM), and TRL's own vLLM weight becomes 1 (the decoupled weight includes the
mismatch it corrected). A checkpoint saves the batch as it was decoupled, so a resume does not recompute it.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.metrics import token_staleness
from ...core.numerics import loss_mask
from ...trainer.bapo_config import run_name
from ...trainer.bapo_trainer import BAPOTrainer
from .config import DecoupledBAPOConfig
from .weights import behaviour_weights, weight_sums, weight_values

#: The batch key of the behaviour log-probs once the proximal ones took ``old_per_token_logps``.
BEHAVIOUR = "behaviour_per_token_logps"


def decouple(trainer, batch: dict[str, Any]) -> dict[str, Any]:
    """The generation batch with the decoupled correction applied (see the module doc); unchanged when it carries no
    behaviour log-probs (on-policy: TRL skipped them and every ratio is 1). Every process calls it at once (the
    forward pass is collective under ZeRO-3)."""
    behaviour = batch.get("sampling_per_token_logps")
    if behaviour is None:
        behaviour = batch.get("old_per_token_logps")
    if behaviour is None:
        return batch
    args, port = trainer.args, trainer.port
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    proximal = port.policy_logps(ids, attention, batch["completion_ids"].size(1), inputs=batch)  # images too
    mask = loss_mask(batch)
    weights, capped = behaviour_weights(proximal, behaviour, mask, args.off_policy_weight_mode,
                                        args.off_policy_weight_cap, args.off_policy_weight_floor)
    advantages = batch["advantages"]
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    sums = weight_sums(weights, capped, mask, args.off_policy_weight_mode, proximal, behaviour,
                       batch.get("replayed"), token_staleness(batch, port.global_step, proximal))
    port.log_metrics(weight_values(port.sum_over_processes(sums).tolist()))
    out = dict(batch)
    out[BEHAVIOUR] = behaviour
    out["old_per_token_logps"] = proximal
    out["advantages"] = advantages * weights.to(advantages.dtype)
    if out.get("importance_sampling_ratio") is not None:
        out["importance_sampling_ratio"] = torch.ones_like(out["importance_sampling_ratio"])
    return out


class DecoupledBAPOTrainer(BAPOTrainer):
    """BAPO with the decoupled off-policy correction. Takes ``BAPOTrainer``'s arguments with ``args`` a
    :class:`DecoupledBAPOConfig`."""

    _tag_names = ["trl", "grpo", "bapo", "decoupled"]
    _name = "BAPO-decoupled"

    def __init__(self, model, reward_funcs=None, args: DecoupledBAPOConfig | None = None, **kwargs):
        if args is None:
            args = DecoupledBAPOConfig(f"{run_name(model)}-BAPO-decoupled")
        if not isinstance(args, DecoupledBAPOConfig):
            raise TypeError(f"DecoupledBAPOTrainer needs `args` to be a DecoupledBAPOConfig, got "
                            f"{type(args).__name__} (from bapo_trl.experimental.decoupled import "
                            "DecoupledBAPOConfig).")
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def _training_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return decouple(self, batch)  # the proximal policy: this one, as the batch starts training
