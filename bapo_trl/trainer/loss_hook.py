"""What ``BAPOTrainer``'s loss hook does between TRL's policy forward and TRL's clip, as functions of the trainer's
state: the tokens TRL's loss keeps, the ratios and advantages the search balances (the loss type's row,
:mod:`bapo_trl.core.loss_types`), and installing what the search chose where TRL's loss reads it (restored after the
loss call when it is a config field).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from ..core import metrics
from ..core.clipping import SearchPath, SearchResult
from ..core.loss_types import LossType, token_log_ratio
from ..core.numerics import loss_mask


class WindowChoice(NamedTuple):
    """What the search chose for one micro-batch (:meth:`BAPOTrainer._choose_window`): its result and path, the
    bounds TRL's loss gets (through the loss type's row), and the function that turns the micro-batch's record into
    its logged values and entropy."""

    result: SearchResult
    path: SearchPath
    bounds: tuple
    values: Callable[[metrics.SearchRecord], tuple[dict, tuple]] = metrics.update_values


#: The target a micro-batch without old log-probs is searched with (TRL skipped them: the data is exactly on-policy,
#: every ratio 1). No window changes the gradient there, but a gate's scale changes SAPO's loss value (its 4 / tau),
#: so the path's start, the user's own window, is taken: TRL's loss and gradient exactly.
ON_POLICY_TARGET = 1e-12


def search_settings(settings, inputs: dict):
    """The search's settings for one micro-batch: the run's, or with :data:`ON_POLICY_TARGET` where it is exactly
    on-policy."""
    if inputs.get("old_per_token_logps") is None:
        return dataclasses.replace(settings, positive_contribution_target=ON_POLICY_TARGET)
    return settings


def optimised_tokens(trainer, mask: torch.Tensor, logps: torch.Tensor, entropies: torch.Tensor | None,
                     inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss keeps after the clip (its high-entropy and off-policy sequence masks, computed as TRL
    computes them): the search balances the loss that is optimised, not one with tokens TRL then drops."""
    if trainer.top_entropy_quantile < 1.0:
        mask = mask * trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    if trainer.off_policy_mask_threshold is not None:
        behaviour = inputs.get("old_per_token_logps", logps.detach())
        advantages = inputs["advantages"]
        mask = mask * trainer.get_off_policy_mask(
            advantages[:, None] if advantages.dim() == 1 else advantages, logps,
            inputs.get("sampling_per_token_logps", behaviour), mask, trainer.off_policy_mask_threshold)
    return mask


def search_inputs(loss: LossType, logps: torch.Tensor, inputs: dict, level: str,
                  is_weighted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, advantages)`` the search balances for one micro-batch: the ratios TRL's loss clips (``(B, T)``) and
    the advantages times each token's weight in TRL's loss (aggregation, and TRL's vLLM importance-sampling weights
    when ``is_weighted`` and the loss multiplies by them)."""
    mask = loss_mask(inputs)
    log_ratio = token_log_ratio(logps, inputs)
    ratio, advantages = loss.ratios(log_ratio, mask, level, inputs), inputs["advantages"]
    weights = inputs.get("importance_sampling_ratio")  # TRL's vLLM IS correction multiplies each token's loss
    if is_weighted and weights is not None and loss.uses_is_weights and not loss.is_weight_in_ratio:
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * weights
    token_weight = loss.aggregation(mask)
    if token_weight is not None:
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * token_weight
    return ratio, advantages


def install(trainer, values: dict, dtype: torch.dtype, saved: dict | None = None) -> dict:
    """Set what :attr:`LossType.to_trl` returned on the trainer (``"args.<field>"`` on its config); the config fields'
    values from before the loss call are kept in ``saved`` (returned), for :func:`restore` once the call is over."""
    saved = {} if saved is None else saved
    for name, value in values.items():
        target = trainer
        if name.startswith("args."):
            target, name = trainer.args, name[len("args."):]
            saved.setdefault(name, getattr(target, name))
        setattr(target, name, value.to(dtype))
    return saved


def restore(args, saved: dict) -> None:
    """Put back the config fields :func:`install` changed (they are the gate's START for the next search, and the
    config is saved with checkpoints)."""
    for name, value in saved.items():
        setattr(args, name, value)


def log_search(trainer, choice: WindowChoice, ratio, advantages, mask, inputs, logps, entropies=None) -> None:
    """The micro-batch's metrics (``choice.values``: :func:`bapo_trl.core.metrics.update_values` for the method);
    its entropy joins the closed-loop target's update, if on."""
    mode = "train" if trainer.model.training else "eval"
    values, entropy = choice.values(metrics.SearchRecord(
        result=choice.result, path=choice.path, loss=trainer.loss, ratio=ratio, advantages=advantages, mask=mask,
        inputs=inputs, logps=logps, entropies=entropies, step=trainer.state.global_step,
        nonfinite_inputs=trainer._nonfinite_inputs, target=trainer._bapo_settings.positive_contribution_target,
        sum_over_processes=trainer.port.sum_over_processes, max_over_processes=trainer.port.max_over_processes,
        by_age=trainer.rollout_source.metrics_by_age and mode == "train"))
    trainer.port.log_metrics(values, mode)
    if trainer.target_controller is not None and mode == "train":
        if entropies is None:
            raise RuntimeError("target_entropy needs the policy entropy, but TRL's loss forward returned none.")
        trainer.target_controller.observe(*entropy)  # the target moves once the update is over
