"""What ``BAPOTrainer``'s loss hook does between TRL's policy forward and TRL's clip: the ratios and advantages the
search balances (the loss type's row, :mod:`bapo_trl.core.loss_types`), as pure functions of what they take; and, as
methods of the trainer (:class:`LossHookMixin`), the tokens TRL's loss keeps, installing what the search chose where
TRL's loss reads it (restored after the loss call when it is a config field), and the micro-batch's metrics.
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


#: The target an exactly on-policy micro-batch is searched with (every ratio 1: :meth:`LossHookMixin._on_policy`).
#: No clip window changes the gradient there, but a gate's shape does (VESPO's weight where TRL folds its vLLM
#: importance-sampling weights into it) and so does SAPO's loss value (its 4 / tau): the path's start, the user's own
#: window, is taken, which is TRL's loss and gradient exactly.
ON_POLICY_TARGET = 1e-12


def search_settings(settings, on_policy: bool):
    """The search's settings for one micro-batch: the run's, or with :data:`ON_POLICY_TARGET` where it is exactly
    on-policy."""
    if on_policy:
        return dataclasses.replace(settings, positive_contribution_target=ON_POLICY_TARGET)
    return settings


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


def restore(args, saved: dict) -> None:
    """Put back the config fields :meth:`LossHookMixin._install_window` changed (they are the gate's START for the
    next search, and the config is saved with checkpoints)."""
    for name, value in saved.items():
        setattr(args, name, value)


class LossHookMixin:
    """``BAPOTrainer``'s loss-hook steps that act on the trainer itself (TRL's masks, where TRL's loss reads the
    window, the trainer's metrics)."""

    def _optimised_tokens(self, mask: torch.Tensor, logps: torch.Tensor, entropies: torch.Tensor | None,
                          inputs: dict) -> torch.Tensor:
        """The tokens TRL's loss keeps after the clip (its high-entropy and off-policy sequence masks, computed as TRL
        computes them, each from the loss mask: the off-policy mask's sequence divergence is over every loss token,
        not only the high-entropy ones): the search balances the loss that is optimised, not one with tokens TRL then
        drops."""
        kept = mask
        if self.top_entropy_quantile < 1.0:
            kept = kept * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            behaviour = inputs.get("old_per_token_logps", logps.detach())
            advantages = inputs["advantages"]
            kept = kept * self.get_off_policy_mask(
                advantages[:, None] if advantages.dim() == 1 else advantages, logps,
                inputs.get("sampling_per_token_logps", behaviour), mask, self.off_policy_mask_threshold)
        return kept

    def _on_policy(self, inputs: dict) -> bool:
        """Whether the micro-batch is exactly on-policy, every ratio 1 by construction: TRL skipped its old log-probs,
        or they are the trainer's own (TRL's old-logp forward, which it runs with its vLLM importance-sampling
        correction and on the first pass of num_iterations > 1 or steps_per_generation > gradient_accumulation_steps;
        or a source's scoring with the trainer's policy) for tokens all of the current policy's version. Not where the
        behaviour log-probs are a sampler's own (:attr:`~bapo_trl.rollout.contract.RolloutSource.
        behaviour_from_sampler`): their ratios carry the sampler's gap. One verdict for all processes (the window is
        one for all; a collective)."""
        if inputs.get("old_per_token_logps") is None:  # TRL's own on-policy path: the same on every process
            return True
        # evaluation: TRL's own; a source of the user's written before the attribute existed: the search acts, as it
        # did then
        from_sampler = self.model.training and getattr(self.rollout_source, "behaviour_from_sampler", True)
        versions = inputs.get("policy_version")  # each row's oldest token's version (every batch is stamped)
        stale = from_sampler or versions is None or bool((versions != self.state.global_step).any())
        device = inputs["advantages"].device
        return not bool(self.port.max_over_processes(torch.tensor(float(stale), device=device)))

    def _install_window(self, values: dict, dtype: torch.dtype, saved: dict) -> None:
        """Set what :attr:`LossType.to_trl` returned on the trainer (``"args.<field>"`` on its config); the config
        fields' values from before the loss call are kept in ``saved``, for :func:`restore` once the call is over."""
        for name, value in values.items():
            target = self
            if name.startswith("args."):
                target, name = self.args, name[len("args."):]
                saved.setdefault(name, getattr(target, name))
            setattr(target, name, value.to(dtype))

    def _log_search(self, choice: WindowChoice, ratio, advantages, mask, inputs, logps, entropies=None) -> None:
        """The micro-batch's metrics (``choice.values``: :func:`bapo_trl.core.metrics.update_values` for the method);
        its entropy joins the closed-loop target's update, if on."""
        mode = "train" if self.model.training else "eval"
        values, entropy = choice.values(metrics.SearchRecord(
            result=choice.result, path=choice.path, loss=self.loss, ratio=ratio, advantages=advantages, mask=mask,
            inputs=inputs, logps=logps, entropies=entropies, step=self.state.global_step,
            nonfinite_inputs=self._nonfinite_inputs, target=self._bapo_settings.positive_contribution_target,
            sum_over_processes=self.port.sum_over_processes, max_over_processes=self.port.max_over_processes,
            by_age=self.rollout_source.metrics_by_age and mode == "train"))
        self.port.log_metrics(values, mode)
        if self.target_controller is not None and mode == "train":
            if entropies is None:
                raise RuntimeError("target_entropy needs the policy entropy, but TRL's loss forward returned none.")
            self.target_controller.observe(*entropy)  # the target moves once the update is over
