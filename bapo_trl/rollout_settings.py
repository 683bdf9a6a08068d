"""Checks of the rollout settings (replay, partial rollout, async generation), one place for the config and the sources.

Core layer: :class:`~bapo_trl.trainer.bapo_config.BAPOConfig` validates its fields with these functions before anything is built,
and the replay queue checks its own arguments with :func:`queue_settings_errors`; neither needs the other, and the
config never imports the rollout package. Each function takes the config (any object with the fields) and returns
messages that name the field, the allowed range and the value given.
"""

from __future__ import annotations

import json

#: How the replay queue picks stored groups.
SAMPLING = ("uniform", "recent", "advantage")

#: Length and stop settings of vLLM / transformers generation that chunked generation (partial rollout's rounds,
#: in-flight updates' chunks) cannot honour: it caps each chunk itself and recognises stops by token ids only (EOS, or
#: with vLLM's ``ignore_eos`` none but ``stop_token_ids``, which it does honour).
CHUNK_CLASHING_KWARGS = frozenset({
    "max_tokens", "min_tokens", "stop", "include_stop_str_in_output",  # vLLM SamplingParams
    "max_new_tokens", "min_new_tokens", "max_length", "min_length", "stop_strings",  # transformers GenerationConfig
})


#: ``generation_kwargs`` keys that change the distribution vLLM samples from (and its processed log-probs) beyond the
#: temperature the trainer also applies.
DISTRIBUTION_CHANGING_KWARGS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "structured_outputs", "logits_processors",
})


def _generation_kwargs(cfg) -> dict:
    kwargs = cfg.generation_kwargs or {}
    if isinstance(kwargs, str):  # from the command line: TrainingArguments parses the JSON only later
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            kwargs = {}  # TRL reports the malformed JSON itself
    return kwargs if isinstance(kwargs, dict) else {}


def sampling_changes(cfg) -> list[str]:
    """The settings under which the sampler's distribution is not the policy's at ``temperature``: truncation
    (top-p, top-k, min-p, structured outputs) or penalties."""
    changed = []
    if cfg.top_p != 1.0:
        changed.append(f"top_p={cfg.top_p}")
    if cfg.top_k not in (0, -1, None):
        changed.append(f"top_k={cfg.top_k}")
    if cfg.min_p not in (0, 0.0, None):
        changed.append(f"min_p={cfg.min_p}")
    if cfg.repetition_penalty != 1.0:
        changed.append(f"repetition_penalty={cfg.repetition_penalty}")
    if getattr(cfg, "vllm_structured_outputs_regex", None):
        changed.append("vllm_structured_outputs_regex")
    changed += [f"generation_kwargs[{key!r}]" for key in sorted(set(_generation_kwargs(cfg))
                                                                & DISTRIBUTION_CHANGING_KWARGS)]
    return changed


