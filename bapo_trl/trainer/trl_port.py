"""``TRLPort``: the rollout sources' :class:`~bapo_trl.rollout.contract.TrainerPort` over a ``GRPOTrainer``: the
trainer's adapter onto TRL for them, the only code between a source and TRL's internals (every private name it uses is
listed in :mod:`bapo_trl.trainer.trl_seams`).

Besides plain accessors it does two things for sources that generate outside TRL's generate call (partial rollout,
async generation): :meth:`TRLPort.score_completions` hands their finished completions to TRL's own scoring (rewards,
advantages, TRL's metrics and its vLLM importance-sampling correction) through TRL's ``rollout_func`` hook, and answers
TRL's old-log-prob forward, which would score the tokens with the CURRENT policy and hide their staleness, with the
stored log-probs of the policy that produced each token (:meth:`TRLPort.take_stored_logps`, asked by the trainer's
log-prob hook first).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch

from ..generation.contract import GenerationBackend, build_backend, sampled_or_error, samples_for_every_source
from ..generation.processes import broadcast_from_main, raised_on_every_process
from ..generation.trl_patches import serving_rollout
from ..rollout.contract import ReadyCompletions, ScoreFn, right_pad
from ..rollout.settings import SourceSettings


class TRLPort:
    """What rollout sources may ask of one ``GRPOTrainer`` process."""

    def __init__(self, trainer):
        self._trainer = trainer  # may be built before GRPOTrainer.__init__ ran: every fact is read when asked
        self._backend: GenerationBackend | None = None  # built at its first use
        self._backend_step = -1  # the step a backend of the user's own was last brought to (-1: none this run)
        self._ready: ReadyCompletions | None = None  # being scored, served by `_rollout`
        self._awaiting_old_logps: ReadyCompletions | None = None  # armed while TRL computes its old-logp forward

    # -- facts --------------------------------------------------------------------------------------------------

    @property
    def args(self):
        """The trainer's config: the port's own (TRL's side); sources read :attr:`settings`."""
        return self._trainer.args

    @property
    def settings(self) -> SourceSettings:
        """What the sources read of the config, as it is now."""
        return SourceSettings.of(self._trainer.args)

    @property
    def num_generations(self) -> int:
        return self._trainer.num_generations

    @property
    def global_step(self) -> int:
        return self._trainer.state.global_step

    @property
    def train_dataset(self):
        return self._trainer.train_dataset

    @property
    def shuffle_dataset(self) -> bool:
        return self._trainer.shuffle_dataset

    @property
    def device(self) -> torch.device:
        return self._trainer.accelerator.device

    @property
    def process_index(self) -> int:
        return self._trainer.accelerator.process_index

    @property
    def num_processes(self) -> int:
        return self._trainer.accelerator.num_processes

    @property
    def is_main_process(self) -> bool:
        return self._trainer.accelerator.is_main_process

    @property
    def pad_token_id(self) -> int:
        return self._trainer._tokenizer.pad_token_id  # TRL's tokenizer (also inside a processor)

    def stop_token_ids(self) -> list[int]:
        """Every token id that ends a generation: TRL's EOS ids (not with vLLM's ``ignore_eos``, under which vLLM
        generates past them) plus generation_kwargs' ``stop_token_ids`` (vLLM) and ``eos_token_id`` (transformers);
        partial rollout and in-flight chunks need them to tell a stopped completion from a capped one."""
        kwargs = self.args.generation_kwargs or {}
        ids = [] if kwargs.get("ignore_eos") and self._trainer.use_vllm else list(self._trainer.eos_token_ids)
        for key in ("stop_token_ids", "eos_token_id"):
            extra = kwargs.get(key)
            ids += [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        return sorted(set(ids))

    # -- TRL's generation -----------------------------------------------------------------------------------------

    def tokenize_prompts(self, prompts: list) -> list[list[int]]:
        prompt_ids, _, _ = self._trainer._tokenize_prompts(prompts)
        return [list(p) for p in prompt_ids]

    def continue_completions(self, prefixes: list[list[int]], max_new_tokens: int):
        """One completion of each prefix (prompt + partial completion), capped at ``max_new_tokens``: TRL's own
        single-turn generation (transformers or vLLM), or the run's own generation backend
        (:attr:`samples_through_backend`). Returns the new tokens and the sampler's log-probs (vLLM, a backend) or
        None."""
        trainer = self._trainer
        if self.samples_through_backend:
            self._weights_current()
            output = self._sample_on_every_process(prefixes, 1, max_new_tokens)
            return [list(ids) for ids in output["completion_ids"]], [list(lp) for lp in output["logps"]]
        if not trainer.use_vllm:
            config = trainer.generation_config
            saved = config.max_new_tokens
            config.max_new_tokens = max_new_tokens
            try:
                return trainer._generate_single_turn(prefixes, None, {}, 1)[0], None
            finally:
                config.max_new_tokens = saved
        count, cap, backend = len(prefixes), max_new_tokens, trainer.vllm_generation
        if self.num_processes > 1 and (backend.mode == "server" or backend.tensor_parallel_size > 1):
            # One vLLM call serves several ranks: the request's max_tokens is rank 0's, and TRL hands each rank an
            # equal slice of the answer. Agree on the largest cap (each rank cuts its answer back to its own) and
            # pad every rank's prefixes to the largest share.
            wanted = torch.tensor([[count, cap]], device=self.device)
            largest_share, max_new_tokens = trainer.accelerator.gather(wanted).max(dim=0).values.tolist()
            prefixes = prefixes + [prefixes[0]] * (largest_share - count)
        saved = backend.max_completion_length  # vLLM's max_tokens for this call
        backend.max_completion_length = max_new_tokens
        try:
            completion_ids, logprobs = trainer._generate_single_turn(prefixes, None, {}, 1)
        finally:
            backend.max_completion_length = saved
        completion_ids = [list(ids[:cap]) for ids in completion_ids[:count]]
        return completion_ids, (None if logprobs is None else [list(lp[:cap]) for lp in logprobs[:count]])

    @property
    def backend(self) -> GenerationBackend:
        """The run's generation backend (``generation_backend``, built at its first use:
        :mod:`bapo_trl.generation.contract`)."""
        if self._backend is None:
            self._backend = build_backend(self.settings.generation_backend, self._trainer)
        return self._backend

    @property
    def samples_through_backend(self) -> bool:
        """Whether every source samples through the generation backend: a backend of the user's own. The built-in
        ``"vllm"`` is TRL's vLLM backend, which TRL's generate call already uses (or transformers without vLLM): the
        synchronous sources keep that call, async generation samples through the contract."""
        return samples_for_every_source(self.settings.generation_backend)

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None) -> dict[str, list]:
        """The generation backend's completions (any thread): ``n`` of every prompt (token ids), at most
        ``max_tokens`` each; ``completion_ids`` (prompt-major) and the sampler's ``logps`` per token
        (:meth:`~bapo_trl.generation.contract.GenerationBackend.sample`), checked (:func:`sampled_or_error`)."""
        return sampled_or_error(self.settings.generation_backend, self.backend.sample(prompts, n, max_tokens, seed),
                                len(prompts), n, max_tokens)

    def sample_rows(self, prompts: list) -> tuple[list[list[int]], dict[str, list]]:
        """One completion per dataset row's prompt from the generation backend, brought to the current policy first
        (every process: the push may be collective): the prompts' token ids and :meth:`sample`'s answer."""
        self._weights_current()
        prompt_ids = self.tokenize_prompts(prompts)
        return prompt_ids, self._sample_on_every_process(prompt_ids, 1, self.max_completion_length)

    def _sample_on_every_process(self, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, list]:
        """:meth:`sample` where every process samples its own prompts (the synchronous sources with a backend of the
        user's own): a failure on one process is raised on every process, naming the backend, the process and its
        error (the others would otherwise enter the next collective, the sampler-gap reduction or a ZeRO-3 gather,
        alone). One collective, every call."""
        with raised_on_every_process(self.num_processes,
                                     f"generation backend {self.settings.generation_backend!r}: sampling"):
            output = self.sample(prompts, n, max_tokens)
        return output

    def _weights_current(self) -> None:
        """The generation backend brought to the current policy where it holds an older one (every process)."""
        if self.weights_step != self.global_step:
            self.push_weights()

    def requests_answered(self) -> int:
        """Requests the generation backend answered so far (any thread): the progress of a batch in flight."""
        return 0 if self._backend is None else self._backend.requests_answered()

    @property
    def max_completion_length(self) -> int:
        return self._trainer.max_completion_length

    def push_weights(self) -> None:
        """The generation backend brought to the current weights (every process: gathering may be collective)."""
        self.backend.push_weights()
        self.mark_weights_current()

    def gather_weights(self):
        """The current weights for a push applied later, from another thread (:meth:`send_weights`); every process
        calls it. ``None`` where only the synchronous :meth:`push_weights` exists."""
        return self.backend.gather_weights()

    def send_weights(self, state) -> None:
        """Main process, any thread: have the generation backend load what :meth:`gather_weights` returned."""
        self.backend.send_weights(state)

    def close_backend(self) -> None:
        """The run is over (the trainer calls it after its rollout source's ``close``): a later ``train()``, which
        restarts at step 0 with this run's weights, pushes first."""
        self._backend_step = -1
        if self._backend is not None:
            self._backend.close()

    @property
    def weights_step(self) -> int | None:
        """The optimizer step whose weights the generation backend holds, -1 before the first push: TRL's record of
        its vLLM pushes for the built-in backend; a record of its own for a backend of the user's own (with
        ``use_vllm`` beside it, TRL's evaluation pushes TRL's vLLM and sets TRL's record, which says nothing of what
        the user's backend holds)."""
        if self.samples_through_backend:
            return self._backend_step
        return getattr(self._trainer, "_last_loaded_step", -1)

    def mark_weights_current(self) -> None:
        """Record that the backend holds the current policy (for the built-in one: so TRL's generation path does not
        push again)."""
        if self.samples_through_backend:
            self._backend_step = self.global_step
        else:
            self._trainer._last_loaded_step = self.global_step

    # -- policy log-probs -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def policy_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     batch_size: int | None = None, inputs: dict[str, Any] | None = None) -> torch.Tensor:
        """Current-policy log-probs of the last ``logits_to_keep`` tokens, outside the loss (no gradient, no
        checkpointing; the trainer's search is armed only inside its loss). ``inputs``: the batch the tokens come
        from; its image inputs (:func:`forward_inputs`) reach the forward as TRL's loss passes them, so a
        vision-language model scores the tokens it generated from the image, not from the text alone."""
        trainer = self._trainer
        with checkpointing_off(trainer.model, getattr(self.args, "activation_checkpointing_kwargs",
                                                      self.args.gradient_checkpointing_kwargs)):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, logits_to_keep,
                batch_size=batch_size or self.args.per_device_train_batch_size, **forward_inputs(inputs),
            )
        return logps

    # -- scoring completions generated elsewhere ------------------------------------------------------------------

    def trl_scores_old_logps(self) -> bool:
        """TRL's own condition for computing ``old_per_token_logps`` with a forward in its scoring."""
        trainer, args = self._trainer, self.args
        generate_every = args.steps_per_generation * trainer.num_iterations
        return args.gradient_accumulation_steps % generate_every != 0 or (
            trainer.use_vllm and trainer.vllm_importance_sampling_correction)

    def score_completions(self, score: ScoreFn, rows: list[dict], ready: ReadyCompletions) -> dict[str, Any]:
        """TRL's ``_generate_and_score_completions`` (``score``) on ``rows`` with ``ready`` as the generation;
        ``old_per_token_logps`` of the result are the behaviour log-probs."""
        trainer = self._trainer
        self._ready = ready
        self._awaiting_old_logps = ready if self.trl_scores_old_logps() else None
        try:
            with serving_rollout(trainer, self._rollout):
                output = score(rows)
            if self._awaiting_old_logps is not None:
                raise RuntimeError("TRL did not compute old_per_token_logps where bapo_trl expected it to: the "
                                   "installed TRL's _generate_and_score_completions changed; please report it.")
        finally:
            self._ready, self._awaiting_old_logps = None, None
        width, device = output["completion_ids"].size(1), output["completion_ids"].device
        output["old_per_token_logps"] = right_pad(ready.behaviour_logps, width, 0.0, torch.float32, device)
        return output

    def _rollout(self, prompts, trainer):
        """TRL's ``rollout_func`` contract, serving the ready completions (no generation)."""
        ready = self._ready
        return {"prompt_ids": ready.prompt_ids, "completion_ids": ready.completion_ids,
                "logprobs": ready.sampling_logps}

    def take_stored_logps(self, width: int, device) -> torch.Tensor | None:
        """The stored behaviour log-probs for TRL's old-logp forward, once (None when not armed)."""
        ready, self._awaiting_old_logps = self._awaiting_old_logps, None
        return None if ready is None else right_pad(ready.behaviour_logps, width, 0.0, torch.float32, device)

    # -- processes and metrics ------------------------------------------------------------------------------------

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.num_processes == 1:
            return tensor
        return self._trainer.accelerator.reduce(tensor, reduction="sum")

    def max_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        """The largest 0-dim ``value`` over all processes."""
        if self.num_processes == 1:
            return value
        return self._trainer.accelerator.gather(value[None]).max()

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's ``obj`` on every process."""
        return broadcast_from_main(obj, self.num_processes)

    def log_metrics(self, values: dict[str, float], mode: str = "train") -> None:
        """Append to TRL's per-step metrics (averaged and logged by TRL's ``log``)."""
        metrics = self._trainer._metrics[mode]
        for name, value in values.items():
            metrics[name].append(value)


