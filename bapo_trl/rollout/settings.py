"""The rollout settings (replay, partial rollout, async generation, the source), declared, documented and checked in
one place: :class:`RolloutSettings`, a dataclass that :class:`~bapo_trl.trainer.bapo_config.BAPOConfig` inherits.

Each check takes the config (any object with the fields) and returns messages that name the field, the allowed range
and the value given; the replay queue checks its own arguments with :func:`queue_settings_errors`. This module imports
no rollout source, so the config can use it without loading one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..generation.contract import registered_backends, samples_for_every_source

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


#: ``generation_kwargs`` keys whose effect depends on the tokens generated so far in the same request (vLLM applies
#: them to the request's own output): partial rollout's rounds, each a new request continuing the completion as its
#: prompt, would restart them at every round, where TRL samples each completion in one request.
HISTORY_DEPENDENT_KWARGS = frozenset({
    "presence_penalty", "frequency_penalty", "structured_outputs", "bad_words", "logits_processors",
})


def field_default(config, name: str):
    """The declared default of dataclass field ``name`` of ``config`` (an instance or a class): what the
    inert-setting rows compare a setting with, so changing a default never silently breaks its row."""
    return config.__dataclass_fields__[name].default


def changed(config, name: str) -> bool:
    """Whether field ``name`` is set away from its default (``True == 1``: the types are compared too)."""
    value, default = getattr(config, name), field_default(config, name)
    return value != default or type(value) is not type(default)


class OnPolicyWarning(UserWarning):
    """The config's warning that the data is exactly on-policy (:attr:`RolloutSettings.exactly_on_policy`): its own
    category, so ``bapo train``, whose plan says the same, filters it by kind rather than by its text."""


@dataclass
class RolloutSettings:
    r"""
    Where training batches come from: the rollout fields of [`~bapo_trl.BAPOConfig`], which inherits them.

    Checked with the config (:func:`rollout_errors` before anything is built, :meth:`inert_rollout_settings` for
    settings that could never act); both read GRPOConfig's fields too, so they run on the whole config.

    The parameters come in four groups: stale-sample replay (the paper's "sample replay" off-policy setting, from
    ``replay_buffer_size`` to ``replay_saves_generation``), partial rollout (the paper's other off-policy scenario),
    async generation (generation overlaps training) and where batches come from (``rollout_source``).

    Parameters:
        replay_buffer_size (`int`, *optional*, defaults to `0`):
            Number of generation groups the replay queue holds on each process (0 = no replay). Each process keeps
            a queue of its own groups.
        replay_ratio (`float`, *optional*, defaults to `0.0`):
            Fraction of each generation batch's groups replaced by groups from the queue, in [0, 1).
        replay_max_staleness (`int`, *optional*, defaults to `16`):
            A stored group older than this many optimizer steps is evicted and never trained on (>= 1).
        replay_sampling (`str`, *optional*, defaults to `"uniform"`):
            `"uniform"`, `"recent"` (newest groups first) or `"advantage"` (probability proportional to the
            group's advantage range, so informative groups are replayed more).
        replay_fill_zero_std_groups (`bool`, *optional*, defaults to `False`):
            Replace fresh groups whose rewards have no spread (no learning signal) by replayed groups first, and
            replace all of them even beyond `replay_ratio` when the queue has enough groups.

        replay_saves_generation (`bool`, *optional*, defaults to `False`):
            Generate only ``1 - replay_ratio`` of each generation batch's groups and add the replayed ones, so the
            generated tokens per optimizer step drop by the replay share. While any process's queue holds fewer
            replayable groups than one batch replays, the batch is generated in full (and replay replaces as usual).
            Logged: ``replay/generation_saved`` (share of the batch not generated).

        partial_rollout_budget (`int` or `None`, *optional*, defaults to `None`):
            Tokens a completion may grow per round (off when `None`); one round per generation batch, so every
            `steps_per_generation` x `num_iterations` / `gradient_accumulation_steps` optimizer steps. Unfinished
            completions are kept with the log-probs of the policy that produced each token and continued in later
            rounds; a group is scored and trained once all its completions are finished. Works with transformers
            generation and vLLM. `generation_kwargs` may add stop token ids, but not length or string-stop settings.
        partial_rollout_max_resumes (`int`, *optional*, defaults to `4`):
            A completion carried over this many rounds is generated to the end at its next round (>= 1).

        async_generation (`bool`, *optional*, defaults to `False`):
            With ``use_vllm=True, vllm_mode="server"``: a producer thread on the main process has the server generate
            the next generation batches while all processes train on the current one. Weights are pushed at the start
            of each generation batch, between two requests (a request in flight finishes on the old weights); the
            behaviour log-probs are the server's (the sampling policy's). Logged: ``async/*``. With
            ``partial_rollout_budget`` each round grows the unfinished completions while the trainer trains
            (``max_staleness`` must then be 1).
        max_staleness (`int`, *optional*, defaults to `1`):
            K: how many generation batches the producer may run ahead of the batch being trained (>= 1). A batch is
            generated by a policy at most K weight pushes old.
        weight_sync_steps (`int`, *optional*, defaults to `1`):
            Async generation: push the weights to the server at most every this many optimizer steps (>= 1). Larger
            values save pushes (each gathers the full model) and make the data staler by up to that many steps.
        inflight_update_tokens (`int` or `None`, *optional*, defaults to `None`):
            Async generation: in-flight weight updates. Each request is generated in chunks of this many tokens, and
            a push made meanwhile reaches the completions between two chunks (each token keeps the version and the
            sampler's log-prob of the weights that produced it; a chunk re-reads its completion's prefix under the
            new weights). `None`: a request runs under one policy. Not with `partial_rollout_budget`.
        lazy_weight_loading (`bool`, *optional*, defaults to `False`):
            Async generation through the disk reload (no CUDA): the server loads a weight push only when the next
            request needs it for the staleness bound (a batch queued at the hand-over of batch t must be generated by
            the weights pushed then, or newer), not before every request. With ``max_staleness`` K >= 2 the producer
            then reloads once every few requests instead of before each one, so it can get ahead of the trainer, and
            the data is closer to K batches stale (the bound is unchanged). With K = 1 every request needs the newest
            push (no effect); TRL's NCCL push on CUDA loads at once (no effect). Not with ``inflight_update_tokens``.

        rollout_source (`str`, *optional*, defaults to `"auto"`):
            `"auto"`: TRL's own generation, or the source the settings above turn on (partial rollout, async
            generation, both). A built-in name (`"trl"`, `"partial"`, `"async"`, `"async_partial"`) must be the one
            those settings turn on (every check and bound reads them). Any other value names a source registered with
            :func:`bapo_trl.rollout.register_source` (one file and one registration line; see
            ``bapo_trl/rollout/contract.py``). Replay, when on, wraps whichever source is chosen.
        generation_backend (`str`, *optional*, defaults to `"vllm"`):
            The engine that samples the completions. `"vllm"`: TRL's own generation for the synchronous sources
            (transformers' ``generate``, or vLLM with ``use_vllm``), and for async generation and in-flight updates
            the vLLM server(s) of ``vllm_server_base_url`` / host and port (``use_vllm=True, vllm_mode="server"``).
            Or the name of a backend registered with :func:`bapo_trl.generation.contract.register_backend` (one
            file and one registration line): it then samples for every source (TRL's default generation, partial
            rollout, async generation), brought to the current weights through the contract.
    """

    replay_buffer_size: int = field(
        default=0, metadata={"help": "Replay queue capacity in groups per process (0 = replay off)."}
    )
    replay_ratio: float = field(
        default=0.0,
        metadata={"help": "Fraction of each generation batch's groups taken from the replay queue, [0, 1)."},
    )
    replay_max_staleness: int = field(
        default=16, metadata={"help": "Evict replay groups older than this many optimizer steps (>= 1)."}
    )
    replay_sampling: str = field(
        default="uniform",
        metadata={"help": "Replay sampling: 'uniform', 'recent' or 'advantage'.", "choices": list(SAMPLING)},
    )
    replay_fill_zero_std_groups: bool = field(
        default=False, metadata={"help": "Replace zero-reward-spread fresh groups by replayed groups first."}
    )
    replay_saves_generation: bool = field(
        default=False,
        metadata={"help": "Generate only the fresh share (1 - replay_ratio) of each batch's groups and fill the rest "
                  "from the replay queue (full generation while any process's queue is too small)."},
    )

    partial_rollout_budget: int | None = field(
        default=None,
        metadata={"help": "Partial rollout: tokens a completion may grow per round, one round per generation batch "
                  "(None = off); unfinished completions carry over to later rounds."},
    )
    partial_rollout_max_resumes: int = field(
        default=4, metadata={"help": "Partial rollout: after this many carry-overs (rounds) a completion is generated "
                             "to the end."}
    )

    async_generation: bool = field(
        default=False,
        metadata={"help": "vLLM server mode: generate the next batches (up to max_staleness ahead) while training on "
                  "the current one."},
    )
    max_staleness: int = field(
        default=1, metadata={"help": "Async generation: generation batches the producer may run ahead, >= 1."}
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "Async generation: push the weights at most every this many optimizer steps, >= 1."},
    )
    inflight_update_tokens: int | None = field(
        default=None,
        metadata={"help": "Async generation: generate each request in chunks of this many tokens; a weight push made "
                  "meanwhile reaches the completions between chunks (in-flight updates). None = off."},
    )
    lazy_weight_loading: bool = field(
        default=False,
        metadata={"help": "Async generation via the disk reload: load a weight push into the server only when the "
                  "next request needs it for its staleness bound (fewer reloads with max_staleness >= 2)."},
    )
    rollout_source: str = field(
        default="auto",
        metadata={"help": "Where batches come from: 'auto' (TRL's generation, or partial rollout / async generation "
                  "as configured) or the name of a registered rollout source. Replay wraps it when on."},
    )
    generation_backend: str = field(
        default="vllm",
        metadata={"help": "The engine that samples: 'vllm' (TRL's generation; the vLLM server(s) for async "
                  "generation) or the name of a backend registered with bapo_trl.generation.contract, which then "
                  "samples for every source."},
    )

    @property
    def partial_rollout_enabled(self) -> bool:
        return self.partial_rollout_budget is not None

    @property
    def replay_enabled(self) -> bool:
        return self.replay_buffer_size > 0

    # -- with GRPOConfig's fields (self is the whole config) ---------------------------------------------------------

    @property
    def updates_per_generation(self) -> int:
        """The most optimizer steps one generation batch is trained across: TRL reuses it for ``steps_per_generation
        x num_iterations`` micro-steps, and where that count and ``gradient_accumulation_steps`` do not divide one
        another a batch can start mid-accumulation (at best ``gcd`` micro-steps before its end) and straddle one update
        more than ``ceil(micro-steps / accumulation)``. 1 exactly when TRL takes the batch's old log-probs as the
        current ones (``gradient_accumulation_steps % (steps_per_generation x num_iterations) == 0``)."""
        micro_steps = self.steps_per_generation * self.num_iterations
        accumulation = self.gradient_accumulation_steps
        latest_start = accumulation - math.gcd(micro_steps, accumulation)
        return (latest_start + micro_steps - 1) // accumulation + 1

    @property
    def batches_start_at_updates(self) -> bool:
        """Generation batches and updates nest: each batch spans whole updates, or each update holds whole batches
        (one of ``steps_per_generation x num_iterations`` and ``gradient_accumulation_steps`` divides the other). Else
        a batch can start mid-accumulation and straddle an update, and :attr:`updates_per_generation` is the most it
        spans, not its cadence."""
        micro_steps, accumulation = self.steps_per_generation * self.num_iterations, self.gradient_accumulation_steps
        return micro_steps % accumulation == 0 or accumulation % micro_steps == 0

    def fewest_updates_spanned(self, batches: int) -> int:
        """The fewest optimizer steps ``batches`` consecutive generation batches train across (``batches x
        updates_per_generation`` where GA divides S x I; fewer where a batch can start mid-accumulation, or where
        several batches fit in one update): TRL's schedule walked over every start a batch can have."""
        micro_steps = self.steps_per_generation * self.num_iterations
        accumulation = self.gradient_accumulation_steps
        return min(((k + batches) * micro_steps - 1) // accumulation - (k * micro_steps) // accumulation + 1
                   for k in range(accumulation))

    @property
    def exactly_on_policy(self) -> bool:
        """Every ratio is 1: each generation batch trains one update and no source brings older tokens (replay,
        partial rollout, async generation), so the bound search can never change the loss. One verdict, which the
        config's warning and ``bapo train``'s plan both read."""
        return self.updates_per_generation <= 1 and not (
            self.replay_enabled or self.partial_rollout_enabled or self.async_generation)

    @property
    def on_policy_reason(self) -> str:
        """Why :attr:`exactly_on_policy` holds and what would make the data stale, closing a parenthesis: the one
        sentence the config's warning and ``bapo train``'s plan both print."""
        return (f"steps_per_generation x num_iterations = {self.steps_per_generation} x {self.num_iterations} "
                f"divides gradient_accumulation_steps = {self.gradient_accumulation_steps}; no replay, partial "
                "rollout or async generation): every ratio is 1, so BAPO acts as GRPO (the bound search never changes "
                "the loss). For stale data: steps_per_generation > gradient_accumulation_steps, num_iterations > 1, "
                "replay_buffer_size/replay_ratio, partial_rollout_budget or async_generation.")

    @property
    def groups_per_batch(self) -> int:
        """Prompt groups in each process's generation batch."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations

    @property
    def replayed_groups_per_batch(self) -> int:
        """Groups of each process's generation batch that ``replay_ratio`` replaces (the trainer's rounding)."""
        return round(self.replay_ratio * self.groups_per_batch)

    def whole_group_errors(self) -> list[str]:
        """After GRPOConfig set ``steps_per_generation``: replay and partial rollout keep whole groups per process."""
        local_batch = self.per_device_train_batch_size * self.steps_per_generation
        if (self.replay_enabled or self.partial_rollout_enabled) and local_batch % self.num_generations:
            return ["replay and partial rollout keep whole groups per process, so `per_device_train_batch_size` x "
                    f"`steps_per_generation` ({local_batch}) must be a multiple of `num_generations` "
                    f"({self.num_generations})."]
        return []

    def inert_rollout_settings(self) -> list[tuple[str, str]]:
        """``("error" | "warning" | "on-policy", message)`` for every rollout setting that can never act in this
        combination (rows of the table "Settings that would do nothing", docs/configuration.md)."""
        rows = []
        if self.replay_enabled:
            # A group pushed at step s is first sampled at the next generation, s + upg, and counted at the last
            # update that trains on that batch, s + 2 upg - 1: its age is at least 2 upg - 1. Async: a batch is
            # sampled at best by the weights of the previous hand-over (one more upg); standing in for generation,
            # its stand-ins are chosen K batches ahead (K more).
            # (Where a batch can start mid-accumulation, the fewest updates those batches span, not 2 upg.)
            ahead = (1 + (self.max_staleness if self.replay_saves_generation else 0)) if self.async_generation else 0
            youngest = self.fewest_updates_spanned(2 + ahead) - 1
            if self.replay_max_staleness < youngest:
                rows.append(("error", (
                    f"`replay_max_staleness` ({self.replay_max_staleness}) is below the youngest age a replayed group "
                    f"can have ({youngest}: the fewest optimizer steps {2 + ahead} consecutive generation batches "
                    f"train across, {youngest + 1}, minus 1; from "
                    f"async_generation={self.async_generation}, max_staleness={self.max_staleness}, "
                    f"replay_saves_generation={self.replay_saves_generation}, steps_per_generation="
                    f"{self.steps_per_generation}, num_iterations={self.num_iterations}, gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps}): every stored group would be evicted before it is replayed. "
                    f"Set `replay_max_staleness` >= {youngest}.")))
            if self.replayed_groups_per_batch == 0 and not self.replay_fill_zero_std_groups:
                groups = self.groups_per_batch
                rows.append(("error", (
                    f"`replay_ratio` ({self.replay_ratio}) x {groups} groups per generation batch on each process "
                    "rounds to 0 replayed groups: nothing would ever be replayed. Raise `replay_ratio` to at least "
                    f"{0.5 / groups + 1e-9:.3g} (or use `replay_fill_zero_std_groups=True`).")))
            elif self.replayed_groups_per_batch >= self.groups_per_batch:
                groups = self.groups_per_batch
                rows.append(("error", (
                    f"`replay_ratio` ({self.replay_ratio}) x {groups} group(s) per generation batch on each process "
                    f"rounds to all {groups}: no fresh group would ever be trained"
                    f"{' or generated' if self.replay_saves_generation else ''}, only what the queue already holds. "
                    f"Lower `replay_ratio` below {1 - 0.5 / groups:.3g}, or put more groups in a batch "
                    "(per_device_train_batch_size x steps_per_generation / num_generations).")))
            elif abs(self.replayed_groups_per_batch - self.replay_ratio * self.groups_per_batch) > 1e-9:
                groups = self.groups_per_batch
                rows.append(("warning", (
                    f"`replay_ratio` ({self.replay_ratio}) x {groups} groups per generation batch on each process is "
                    f"not a whole number of groups: {self.replayed_groups_per_batch} are replayed per batch (a ratio "
                    f"of {self.replayed_groups_per_batch / groups:g}).")))
            if 0 < self.replayed_groups_per_batch < self.groups_per_batch and \
                    self.replay_buffer_size < self.replayed_groups_per_batch:
                rows.append(("warning", (
                    f"`replay_buffer_size` ({self.replay_buffer_size}) holds fewer groups than one batch replays "
                    f"({self.replayed_groups_per_batch} = replay_ratio x groups per batch): `replay_ratio` is never "
                    "reached.")))
        if self.exactly_on_policy:
            rows.append(("on-policy", f"the data is exactly on-policy ({self.on_policy_reason}"))
        for name in ("max_staleness", "weight_sync_steps", "inflight_update_tokens", "lazy_weight_loading"):
            if changed(self, name) and not self.async_generation:
                rows.append(("warning", (
                    f"`{name}` ({getattr(self, name)}) only acts on async generation, "
                    "and `async_generation` is off.")))
        if self.lazy_weight_loading and self.async_generation and self.max_staleness == 1:
            rows.append(("warning", (
                "`lazy_weight_loading` has no effect with `max_staleness`=1: every request needs the newest weights, "
                "so each is loaded before the next request either way. "
                "It defers loads only with max_staleness >= 2.")))
        return rows


@dataclass(frozen=True)
class SourceSettings:
    """What the rollout sources read of a run's configuration: the rollout fields they act on and the few facts of
    TRL's they need. Their port hands it to them (:attr:`~.contract.PortFacts.settings`); they never see the config."""

    seed: int
    generation_batch_size: int  # rows of one generation batch, all processes together
    max_completion_length: int  # the config's cap per completion
    vllm_server_timeout: float
    updates_per_generation: int
    replayed_groups_per_batch: int
    replay_buffer_size: int
    replay_max_staleness: int
    replay_sampling: str
    replay_fill_zero_std_groups: bool
    replay_saves_generation: bool
    partial_rollout_budget: int | None
    partial_rollout_max_resumes: int
    max_staleness: int
    weight_sync_steps: int
    inflight_update_tokens: int | None
    lazy_weight_loading: bool
    generation_backend: str
    sampling: dict  # what a completion is sampled under (:data:`SAMPLED_UNDER`), as comparable values

    @classmethod
    def of(cls, config) -> SourceSettings:
        """The settings of ``config`` (a ``BAPOConfig``, or any object with these names)."""
        names = [name for name in cls.__dataclass_fields__ if name != "sampling"]
        return cls(**{name: getattr(config, name) for name in names}, sampling=sampled_under(config))


#: The settings a completion is sampled under, beside the model: a batch generated ahead under other values is not what
#: this run's settings would generate (a longer completion than the cap, another stop, temperature).
SAMPLED_UNDER = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
                 "generation_kwargs")


def sampled_under(config) -> dict:
    """``config``'s :data:`SAMPLED_UNDER` values (``generation_kwargs`` parsed, as TRL parses it from the command
    line)."""
    return {name: (_generation_kwargs(config) if name == "generation_kwargs" else getattr(config, name, None))
            for name in SAMPLED_UNDER}


def setting_differences(saved: dict, now: dict) -> list[str]:
    """``"name (saved there, this here)"`` for each setting of ``now`` (name -> value: :func:`sampled_under`'s, a
    round's) whose value a checkpoint saved otherwise."""
    return [f"{name} ({saved.get(name)!r} there, {value!r} here)" for name, value in now.items()
            if saved.get(name) != value]


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
    history = [f"generation_kwargs[{key!r}]"
               for key in sorted(set(_generation_kwargs(cfg)) & HISTORY_DEPENDENT_KWARGS)]
    history += ["vllm_structured_outputs_regex"] if getattr(cfg, "vllm_structured_outputs_regex", None) else []
    if history and not cfg.async_generation:  # async refuses every sampling change (async_errors)
        errors.append(
            f"{', '.join(history)} cannot be used with `partial_rollout_budget`: each round is a new request that "
            "continues the completion as its prompt, so a grammar would restart and a penalty on generated tokens "
            "would forget the earlier rounds' tokens (TRL samples each completion in one request). Drop them, or "
            "generate without partial rollout.")
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
        errors.append("`lazy_weight_loading` cannot be combined with `inflight_update_tokens`: in-flight updates "
                      "load every push between two chunks as soon as it is made, lazy loading defers pushes until a "
                      "request needs them; use one of them.")
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
    if not samples_for_every_source(cfg.generation_backend) and not (cfg.use_vllm and cfg.vllm_mode == "server"):
        errors.append("`async_generation` needs a vLLM server to generate in (`use_vllm=True`, "
                      f"`vllm_mode='server'`); got use_vllm={cfg.use_vllm}, vllm_mode={cfg.vllm_mode!r} (or a "
                      "`generation_backend` of your own).")
    changed = sampling_changes(cfg)
    if changed:
        errors.append(
            f"`async_generation` takes each token's behaviour log-prob from the sampler, and {', '.join(changed)} "
            "make(s) the sampler's distribution a truncated or penalised one: every importance ratio would carry that "
            "difference as a systematic bias, which TRL's synchronous path puts into its importance-sampling weight "
            "instead (the trainer-side log-probs of the sampling policy no longer exist under async). Sample with "
            "top_p=1, top_k=0, min_p=0, repetition_penalty=1 and no such generation_kwargs with async generation, or "
            "generate synchronously (async_generation=False).")
    if "logprobs" in _generation_kwargs(cfg):
        errors.append("`generation_kwargs['logprobs']` cannot be used with `async_generation`: each token's behaviour "
                      "log-prob is the sampled token's, which the server returns first only with logprobs=0 (with N "
                      "it returns the top N, and TRL's client reads the most likely token's). Drop it.")
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


def generation_backend_errors(cfg) -> list[str]:
    """The backend must be registered (by the time the config is built). A backend of the user's own samples for
    every source and its log-probs are the behaviour log-probs there: its distribution must be the policy's at the
    temperature (async generation checks the same for the built-in one)."""
    if cfg.generation_backend not in registered_backends():
        return [f"`generation_backend` must be one of the registered generation backends {registered_backends()}, "
                f"got {cfg.generation_backend!r} (register yours with "
                "bapo_trl.generation.contract.register_backend(name, cls) before building the config)."]
    changed = sampling_changes(cfg)
    if samples_for_every_source(cfg.generation_backend) and changed and not cfg.async_generation:
        return [f"`generation_backend` {cfg.generation_backend!r} samples for every source, and its log-probs are the "
                f"behaviour log-probs of each token; {', '.join(changed)} make(s) the sampler's distribution a "
                "truncated or penalised one, so every importance ratio would carry that difference as a bias (TRL's "
                "generation recomputes the behaviour log-probs and puts the difference into its capped "
                "importance-sampling weight instead). Sample with top_p=1, top_k=0, min_p=0, repetition_penalty=1 "
                "and no such generation_kwargs, or generate with the built-in backend ('vllm')."]
    return []


def rollout_errors(cfg) -> list[str]:
    """Every problem with the rollout settings of ``cfg``."""
    return (replay_errors(cfg) + partial_rollout_errors(cfg) + async_errors(cfg) + rollout_source_errors(cfg)
            + generation_backend_errors(cfg))


def sampler_logprobs_use(args) -> str | None:
    """What training does with the server's log-probs of the sampled tokens, for the error; None: nothing (TRL then
    receives them and ignores them), so any ``--logprobs-mode`` will do."""
    if getattr(args, "async_generation", False):
        return "async generation trains with them as the behaviour log-probs"
    source = getattr(args, "rollout_source", "auto")
    if source != "auto" and source not in BUILT_IN_SOURCES:
        return (f"the rollout source {source!r} (`rollout_source`) may train with them as the behaviour log-probs "
                "(TRLPort.sample)")
    if getattr(args, "vllm_importance_sampling_correction", False):
        return "TRL's importance-sampling correction (`vllm_importance_sampling_correction`) divides by them"
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        return "TRL's off-policy sequence mask (`off_policy_mask_threshold`) compares them with the policy's"
    return None