def is_whole(value) -> bool:
    """An int that is not a bool (``True`` is an int in Python, and no count here means ``True``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def queue_settings_errors(size, max_staleness, sampling, off_allowed: bool = True) -> list[str]:
    """The replay queue's own settings. ``off_allowed``: a size of 0 means replay off (the config); a queue needs
    >= 1."""
    errors = []
    low = 0 if off_allowed else 1
    if not is_whole(size) or size < low:
        errors.append(f"`replay_buffer_size` must be an integer >= {low}{' (0 = off)' if off_allowed else ''}, "
                      f"got {size!r}.")
    if not is_whole(max_staleness) or max_staleness < 1:
        errors.append(f"`replay_max_staleness` must be an integer >= 1, got {max_staleness!r}.")
    if sampling not in SAMPLING:
        errors.append(f"`replay_sampling` must be one of {SAMPLING}, got {sampling!r}.")
    return errors


def replay_errors(cfg) -> list[str]:
    size, ratio = cfg.replay_buffer_size, cfg.replay_ratio
    errors = queue_settings_errors(size, cfg.replay_max_staleness, cfg.replay_sampling)
    if not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        errors.append(f"`replay_ratio` must be in [0, 1), got {ratio!r}.")
    if errors:
        return errors
    if cfg.replay_saves_generation and (size == 0 or cfg.partial_rollout_budget is not None
                                        or cfg.replay_fill_zero_std_groups):
        errors.append(
            "`replay_saves_generation` needs a replay queue (`replay_buffer_size` >= 1, `replay_ratio` > 0) and "
            "cannot be combined with `partial_rollout_budget` (which makes its own batches) or "
            "`replay_fill_zero_std_groups` (nothing generated is replaced); got "
            f"replay_buffer_size={size}, partial_rollout_budget={cfg.partial_rollout_budget}, "
            f"replay_fill_zero_std_groups={cfg.replay_fill_zero_std_groups}.")
    if size == 0 and (ratio > 0 or cfg.replay_fill_zero_std_groups):
        errors.append(
            "`replay_ratio` > 0 or `replay_fill_zero_std_groups` needs a replay queue: set `replay_buffer_size` "
            f">= 1 (got replay_buffer_size=0, replay_ratio={ratio}, "
            f"replay_fill_zero_std_groups={cfg.replay_fill_zero_std_groups})."
        )
    if size > 0 and ratio == 0 and not cfg.replay_fill_zero_std_groups:
        errors.append(
            f"`replay_buffer_size` is {size} but nothing is ever replayed: set `replay_ratio` in (0, 1) or "
            "`replay_fill_zero_std_groups=True`."
        )
    return errors


def _chunk_clashing_kwargs(cfg) -> list[str]:
    """The ``generation_kwargs`` keys a chunked source cannot honour (see :data:`CHUNK_CLASHING_KWARGS`)."""
    return sorted(set(_generation_kwargs(cfg)) & CHUNK_CLASHING_KWARGS)


def partial_rollout_errors(cfg) -> list[str]:
    budget, resumes = cfg.partial_rollout_budget, cfg.partial_rollout_max_resumes
    if budget is None:
        return []
    errors = []
    if not is_whole(budget) or not 1 <= budget < cfg.max_completion_length:
        errors.append(
            f"`partial_rollout_budget` must be an integer in [1, max_completion_length) = "
            f"[1, {cfg.max_completion_length}), or None to switch partial rollout off; got {budget!r}."
        )
    if not is_whole(resumes) or resumes < 1:
        errors.append(f"`partial_rollout_max_resumes` must be an integer >= 1, got {resumes!r}.")
    # The pool sets each round's length cap and tells a stopped completion from a capped one by its EOS tokens
    # (`stop_token_ids` / `eos_token_id` in generation_kwargs join them); other length or stop settings would
    # override the cap or stop on something it cannot see.
    clashing = _chunk_clashing_kwargs(cfg)
    if clashing:
        errors.append(
            f"`generation_kwargs` keys {clashing} cannot be used with `partial_rollout_budget` (it caps each "
            "round itself and recognises stops by EOS token ids only); use `stop_token_ids` / `eos_token_id`.")
    return errors


def async_errors(cfg) -> list[str]:
    errors = []
    if not is_whole(cfg.max_staleness) or cfg.max_staleness < 1:
        errors.append(f"`max_staleness` must be an integer >= 1 (generation batches ahead), got "
                      f"{cfg.max_staleness!r}.")
    if not is_whole(cfg.weight_sync_steps) or cfg.weight_sync_steps < 1:
        errors.append(f"`weight_sync_steps` must be an integer >= 1 (optimizer steps between weight pushes), got "
                      f"{cfg.weight_sync_steps!r}.")
    chunk = cfg.inflight_update_tokens
    if chunk is not None and (not is_whole(chunk) or chunk < 1):
        errors.append(f"`inflight_update_tokens` must be an integer >= 1 (tokens per chunk), or None for requests "
                      f"under one policy; got {chunk!r}.")
    if not cfg.async_generation:
        return errors
    if chunk is not None and cfg.lazy_weight_loading:
        errors.append("`lazy_weight_loading` cannot be combined with `inflight_update_tokens`: in-flight updates load "
                      "every push between two chunks as soon as it is made, lazy loading defers pushes until a request "
                      "needs them; use one of them.")
    if chunk is not None and cfg.partial_rollout_budget is not None:
        errors.append("`inflight_update_tokens` cannot be combined with `partial_rollout_budget`: partial rollout "
                      "already grows completions round by round under the newest weights; use one of them.")
    if is_whole(chunk) and chunk >= cfg.max_completion_length:
        errors.append(f"`inflight_update_tokens` ({chunk}) must be below `max_completion_length` "
                      f"({cfg.max_completion_length}): one chunk would hold every completion whole, so no push could "
                      "ever land inside a request. Set it in [1, max_completion_length), or None.")
    clashing = _chunk_clashing_kwargs(cfg)
    if chunk is not None and clashing:
        errors.append(
            f"`generation_kwargs` keys {clashing} cannot be used with `inflight_update_tokens` (it caps each chunk "
            "itself and recognises stops by EOS token ids only: a stop string across two chunks would be missed); "
            "use `stop_token_ids` / `eos_token_id`.")
    if not (cfg.use_vllm and cfg.vllm_mode == "server"):
        errors.append("`async_generation` needs a vLLM server to generate in (`use_vllm=True`, "
                      f"`vllm_mode='server'`); got use_vllm={cfg.use_vllm}, vllm_mode={cfg.vllm_mode!r}.")
    changed = sampling_changes(cfg)
    if changed:
        errors.append(
            f"`async_generation` takes each token's behaviour log-prob from the sampler, and {', '.join(changed)} "
            "make(s) the sampler's distribution a truncated or penalised one: every importance ratio would carry that "
            "difference as a systematic bias, which TRL's synchronous path puts into its importance-sampling weight "
            "instead (the trainer-side log-probs of the sampling policy no longer exist under async). Sample with "
            "top_p=1, top_k=0, min_p=0, repetition_penalty=1 and no such generation_kwargs with async generation, or "
            "generate synchronously (async_generation=False).")
    if cfg.partial_rollout_budget is not None and cfg.max_staleness != 1:
        errors.append("`async_generation` with `partial_rollout_budget` runs exactly one round ahead (each round "
                      f"continues the previous one's completions): `max_staleness` must be 1, got "
                      f"{cfg.max_staleness!r}.")
    return errors


#: The built-in sources, each with the settings that turn it on (``rollout_source="auto"`` picks by them).
BUILT_IN_SOURCES = {
    "trl": "async_generation=False, partial_rollout_budget=None",
    "partial": "async_generation=False, partial_rollout_budget set",
    "async": "async_generation=True, partial_rollout_budget=None",
    "async_partial": "async_generation=True, partial_rollout_budget set",
}


def auto_source_name(cfg) -> str:
    """The built-in source the settings turn on (what ``rollout_source="auto"`` builds)."""
    partial = cfg.partial_rollout_enabled
    if cfg.async_generation:
        return "async_partial" if partial else "async"
    return "partial" if partial else "trl"


def rollout_source_errors(cfg) -> list[str]:
    """A built-in source named outright must be the one its settings turn on: every check and bound here (the async
    checks, the staleness bound, the replay ages) reads the settings, so a source the settings do not describe would
    run unchecked."""
    name = cfg.rollout_source
    if not isinstance(name, str) or not name.strip():
        return [f"`rollout_source` must be 'auto' or the name of a registered rollout source, got {name!r}."]
    chosen = auto_source_name(cfg)
    if name in BUILT_IN_SOURCES and name != chosen:
        return [f"`rollout_source` {name!r} is a built-in source, turned on by its settings "
                f"({BUILT_IN_SOURCES[name]}), but these settings (async_generation={cfg.async_generation}, "
                f"partial_rollout_budget={cfg.partial_rollout_budget}) turn on {chosen!r}: set those settings and "
                "leave `rollout_source` at 'auto'."]
    return []


def staleness_bound(cfg) -> int:
    """The most optimizer steps between sampling a token and the last update that trains on it, for the built-in
    sources (what the guarantees matrix checks, ``tests/test_guarantees.py``). With ``u`` updates per generation
    batch (``BAPOConfig.updates_per_generation``):

    * TRL's generation: ``u - 1`` (a batch is trained for ``u`` updates after it is generated);
    * partial rollout: ``(R + 1) u - 1`` with ``R = partial_rollout_max_resumes``: a group is trained at the latest
      ``R`` generation batches after it joined the pool (it is finished by then, and every older group too, so it is
      among the oldest finished groups the batch takes);
    * async generation: ``(K + 1) u + W - 2`` with ``K = max_staleness``, ``W = weight_sync_steps``: batch ``t`` is
      sent at the hand-over of batch ``t - K``, to a server that holds weights at most ``W - 1`` steps older than
      that hand-over; with partial rollout, ``R u`` more (a completion's first round is at most ``R`` batches before
      the batch that trains it);
    * replay: the larger of that and ``replay_max_staleness`` (replayed groups are evicted past it).
    """
    updates = cfg.updates_per_generation
    resumes = cfg.partial_rollout_max_resumes if cfg.partial_rollout_budget is not None else 0
    if cfg.async_generation:
        bound = (cfg.max_staleness + 1) * updates + cfg.weight_sync_steps - 2 + resumes * updates
    else:
        bound = (resumes + 1) * updates - 1
    return max(bound, cfg.replay_max_staleness) if cfg.replay_buffer_size > 0 else bound


def rollout_errors(cfg) -> list[str]:
    """Every problem with the rollout settings of ``cfg``."""
    return replay_errors(cfg) + partial_rollout_errors(cfg) + async_errors(cfg) + rollout_source_errors(cfg)


def sampler_logprobs_use(args) -> str | None:
    """What training does with the server's log-probs of the sampled tokens, for the error; None: nothing (TRL then
    receives them and ignores them), so any ``--logprobs-mode`` will do."""
    if getattr(args, "async_generation", False):
        return "async generation trains with them as the behaviour log-probs"
    source = getattr(args, "rollout_source", "auto")
    if source != "auto" and source not in BUILT_IN_SOURCES:
        return (f"the rollout source {source!r} (`rollout_source`) may train with them as the behaviour log-probs "
                "(TRLPort.server_generate)")
    if getattr(args, "vllm_importance_sampling_correction", False):
        return "TRL's importance-sampling correction (`vllm_importance_sampling_correction`) divides by them"
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        return "TRL's off-policy sequence mask (`off_policy_mask_threshold`) compares them with the policy's"
    return None
