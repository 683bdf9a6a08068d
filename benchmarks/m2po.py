"""M2PO (Zheng et al., "Prosperity before Collapse", arXiv 2510.01161) as a rival for the evidence study: a reference
baseline written from the paper's definition, not a bapo_trl feature.

M2PO replaces the clip with a batch-level trust region on the second moment of the log importance ratio: the tokens
with the largest ``(log pi_theta - log pi_behaviour)^2`` are masked out, largest first, until the mean of that
quantity over the tokens left is at most ``tau`` (the paper's default 0.04); the rest are trained on the unclipped
ratio, the loss normalised by all the batch's tokens (TRL's ``dapo`` aggregation). Here the mask is TRL's
off-policy mask hook (``get_off_policy_mask``, which TRL multiplies into the per-token loss), so TRL's loss is
otherwise untouched; the clip is switched off by a window that never binds (``epsilon=1.0``, ``epsilon_high=1e5``).

Choices where the sources leave room (AReaL's implementation differs on each): ``pi_theta`` is the policy being
trained (AReaL uses the policy at the start of the update); the budget is met when the mean is ``<= tau``; when
even the smallest token alone exceeds ``tau``, every token is masked (no update from that micro-batch; AReaL keeps
one). The mask is per micro-batch and per process (one process here).

Checked on the reversal task (lr 1e-3, seeds 100-101): on-policy its runs equal dapo's step for step (the ratios are
1, nothing is masked, the clip never binds); at staleness 8 it learns like dapo clip-higher (final reward 0.92/0.77
vs 0.81/0.84, ~2.5% of tokens masked). At staleness 32 it collapses within the first generation batch (reward 0.3
-> 0.0; up to 90% of the tokens masked by step 24), and so it does with tau 0.01 and 0.002 (seed 100), while
without the mask the unclipped loss collapses with gradient norms up to 210: most tokens of this task are
near-certain (log-ratio ~0), so a batch mean under tau leaves room for a few tokens whose ratio runs far.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

#: The paper's budget on the mean squared log-ratio of the tokens kept.
TAU = 0.04
#: GRPOConfig fields of M2PO's loss: dapo aggregation, a clip window that never binds.
SETTINGS = dict(loss_type="dapo", epsilon=1.0, epsilon_high=1e5)
#: The same unclipped loss for BAPOTrainer (a one-point search path: the window is fixed), for the scenarios only
#: BAPOTrainer runs (replay, partial rollout, async generation).
BAPO_SETTINGS = dict(loss_type="dapo", ratio_lower_start=1e-6, ratio_lower_max=1e-6, ratio_upper_start=1e5,
                     ratio_upper_max=1e5, dual_clip=False)


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float = TAU) -> torch.Tensor:
    """``(B, T)`` float mask: 1 for the tokens M2PO keeps among ``mask``'s, 0 elsewhere (padding stays 0).

    Sorted by squared log-ratio, largest first, the first ``k`` are dropped, ``k`` the smallest count for which the
    mean of the others is ``<= tau`` (all of them when none is). Non-finite log-ratios count as 0 (no evidence)."""
    valid = mask.bool()
    m2 = torch.nan_to_num(log_ratio.detach().float(), nan=0.0, posinf=0.0, neginf=0.0).square()
    values = m2[valid]
    keep = torch.zeros_like(m2)
    n = values.numel()
    if n == 0:
        return keep.to(mask.dtype)
    ordered, order = torch.sort(values, descending=True)
    # mean of ordered[k:] for k = 0..n-1 (suffix sums over suffix counts)
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=ordered.dtype, device=m2.device)
    within = torch.nonzero(suffix_mean <= tau)
    dropped = int(within[0]) if len(within) else n
    kept = torch.ones(n, dtype=m2.dtype, device=m2.device)
    kept[order[:dropped]] = 0.0
    keep[valid] = kept
    return keep.to(mask.dtype)


class M2POMixin:
    """TRL's loss with M2PO's token mask. ``m2po_tau``: the budget. The mask takes the place of TRL's off-policy
    sequence mask (TRL applies it when ``off_policy_mask_threshold`` is set; here it carries ``tau``)."""

    def __init__(self, *args, m2po_tau: float = TAU, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.off_policy_mask_threshold is not None:
            raise ValueError("M2PO uses TRL's off-policy mask hook: leave `off_policy_mask_threshold` unset.")
        self.off_policy_mask_threshold = m2po_tau  # TRL reads the trainer's copy, not the config's

    def get_off_policy_mask(self, advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        keep = m2po_mask(per_token_logps - sampling_per_token_logps, mask, off_policy_threshold)
        if self.model.training:
            self._metrics["train"]["m2po/masked_fraction"].append(
                float(1 - keep.sum() / mask.sum().clamp(min=1)))
        return keep


class M2POTrainer(M2POMixin, GRPOTrainer):
    """M2PO on TRL's own GRPOTrainer (use with :data:`SETTINGS`)."""


def bapo_trainer_class():
    """M2PO on BAPOTrainer (with :data:`BAPO_SETTINGS`), for the rollout features only BAPOTrainer has."""
    from bapo_trl import BAPOTrainer

    return type("M2POBAPOTrainer", (M2POMixin, BAPOTrainer), {"__doc__": "M2PO on BAPOTrainer's rollouts."})
