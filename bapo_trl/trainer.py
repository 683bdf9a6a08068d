"""``BAPOTrainer``: TRL's ``GRPOTrainer`` whose clipping window is re-chosen by BAPO's search at every loss call.

How it plugs in without copying TRL's loss: TRL's ``_compute_loss`` clips with
``clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)`` and reports ``clip_ratio/*`` against the same two
attributes. Between computing the policy log-probs and clipping it calls nothing we could hook, except the
log-prob function itself. So:

1. ``compute_loss`` arms the search with the micro-batch;
2. the first ``_get_per_token_logps_and_entropies`` call of that loss (the policy forward) runs the search on
   ``exp(logp - old_logp)`` and sets ``epsilon_low = 1 - c_low`` and ``epsilon_high = c_high - 1`` as 0-dim
   tensors (the search itself makes no host sync; the ``bapo/*`` metrics then read their sums back to the host
   once per micro-batch, as TRL's own metrics do);
3. TRL's own loss then applies the chosen window, and its ``clip_ratio/*`` metrics use the chosen bounds.

Every other GRPO feature (loss aggregation, KL, vLLM importance-sampling correction, entropy bonus, PEFT,
DeepSpeed) is TRL's code, untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from trl import GRPOTrainer

from . import metrics
from .checkpoints import CheckpointMixin
from .clipping import SearchResult, search_clip_bounds, search_path
from .config import BAPOConfig
from .generation.cpu_server import CPUServerSyncMixin  # vLLM server mode on CPU (disk weight sync)
from .metrics import age_sums, age_values, origin_sums, origin_values, search_sums, search_values, token_staleness
from .model_card import PAPER_CITATION, ModelCardMixin
from .numerics import loss_mask, mask_nonfinite_inputs, sanitize_after_forward
from .reward_errors import name_errors
from .rollout import (
    AsyncGeneration,
    AsyncPartialRollout,
    CompletionServer,
    PartialRollout,
    ReplayMixer,
    ReplayQueue,
    check_rollout_arguments,
)
from .target_controller import TargetController
from .trl_seams import check_trl_seams

check_trl_seams()  # a TRL that moved a private method we override fails here, loudly, not mid-training

#: Names of the per-step metrics (registered in :mod:`bapo_trl.metrics`), stable for dashboards and the plot command.
BAPO_METRICS = metrics.SEARCH + metrics.ENTROPY_CLIP
#: Logged when the replay queue is on.
REPLAY_METRICS = metrics.REPLAY

class BAPOTrainer(CPUServerSyncMixin, CheckpointMixin, ModelCardMixin, GRPOTrainer):
    """GRPO with BAPO's adaptive clipping window (Xi et al., 2025).

    Mixins (each beside the code it uses): vLLM server mode without CUDA (``generation/cpu_server.py``),
    complete-or-ignored checkpoints with per-rank rollout state (``checkpoints.py``), TRL's model card with a BAPO
    section (``model_card.py``).

    Takes exactly :class:`trl.GRPOTrainer`'s arguments, with ``args`` a :class:`BAPOConfig`. On on-policy
    micro-batches the ratio is exactly 1 and BAPO changes nothing; it acts on stale data
    (``steps_per_generation > gradient_accumulation_steps``, ``num_iterations > 1``, vLLM, replay).
    """

    _tag_names = ["trl", "grpo", "bapo"]
    _name = "BAPO"
    _paper = {"title": "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy "
              "Optimization with Adaptive Clipping", "id": "2510.18927", "citation": PAPER_CITATION}

    def __init__(self, model, reward_funcs=None, args: BAPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config.name_or_path
            args = BAPOConfig(f"{name.split('/')[-1]}-BAPO")
        if not isinstance(args, BAPOConfig):
            raise TypeError(
                f"BAPOTrainer needs `args` to be a BAPOConfig, got {type(args).__name__}. BAPOConfig takes every "
                "GRPOConfig field unchanged: replace `GRPOConfig(...)` by `BAPOConfig(...)` (from bapo_trl import "
                "BAPOConfig); BAPO then adds its search settings with the paper's defaults (positive_contribution_"
                "target=0.5, c_low 0.6..0.9, c_high 1.2..3.0) and ignores `epsilon`/`epsilon_high`.")
        check_rollout_arguments(args, kwargs)  # at construction, before TRL loads anything
        self._bapo_settings = args.bapo_settings
        self._bapo_pending: dict[str, Any] | None = None
        self.last_search: SearchResult | None = None
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # A reward function that raises is named in the error (TRL keeps the callables in this list).
        self.reward_funcs = [
            name_errors(f, n) if callable(f) and not isinstance(f, torch.nn.Module) else f
            for f, n in zip(self.reward_funcs, self.reward_func_names)
        ]
        self.completion_server = CompletionServer(self)  # serves completions generated outside TRL's generate call
        self.partial_rollout = PartialRollout(self) if args.partial_rollout_enabled and not args.async_generation \
            else None
        self.async_generation = None
        if args.async_generation:
            self.async_generation = (AsyncPartialRollout if args.partial_rollout_enabled else AsyncGeneration)(self)
        self.replay = ReplayMixer(self) if args.replay_enabled else None
        self.target_controller: TargetController | None = None
        if args.target_entropy is not None:
            self.target_controller = TargetController(args.target_entropy, args.target_adapt_rate, args.target_min,
                                                      args.target_max, args.positive_contribution_target)

    @property
    def replay_queue(self) -> ReplayQueue | None:
        """The replay source's queue (None without replay)."""
        return None if self.replay is None else self.replay.queue

    # -- data: remember which policy version sampled each completion -------------------------------------------

    def _generate_and_score_completions(self, inputs):
        """Where the batch comes from: partial rollout's finished groups, the async producer's next batch, or TRL's
        generation (short by the groups replay stands in for); then replay mixes in stored groups. Every batch
        carries its policy versions."""
        training = self.model.training
        score = super()._generate_and_score_completions
        saved = 0  # groups of this batch taken from the replay queue instead of being generated
        if self.async_generation is not None and not training:  # evaluation: TRL's generation, producer held
            with self.async_generation.generation_paused():
                return score(inputs)
        if self.partial_rollout is not None and training:
            output = self.partial_rollout.next_batch(inputs, score)
        elif self.async_generation is not None:
            output = self.async_generation.next_batch(inputs, score)
        else:
            saved = self.replay.groups_saved(inputs) if self.replay is not None and training else 0
            output = score(inputs[: len(inputs) - saved * self.num_generations])
            batch = output["completion_ids"].size(0)
            output["policy_version"] = torch.full(
                (batch,), self.state.global_step, dtype=torch.long, device=output["completion_ids"].device
            )
        if self.replay is not None and training:
            output = self.replay.mix(output, appended=saved)
        return output

    @torch.no_grad()
    def _policy_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                      batch_size: int | None = None):
        """Current-policy log-probs of the last ``logits_to_keep`` tokens, outside the loss (no gradient, no
        checkpointing, no search: nothing arms it here)."""
        from trl.models.utils import disable_gradient_checkpointing

        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep,
                batch_size=batch_size or self.args.per_device_train_batch_size,
            )
        return logps

    def _rank_states(self) -> dict[str, Any]:
        """Per-process state saved beside TRL's checkpoint files (:class:`~.checkpoints.CheckpointMixin`)."""
        states = {"replay_queue": self.replay, "partial_rollout": self.partial_rollout,
                  "async_generation": self.async_generation, "target_controller": self.target_controller}
        return {stem: obj for stem, obj in states.items() if obj is not None}

    def _after_state_load(self) -> None:
        if self.target_controller is not None:
            self._set_target(self.target_controller.value)

    def _end_of_training(self) -> None:
        if self.async_generation is not None:  # the producer thread ends with the run
            self.async_generation.close()

    def _set_target(self, rho0: float) -> None:
        """Install a new positive-share target (the closed-loop controller's) for the next searches."""
        self._bapo_settings = dataclasses.replace(self._bapo_settings, positive_contribution_target=rho0)

    # -- loss: arm the search, let TRL compute the loss with the chosen window ----------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Before TRL binds its loss mask: real tokens with non-finite inputs leave the loss (needs no new log-probs).
        self._nonfinite_inputs = mask_nonfinite_inputs(inputs, self.args.mask_nonfinite_tokens)
        self._bapo_pending = inputs
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._bapo_pending = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # TRL scoring completions generated elsewhere (partial rollout, async): their tokens' own policies
        stored = self.completion_server.take_stored_logps(logits_to_keep, input_ids.device)
        if stored is not None:
            return stored, None, None
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        inputs, self._bapo_pending = self._bapo_pending, None  # only the policy forward of a loss call
        if inputs is not None:
            self._adapt_clip_window(logps, inputs, entropies)
        return logps, entropies, aux_loss

    def _adapt_clip_window(self, per_token_logps: torch.Tensor, inputs: dict[str, Any],
                           entropies: torch.Tensor | None = None) -> None:
        """Run the search on this micro-batch (sums reduced over all processes) and install the window."""
        self._nonfinite_inputs = self._nonfinite_inputs + sanitize_after_forward(
            inputs, per_token_logps, self.args.max_log_ratio)
        mask = loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        # TRL skips old log-probs when the data is on-policy: the ratio is then exactly 1.
        log_ratio = per_token_logps.detach() - old if old is not None else torch.zeros_like(per_token_logps)
        ratio = torch.exp(log_ratio)
        advantages = inputs["advantages"]
        weights = inputs.get("importance_sampling_ratio")  # TRL's vLLM IS correction multiplies each token's loss
        if self.args.positive_contribution_is_weighted and weights is not None:
            advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * weights
        result = search_clip_bounds(
            ratio, advantages, mask, config=self._bapo_settings, reduce_fn=self._sum_over_processes
        )
        dtype = per_token_logps.dtype
        self.epsilon_low = (1.0 - result.clip_low).to(dtype)
        self.epsilon_high = (result.clip_high - 1.0).to(dtype)
        self.last_search = result
        self._log_search(result, ratio, advantages, mask, inputs, per_token_logps, entropies)

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor, reduction="sum")

    def _max_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        """The largest 0-dim ``value`` over all processes."""
        if self.accelerator.num_processes == 1:
            return value
        return self.accelerator.gather(value[None]).max()

    # -- metrics ------------------------------------------------------------------------------------------------

    def _log_search(self, result: SearchResult, ratio, advantages, mask, inputs, logps, entropies=None) -> None:
        """The update's metrics (:mod:`bapo_trl.metrics`): local sums, ONE collective (plus one for the maxima),
        values under the registered names; then the closed-loop target, if on, takes its step."""
        mode = "train" if self.model.training else "eval"
        step = self.state.global_step
        staleness = token_staleness(inputs, step, ratio)
        sums, stale_max = search_sums(result, self._search_path, ratio, advantages, mask, logps, entropies,
                                      staleness, self._nonfinite_inputs)
        sums, stale_max = self._sum_over_processes(sums), self._max_over_processes(stale_max)
        values, mean_entropy = search_values(sums.tolist(), result.as_floats(), self._search_path, float(stale_max),
                                             self._bapo_settings.positive_contribution_target)
        if "replayed" in inputs:  # fresh vs replayed tokens
            staleness = (step - inputs["policy_version"]).double()[:, None].expand_as(ratio)
            totals, rep_max = origin_sums(result, ratio, advantages, mask, inputs["replayed"], staleness)
            totals, rep_max = self._sum_over_processes(totals), self._max_over_processes(rep_max)
            values.update(origin_values(totals.tolist(), float(rep_max)))
        if self.async_generation is not None and staleness is not None and mode == "train":  # share by token age
            values.update(age_values(self._sum_over_processes(age_sums(result, ratio, advantages, mask,
                                                                       staleness)).tolist()))
        for name, value in values.items():
            self._metrics[mode][name].append(value)
        if self.target_controller is not None and mode == "train":
            if entropies is None:
                raise RuntimeError("target_entropy needs the policy entropy, but TRL's loss forward returned none.")
            self._set_target(self.target_controller.update(mean_entropy))

    @property
    def _search_path(self):
        return search_path(self._bapo_settings)
