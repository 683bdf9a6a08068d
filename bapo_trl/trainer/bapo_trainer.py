"""``BAPOTrainer``: TRL's ``GRPOTrainer`` whose clipping window is re-chosen by BAPO's search at every loss call.

Two overrides carry the method; everything else is TRL's code or lives in its own module:

* **the dispatcher** (``_generate_and_score_completions``): every batch comes from the run's rollout source
  (:mod:`bapo_trl.rollout`), built from the config over a narrow port; the trainer knows nothing of how it works;
* **the loss hook**: TRL's ``_compute_loss`` clips with ``clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)``
  and calls nothing we could hook between the policy forward and the clip, except the log-prob function itself. So
  ``compute_loss`` arms the search with the micro-batch, the first ``_get_per_token_logps_and_entropies`` of that
  loss (the policy forward) runs the search on ``exp(logp - old_logp)`` and installs the window through the loss
  type's row (:mod:`bapo_trl.core.loss_types`), and TRL's own loss and ``clip_ratio/*`` metrics use it (no host sync in
  the search; the ``bapo/*`` metrics read their sums back once per micro-batch, as TRL's own metrics do).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from trl import GRPOTrainer

from ..core.clipping import SearchResult, search_clip_bounds
from ..core.numerics import loss_mask, mask_nonfinite_inputs, sanitize_after_forward
from ..core.target_controller import TargetController
from ..rollout.contract import parts, stamp_policy_version
from ..rollout.registry import build_source, check_source_arguments
from .bapo_config import BAPOConfig, trainer_config
from .checkpoints import CheckpointMixin
from .deepspeed_env import quiet_deepspeed_on_cpu
from .input_checks import check_prompt_column
from .loop_hooks import AtEachUpdate, EvaluationKeepsTrainingRandomState
from .loss_hook import LossHookMixin, WindowChoice, restore, search_inputs, search_settings
from .model_card import PAPER, ModelCardMixin
from .reward_errors import RewardTally, name_errors
from .trl_port import TRLPort
from .trl_seams import check_trl_seams
from .vllm_backend import VLLMGenerationMixin  # TRL builds bapo_trl's vLLM backend (any device, LoRA, seeds)

check_trl_seams()  # a TRL that moved a private method we override fails here, loudly, not mid-training


class BAPOTrainer(VLLMGenerationMixin, CheckpointMixin, ModelCardMixin, EvaluationKeepsTrainingRandomState,
                  LossHookMixin, GRPOTrainer):
    """GRPO with BAPO's adaptive clipping window (Xi et al., 2025).

    Mixins, each beside the code it uses: TRL's vLLM backend swapped for bapo_trl's (``vllm_backend.py``), checkpoints
    (``checkpoints.py``), TRL's model card with a BAPO section (``model_card.py``), evaluation that leaves training's
    random state as it found it (``loop_hooks.py``), the loss hook's steps on the trainer itself (``loss_hook.py``).

    Takes exactly :class:`trl.GRPOTrainer`'s arguments, with ``args`` a :class:`BAPOConfig`. On on-policy
    micro-batches the ratio is exactly 1 and BAPO changes nothing (:meth:`_on_policy`); it acts on stale data
    (``steps_per_generation > gradient_accumulation_steps``, ``num_iterations > 1``, replay, partial rollout, async
    generation) and on a sampler's own behaviour log-probs (a generation backend of the user's own).
    """

    _tag_names = ["trl", "grpo", "bapo"]
    _name = "BAPO"
    _paper = PAPER

    def __init__(self, model, reward_funcs=None, args: BAPOConfig | None = None, **kwargs):
        quiet_deepspeed_on_cpu(torch)  # before TRL's trainer imports DeepSpeed
        args = trainer_config(args, model)
        check_source_arguments(args, kwargs)  # at construction, before TRL loads anything
        for name in ("train_dataset", "eval_dataset"):
            check_prompt_column(kwargs.get(name), f"`{name}`")
        self._bapo_pending: dict[str, Any] | None = None
        self.port = TRLPort(self)  # the rollout sources' only way into TRL (its log-prob answers are needed below)
        self.loss = args.loss_row.bind(args)  # the row of the config's loss (type), with the run's gate shapes
        self.last_search: SearchResult | None = None
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # A reward function that raises is named in the error (TRL keeps the callables in this list).
        self.reward_funcs = [name_errors(f, n) if callable(f) and not isinstance(f, torch.nn.Module) else f
                             for f, n in zip(self.reward_funcs, self.reward_func_names)]
        self._base_settings = args.bapo_settings
        self._runs = 0
        self._new_run_state()
        self.add_callback(AtEachUpdate(self._end_of_update))

    def _new_run_state(self) -> None:
        """What one ``train()`` call owns: the rollout source, the closed-loop target and the count of batches without
        a reward (:class:`~.reward_errors.RewardTally`). The first run uses the constructed ones (and anything attached
        to them); every later ``train()`` on this object, resumed or not, starts from new ones, as a new trainer
        would."""
        args = self.args
        self.rollout_source = build_source(self.port, args)
        self.reward_tally = RewardTally(self.reward_func_names)
        self.target_controller = None if args.target_entropy is None else TargetController(
            args.target_entropy, args.target_adapt_rate, args.target_min, args.target_max,
            args.positive_contribution_target)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's training run. ``resume_from_checkpoint=True`` (or ``"latest"``) resumes from the newest COMPLETE
        checkpoint. Every call starts from a fresh run state, so a second call, or a resume on the same object,
        behaves as on a new trainer; whatever the run started (background generation, the generation backend, weight
        pushes) ends with it, also on an error."""
        resume = self._checkpoint_to_resume(resume_from_checkpoint)
        self._runs += 1
        if self._runs > 1:
            self._new_run_state()
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._end_of_training()

    @property
    def _bapo_settings(self):
        """The search settings, with the closed-loop target's rho0 when it is on."""
        if self.target_controller is None:
            return self._base_settings
        return dataclasses.replace(self._base_settings, positive_contribution_target=self.target_controller.value)

    # -- data: every batch from the rollout source, stamped with the policy versions that sampled it -----------

    def _generate_and_score_completions(self, inputs):
        score = super()._generate_and_score_completions
        if self.model.training:
            batch = self.rollout_source.next_batch(inputs, self.reward_tally.counting(score, self))
            return self._training_batch(batch)
        with self.rollout_source.paused():  # evaluation: TRL's own generation, background generation held
            return stamp_policy_version(score(inputs), self.state.global_step)

    def _training_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Hook: a generation batch as it starts training (every process calls it at once), before TRL splits it into
        micro-batches. A research candidate that re-weights batches overrides only this (:mod:`bapo_trl.experimental`);
        the method trains the batch as its source gave it."""
        return batch

    def _rank_states(self) -> dict[str, Any]:
        """Per-process state saved beside TRL's checkpoint files (:class:`~.checkpoints.CheckpointMixin`)."""
        states = {p.state_name: p for p in parts(self.rollout_source) if p.state_name is not None}
        if self.target_controller is not None:
            states["target_controller"] = self.target_controller
        return states

    def _end_of_training(self) -> None:
        try:
            self.rollout_source.close()  # background generation ends with the run
        finally:
            self.port.close_backend()
            self._close_weight_pushes()  # no adapter of this run left registered on a server

    # -- loss: arm the search, let TRL compute the loss with the chosen window ----------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)  # TRL trains its buffered batch num_iterations times: edit a copy, never the buffer
        # Before TRL binds its loss mask: real tokens with non-finite inputs leave the loss (needs no new log-probs).
        self._nonfinite_inputs = mask_nonfinite_inputs(inputs, self.args.mask_nonfinite_tokens)
        self._bapo_pending, self._bapo_installed = inputs, {}
        if self.args.effective_delta != self.args.delta:  # the dual clip: TRL's `delta` for this call only
            self._bapo_installed["delta"], self.args.delta = self.args.delta, self.args.effective_delta
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._bapo_pending = None
            restore(self.args, self._bapo_installed)  # a gate's config fields: its start for the next search

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        stored = self.port.take_stored_logps(logits_to_keep, input_ids.device)  # completions generated elsewhere
        if stored is not None:
            return stored, None, None
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        inputs, self._bapo_pending = self._bapo_pending, None  # only the policy forward of a loss call
        if inputs is not None:
            self._adapt_clip_window(logps, inputs, entropies)
        return logps, entropies, aux_loss

    def _adapt_clip_window(self, per_token_logps: torch.Tensor, inputs: dict[str, Any],
                           entropies: torch.Tensor | None = None) -> None:
        """Run the search on this micro-batch (sums reduced over all processes) and install what it chose."""
        self._nonfinite_inputs = self._nonfinite_inputs + sanitize_after_forward(
            inputs, per_token_logps, self.args.max_log_ratio)
        mask = self._optimised_tokens(loss_mask(inputs), per_token_logps, entropies, inputs)
        ratio, advantages = search_inputs(self.loss, per_token_logps, inputs, self.args.importance_sampling_level,
                                          self.args.positive_contribution_is_weighted)
        choice = self._choose_window(per_token_logps, inputs, mask, ratio, advantages)
        self._install_window(self.loss.to_trl(*choice.bounds), per_token_logps.dtype, self._bapo_installed)
        self.last_search = choice.result
        self._log_search(choice, ratio, advantages, mask, inputs, per_token_logps, entropies)

    def _choose_window(self, logps: torch.Tensor, inputs: dict[str, Any], mask: torch.Tensor, ratio: torch.Tensor,
                       advantages: torch.Tensor) -> WindowChoice:
        """Hook: the window one micro-batch gets, with what its metrics need. The method: BAPO's search over the loss
        type's path, its sums reduced over all processes. A research candidate with another window overrides only
        this (:mod:`bapo_trl.experimental`)."""
        settings = search_settings(self._bapo_settings, self._on_policy(inputs))
        path = self.loss.path(settings)
        result = search_clip_bounds(ratio, advantages, mask, config=settings, path=path,
                                    reduce_fn=self.port.sum_over_processes, sums_fn=self.loss.grid_sums)
        return WindowChoice(result, path, (result.clip_low, result.clip_high))

    def _end_of_update(self) -> None:
        if self.target_controller is not None:
            self.target_controller.step()