@contextlib.contextmanager
def checkpointing_off(model, kwargs: dict | None):
    """Activation (gradient) checkpointing off for a no-grad forward, then back as it was: TRL's
    ``disable_gradient_checkpointing`` with transformers' current names (``is_activation_checkpointing`` and its
    pair; the ``gradient_checkpointing`` names warn of their removal), the old ones where a release lacks them."""
    current = hasattr(type(model), "is_activation_checkpointing") or hasattr(model, "activation_checkpointing_enable")
    was_on = model.is_activation_checkpointing if current else model.is_gradient_checkpointing
    if was_on:
        (model.activation_checkpointing_disable if current else model.gradient_checkpointing_disable)()
    try:
        yield
    finally:
        if was_on:
            (model.activation_checkpointing_enable if current else model.gradient_checkpointing_enable)(kwargs)


#: The parameters of TRL's policy forward (``GRPOTrainer._get_per_token_logps_and_entropies``) that are not a batch's
#: model inputs: every other one is (``pixel_values``, ``image_grid_thw``, ``num_images``, ...).
_FORWARD_CONTROLS = frozenset({"self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                               "compute_entropy", "compute_aux_loss"})


@functools.cache
def multimodal_keys() -> tuple[str, ...]:
    """The batch keys TRL's loss hands its policy forward besides the tokens, read from that forward's signature:
    one list, TRL's own, so a key a TRL release adds reaches every recomputation here without a change
    (``tests/test_images.py`` checks that TRL's loss passes exactly these)."""
    from trl import GRPOTrainer

    parameters = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    return tuple(name for name in parameters if name not in _FORWARD_CONTROLS)


def forward_inputs(inputs: dict[str, Any] | None) -> dict[str, Any]:
    """``inputs``' image inputs for TRL's policy forward (empty for a text batch or none)."""
    if not inputs:
        return {}
    return {key: inputs[key] for key in multimodal_keys() if inputs.get(key) is not None}
