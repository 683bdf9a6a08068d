"""``BAPOConfig``: TRL's ``GRPOConfig`` plus the BAPO bound-search settings, validated before anything is built."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..core.clipping import MODES, VARIANTS, BAPOSettings, settings_errors
from ..core.loss_types import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SUPPORTED_LOSS_TYPES
from ..generation.fleet import normalized_server_urls, server_urls
from ..rollout_settings import SAMPLING, rollout_errors

#: The official code caps the loss of negative-advantage tokens at ``3.0 * |A|`` (dual clip); in TRL that is the
#: two-sided clipping ``delta``, identical as long as ``c_high <= delta``. BAPOConfig applies it by default
#: (``dual_clip``): docs/results.md, where it never lowered the final reward and always lowered the largest gradient norm.
DUAL_CLIP = 3.0


@dataclass
class BAPOConfig(GRPOConfig):
    r"""
    Configuration for [`BAPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the adaptive clipping of BAPO
    (Balanced Policy Optimization with Adaptive Clipping, Xi et al., 2025, [arXiv 2510.18927](https://arxiv.org/abs/2510.18927)).

    At every loss computation BAPO replaces the fixed PPO window ``[1 - epsilon, 1 + epsilon_high]`` by a window
    ``[c_low, c_high]`` chosen so that positive-advantage tokens hold at least ``positive_contribution_target`` of
    the loss. ``epsilon`` and ``epsilon_high`` are therefore ignored.

    Every TRL ``loss_type`` and both ``importance_sampling_level`` values are balanced (``docs/loss_types.md``): the
    clipped losses (dapo, bnpo, grpo, dr_grpo, luspo) through their window; ``cispo`` through its cap on the
    importance weight (``c_high`` is the cap, there is no lower bound); ``sapo`` and ``vespo`` through each sign's
    gate sharpness, read off the window's half-widths relative to the start window (their configured temperatures /
    shapes are the path's start). With ``delta`` below ``ratio_upper_max`` the upper path ends at ``delta``.

    ``vllm_server_base_url`` may list several generation servers (a list, or a comma-separated string on the command
    line): requests are spread over them and every weight push reaches each (:mod:`bapo_trl.generation.fleet`).

    Parameters:
        positive_contribution_target (`float`, *optional*, defaults to `0.5`):
            Target share rho0 of the loss held by positive-advantage tokens, in (0, 1). The paper's experiments use
            0.4 (0.45 for a Llama model).
        ratio_lower_start (`float`, *optional*, defaults to `0.6`):
            Start a- of the lower bound ``c_low``, in (0, 1]. Reset for every update.
        ratio_lower_max (`float`, *optional*, defaults to `0.9`):
            Largest value b- the lower bound may reach, in [ratio_lower_start, 1].
        ratio_lower_step (`float`, *optional*, defaults to `0.02`):
            Step d- of the lower bound, > 0.
        ratio_upper_start (`float`, *optional*, defaults to `1.2`):
            Start a+ of the upper bound ``c_high``, >= 1. Reset for every update.
        ratio_upper_max (`float`, *optional*, defaults to `3.0`):
            Largest value b+ the upper bound may reach, >= ratio_upper_start.
        ratio_upper_step (`float`, *optional*, defaults to `0.05`):
            Step d+ of the upper bound, > 0.
        bapo_variant (`str`, *optional*, defaults to `"paper"`):
            `"paper"`: Algorithm 1 (raise ``c_high`` first, then ``c_low``; compare the share with the target).
            `"verl"`: the official code (raise ``c_low`` first, then ``c_high``; compare ``pos / neg`` with
            ``rho0 / (1 - rho0)``).
        dual_clip (`bool`, *optional*, defaults to `True`):
            Cap the loss of negative-advantage tokens at ``delta |A|`` (the official code's dual clip; TRL's
            two-sided clip ``delta``), for the clipped losses (grpo, bnpo, dr_grpo, dapo, luspo). When ``delta`` is
            left unset it becomes 3.0, the official code's value (or ``ratio_upper_max`` if larger, so the search path
            is never cut). Without it a negative token whose ratio has run far above 1 keeps its whole weight
            ``r |A|``: on the studies of docs/results.md the dual clip never lowered the final reward and always
            lowered the largest gradient norm. ``False``: TRL's one-sided clip, unless ``delta`` is set.
        positive_contribution_mode (`str`, *optional*, defaults to `"value"`):
            How rho is measured. `"value"` (the paper): every token counts at its clipped value,
            ``pos = sum_{A>0} min(r, c_high) A``, ``neg = sum_{A<0} max(r, c_low) |A|``. Note: raising ``c_low``
            LOWERS this share. `"gradient"` (not in the paper): only tokens that still carry a gradient count,
            each with weight ``r |A|`` (so not a negative above `delta`, TRL's two-sided clip); raising ``c_low``
            raises this share.

        mask_nonfinite_tokens (`bool`, *optional*, defaults to `True`):
            Drop real tokens whose behaviour/reference log-prob, importance weight or advantage is NaN or inf from
            the loss (they are counted in `bapo/nonfinite_tokens` either way) instead of letting them poison the
            step. Non-finite values on padded positions are always neutralised.
        max_log_ratio (`float`, *optional*, defaults to `20.0`):
            Clamp of the log importance ratio, as in the official code, so ``exp`` never overflows. Must exceed
            ``log(ratio_upper_max)`` so it never interferes with the clipping window.

        positive_contribution_is_weighted (`bool`, *optional*, defaults to `False`):
            When TRL's vLLM importance-sampling correction reweights tokens (the batch carries
            ``importance_sampling_ratio``), measure rho on the reweighted contributions ``A x w``, as TRL's loss
            weights them. Off (the official code): the search sees unweighted contributions and the IS weights are
            applied after it.
        target_entropy (`float` or `None`, *optional*, defaults to `None`):
            Experimental closed loop (:mod:`bapo_trl.core.target_controller`): after every update, raise
            ``positive_contribution_target`` by ``target_adapt_rate`` while the policy entropy (all processes) is
            below this value, lower it while above, within ``[target_min, target_max]``. Logged as
            ``bapo/positive_contribution_target``; checkpointed. Off when `None`.
        target_adapt_rate (`float`, *optional*, defaults to `0.005`), target_min (`float`, defaults to `0.3`),
        target_max (`float`, defaults to `0.7`):
            Step and range of the closed-loop target.

        > Stale-sample replay (the paper's "sample replay" off-policy setting)

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

        > Partial rollout (the paper's other off-policy scenario)

        partial_rollout_budget (`int` or `None`, *optional*, defaults to `None`):
            Tokens a completion may grow per round (off when `None`); one round per generation batch, so every
            `steps_per_generation` x `num_iterations` / `gradient_accumulation_steps` optimizer steps. Unfinished
            completions are kept with the log-probs of the policy that produced each token and continued in later
            rounds; a group is scored and trained once all its completions are finished. Works with transformers generation and vLLM.
            `generation_kwargs` may add stop token ids, but not length or string-stop settings.
        partial_rollout_max_resumes (`int`, *optional*, defaults to `4`):
            A completion carried over this many rounds is generated to the end at its next round (>= 1).

        > Async generation (generation overlaps training)

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

        > Where batches come from

        rollout_source (`str`, *optional*, defaults to `"auto"`):
            `"auto"`: TRL's own generation, or the source the settings above turn on (partial rollout, async
            generation, both). A built-in name (`"trl"`, `"partial"`, `"async"`, `"async_partial"`) must be the one
            those settings turn on (every check and bound reads them). Any other value names a source registered with
            :func:`bapo_trl.rollout.register_source` (one file and one registration line; see
            ``bapo_trl/rollout/contract.py``). Replay, when on, wraps whichever source is chosen.
    """

    positive_contribution_target: float = field(
        default=0.5,
        metadata={"help": "BAPO target share rho0 of the loss held by positive-advantage tokens, in (0, 1)."},
    )
    ratio_lower_start: float = field(
        default=0.6, metadata={"help": "BAPO: start of the lower clipping bound c_low, in (0, 1]."}
    )
    ratio_lower_max: float = field(
        default=0.9, metadata={"help": "BAPO: largest value of the lower clipping bound c_low, in (0, 1]."}
    )
    ratio_lower_step: float = field(default=0.02, metadata={"help": "BAPO: step of the lower bound, > 0."})
    ratio_upper_start: float = field(
        default=1.2, metadata={"help": "BAPO: start of the upper clipping bound c_high, >= 1."}
    )
    ratio_upper_max: float = field(
        default=3.0, metadata={"help": "BAPO: largest value of the upper clipping bound c_high, >= 1."}
    )
    ratio_upper_step: float = field(default=0.05, metadata={"help": "BAPO: step of the upper bound, > 0."})
    bapo_variant: str = field(
        default="paper",
        metadata={
            "help": "BAPO search variant: 'paper' (Algorithm 1, c_high moves first) or 'verl' (official code: "
            "c_low first, pos/neg ratio target, dual clip of negatives at 3|A|).",
            "choices": list(VARIANTS),
        },
    )
    dual_clip: bool = field(
        default=True,
        metadata={"help": "Cap the loss of negative-advantage tokens at delta x |A| (the official code's dual clip, "
                  "TRL's two-sided `delta`) for the clipped losses; delta left unset becomes 3.0 (or ratio_upper_max "
                  "if larger). False: TRL's one-sided clip unless delta is set."},
    )
    positive_contribution_mode: str = field(
        default="value",
        metadata={
            "help": "How the positive share is measured: 'value' (paper; tokens at their clipped value) or "
            "'gradient' (only tokens that still carry a gradient, weight r|A|).",
            "choices": list(MODES),
        },
    )

    mask_nonfinite_tokens: bool = field(
        default=True, metadata={"help": "Drop real tokens with NaN/inf inputs from the loss (they are counted)."}
    )
    max_log_ratio: float = field(
        default=20.0, metadata={"help": "Clamp of the log importance ratio (official code: 20); > log(ratio_upper_max)."}
    )
    positive_contribution_is_weighted: bool = field(
        default=False,
        metadata={"help": "Measure the positive share on contributions reweighted by TRL's vLLM importance-sampling "
                  "correction (A x IS weight), as the loss weights them. Off: unweighted, as the official code."},
    )
    target_entropy: float | None = field(
        default=None,
        metadata={"help": "Experimental: move positive_contribution_target after every update toward this policy "
                  "entropy (nats/token) by target_adapt_rate, within [target_min, target_max]. None = off."},
    )
    target_adapt_rate: float = field(default=0.005, metadata={"help": "Step of the closed-loop target, > 0."})
    target_min: float = field(default=0.3, metadata={"help": "Lowest target the controller may set, in (0, 1)."})
    target_max: float = field(default=0.7, metadata={"help": "Highest target the controller may set, in (0, 1)."})
    replay_buffer_size: int = field(
        default=0, metadata={"help": "Replay queue capacity in groups per process (0 = replay off)."}
    )
    replay_ratio: float = field(
        default=0.0, metadata={"help": "Fraction of each generation batch's groups taken from the replay queue, [0, 1)."}
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
        default=1, metadata={"help": "Async generation: push the weights at most every this many optimizer steps, >= 1."}
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

    def __post_init__(self):
        # Validate BAPO's own fields first: a bad value must fail before TrainingArguments sets up devices.
        errors = self.bapo_errors()
        if errors:
            raise ValueError("Invalid BAPOConfig:\n  - " + "\n  - ".join(errors))
        self.vllm_server_base_url = normalized_server_urls(self.vllm_server_base_url)  # several: a list
        if self.dual_clip and self.delta is None and self._loss.kind == "clip":
            self.delta = max(DUAL_CLIP, self.ratio_upper_max)
        super().__post_init__()
        local_batch = self.per_device_train_batch_size * self.steps_per_generation
        if (self.replay_enabled or self.partial_rollout_enabled) and local_batch % self.num_generations:
            raise ValueError(
                "Invalid BAPOConfig:\n  - replay and partial rollout keep whole groups per process, so "
                "`per_device_train_batch_size` x "
                f"`steps_per_generation` ({local_batch}) must be a multiple of `num_generations` "
                f"({self.num_generations})."
            )
        # Settings that are valid one by one but under which something the user turned on can never act.
        inert = self.inert_settings()
        errors = [message for kind, message in inert if kind == "error"]
        if errors:
            raise ValueError("Invalid BAPOConfig:\n  - " + "\n  - ".join(errors))
        for kind, message in inert:
            if kind == "warning":
                warnings.warn(f"BAPO: {message}", UserWarning, stacklevel=2)

    @property
    def updates_per_generation(self) -> int:
        """Optimizer steps taken on one generation batch (TRL reuses it ``steps_per_generation x num_iterations``
        micro-steps)."""
        micro_steps = self.steps_per_generation * self.num_iterations
        return max(1, -(-micro_steps // self.gradient_accumulation_steps))

    @property
    def groups_per_batch(self) -> int:
        """Prompt groups in each process's generation batch."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations

    @property
    def replayed_groups_per_batch(self) -> int:
        """Groups of each process's generation batch that ``replay_ratio`` replaces (the trainer's rounding)."""
        return round(self.replay_ratio * self.groups_per_batch)

    def inert_settings(self) -> list[tuple[str, str]]:
        """``("error" | "warning", message)`` for every setting that can never act in this combination (the README
        table "Settings that would do nothing"). Errors: a feature the user turned on would never act. Warnings: the
        run is legitimate but a setting is useless in it."""
        rows = []
        upg = self.updates_per_generation
        if self.replay_enabled:
            # A group pushed at step s is first sampled at the next generation, s + upg, and counted at the last
            # update that trains on that batch, s + 2 upg - 1: its age is at least 2 upg - 1. Async: a batch is
            # sampled at best by the weights of the previous hand-over (one more upg); standing in for generation,
            # its stand-ins are chosen K batches ahead (K more).
            ahead = (1 + (self.max_staleness if self.replay_saves_generation else 0)) if self.async_generation else 0
            youngest = (2 + ahead) * upg - 1
            if self.replay_max_staleness < youngest:
                rows.append(("error", (
                    f"`replay_max_staleness` ({self.replay_max_staleness}) is below the youngest age a replayed group "
                    f"can have ({youngest} = {2 + ahead} x {upg} updates per generation batch - 1, from "
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
            elif self.replay_buffer_size < self.replayed_groups_per_batch:
                rows.append(("warning", (
                    f"`replay_buffer_size` ({self.replay_buffer_size}) holds fewer groups than one batch replays "
                    f"({self.replayed_groups_per_batch} = replay_ratio x groups per batch): `replay_ratio` is never "
                    "reached.")))
        on_policy = upg <= 1 and not (self.replay_enabled or self.partial_rollout_enabled or self.async_generation)
        if on_policy:
            rows.append(("warning", (
                f"the data is exactly on-policy (steps_per_generation x num_iterations = {self.steps_per_generation} x "
                f"{self.num_iterations} <= gradient_accumulation_steps = {self.gradient_accumulation_steps}, no replay, "
                "no partial rollout): every ratio is 1 and the bound search can never change the loss (BAPO equals "
                "GRPO). Data becomes stale with steps_per_generation > gradient_accumulation_steps, num_iterations > 1, "
                "replay_buffer_size/replay_ratio or partial_rollout_budget.")))
        path = self._loss.path(self.bapo_settings)
        window = f"[{path.clip_low[0]}, {path.clip_high[0]}]"
        rows += self._loss_type_rows()
        if (self.bapo_variant == "paper" and len(path.low_grid) == 1 and self.ratio_upper_max > self.ratio_upper_start
                and not path.negatives_on_high):
            rows.append(("warning", (
                "`ratio_lower_start` + `ratio_lower_step` exceeds `ratio_lower_max`, so the paper's search loop never "
                f"runs and `c_high` stays at `ratio_upper_start`: the window is fixed at {window}; "
                "`ratio_upper_max` and `ratio_upper_step` have no effect.")))
        if len(path) == 1:
            moved = [f"{name}={getattr(self, name)!r}" for name, default in
                     (("positive_contribution_target", 0.5), ("positive_contribution_mode", "value"),
                      ("target_entropy", None)) if getattr(self, name) != default]
            if moved:
                rows.append(("warning", (
                    f"the search path has a single window {window}, so {', '.join(moved)} only matter(s) for a moving "
                    "search and has no effect: widen `ratio_upper_max` / `ratio_lower_max` or drop the setting.")))
        if self.positive_contribution_is_weighted and not (self.use_vllm and self.vllm_importance_sampling_correction):
            rows.append(("warning", (
                "`positive_contribution_is_weighted` only acts on TRL's vLLM importance-sampling weights, and this run "
                f"has none (use_vllm={self.use_vllm}, vllm_importance_sampling_correction="
                f"{self.vllm_importance_sampling_correction}): the share is measured unweighted.")))
        for name, default in (("max_staleness", 1), ("weight_sync_steps", 1), ("inflight_update_tokens", None),
                              ("lazy_weight_loading", False)):
            value = getattr(self, name)  # (True == 1: compare the types too)
            if (value != default or type(value) is not type(default)) and not self.async_generation:
                rows.append(("warning", (
                    f"`{name}` ({getattr(self, name)}) only acts on async generation, and `async_generation` is off.")))
        if self.lazy_weight_loading and self.async_generation and self.max_staleness == 1:
            rows.append(("warning", (
                "`lazy_weight_loading` has no effect with `max_staleness`=1: every request needs the newest weights, "
                "so each is loaded before the next request either way. It defers loads only with max_staleness >= 2.")))
        if self.epsilon != 0.2 or self.epsilon_high is not None:
            rows.append(("warning", (
                f"`epsilon` ({self.epsilon}) / `epsilon_high` ({self.epsilon_high}) are ignored: BAPO chooses the "
                "window at every update; its range is `ratio_lower_start`..`ratio_lower_max` and "
                "`ratio_upper_start`..`ratio_upper_max`.")))
        return rows

    @property
    def _loss(self):
        """The loss type's row (:mod:`bapo_trl.core.loss_types`); the clipped surrogate's for an unknown one (refused)."""
        return LOSS_TYPES.get(self.loss_type, LOSS_TYPES["dapo"])

    def _loss_type_rows(self) -> list[tuple[str, str]]:
        """Inert-setting rows that depend on the loss type."""
        rows, kind, name = [], self._loss.kind, f"loss_type={self.loss_type!r}"
        if kind == "clip" and self.delta is not None and self.delta < self.ratio_upper_max:
            rows.append(("warning", (
                f"`delta` ({self.delta}) is below `ratio_upper_max` ({self.ratio_upper_max}): TRL's two-sided clip caps "
                f"every ratio at delta, so a c_high above it would change nothing; the upper search path ends at "
                f"{self.bapo_settings.ratio_upper_max} (paper: the last step <= delta; verl: delta itself). Raise `delta` to >= "
                "`ratio_upper_max` for the full path, or set `ratio_upper_max` to delta to silence this warning.")))
        if kind != "clip" and self.delta is not None:
            rows.append(("warning", f"`delta` ({self.delta}) has no effect with {name}: TRL applies it to the clipped "
                                    "losses only. Drop `delta`."))
        lower_moved = (self.ratio_lower_start, self.ratio_lower_max, self.ratio_lower_step) != (0.6, 0.9, 0.02)
        if kind == "cap" and lower_moved:
            rows.append(("warning", (
                f"`ratio_lower_start`/`ratio_lower_max`/`ratio_lower_step` have no effect with {name}: CISPO caps the "
                "importance weight from above only (c_high is the cap; bapo/clip_low is 0, no lower bound). Drop them.")))
        if kind != "clip" and self.positive_contribution_mode != "value":
            rows.append(("warning", (
                f"`positive_contribution_mode` ({self.positive_contribution_mode!r}) has no effect with {name}: every "
                "token keeps a gradient, so the value and the gradient share are one (the share of the weight each "
                "token's gradient carries; docs/loss_types.md).")))
        if self._loss.is_weight_in_ratio and self.positive_contribution_is_weighted:
            rows.append(("warning", (
                f"`positive_contribution_is_weighted` has no effect with {name}: TRL folds the vLLM importance-sampling "
                "weights into the sequence weight w, and the search always measures the share on that w.")))
        return rows

    def bapo_errors(self) -> list[str]:
        """Every problem with the BAPO fields and their combination with the GRPO fields."""
        errors = settings_errors(**self._settings_dict())
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            errors.append(
                f"`loss_type` must be one of {SUPPORTED_LOSS_TYPES} with BAPO (the loss types it has a row for, see "
                f"docs/loss_types.md), got {self.loss_type!r}."
            )
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            errors.append(
                f"`importance_sampling_level` must be one of {IMPORTANCE_SAMPLING_LEVELS} (TRL's levels), got "
                f"{self.importance_sampling_level!r}."
            )
        if self.use_liger_kernel:
            errors.append("`use_liger_kernel` must be False with BAPO (the Liger GRPO loss has a fixed window), got "
                          "True: set use_liger_kernel=False.")
        numbers_ok = all(_finite(getattr(self, n)) for n in ("ratio_upper_start", "ratio_upper_max", "ratio_lower_max"))
        kind = self._loss.kind
        if kind == "clip" and self.delta is not None and numbers_ok:
            if not (_finite(self.delta) and self.delta >= self.ratio_upper_start):
                errors.append(
                    f"`delta` ({self.delta}) must be >= `ratio_upper_start` ({self.ratio_upper_start}) with BAPO: TRL "
                    "caps every ratio at delta, so no c_high of the search path could act. Raise `delta` or lower "
                    "`ratio_upper_start`."
                )
        if kind == "gate" and numbers_ok:
            if not self.ratio_upper_start > 1.0:
                errors.append(
                    f"`ratio_upper_start` must be > 1 with loss_type={self.loss_type!r} (the positive gate's sharpness "
                    f"is (ratio_upper_start - 1) / (c_high - 1)), got {self.ratio_upper_start}: use e.g. 1.2."
                )
            if not self.ratio_lower_max < 1.0:
                errors.append(
                    f"`ratio_lower_max` must be < 1 with loss_type={self.loss_type!r} (the negative gate's sharpness "
                    f"is (1 - ratio_lower_start) / (1 - c_low)), got {self.ratio_lower_max}: use e.g. 0.9."
                )
        if self.loss_type == "sapo":
            for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
                if not (_finite(getattr(self, name)) and getattr(self, name) > 0):
                    errors.append(f"`{name}` must be a finite number > 0 with BAPO (the start of the gate's path, "
                                  f"scaled along it), got {getattr(self, name)!r}.")
        if not (isinstance(self.max_log_ratio, (int, float)) and math.isfinite(self.max_log_ratio)) or (
            not errors and self.max_log_ratio <= math.log(self.ratio_upper_max)
        ):
            errors.append(
                f"`max_log_ratio` must be a finite number > log(ratio_upper_max) = "
                f"{math.log(self.ratio_upper_max) if isinstance(self.ratio_upper_max, (int, float)) and self.ratio_upper_max > 0 else 'n/a'}"
                f", got {self.max_log_ratio!r}."
            )
        if self.target_entropy is not None:
            numbers = (self.target_entropy, self.target_adapt_rate, self.target_min, self.target_max)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
                errors.append(f"`target_entropy`, `target_adapt_rate`, `target_min`, `target_max` must be finite "
                              f"numbers, got {numbers}.")
            elif not (self.target_entropy > 0 and self.target_adapt_rate > 0
                      and 0 < self.target_min <= self.positive_contribution_target <= self.target_max < 1):
                errors.append(
                    "the closed-loop target needs `target_entropy` > 0, `target_adapt_rate` > 0 and 0 < `target_min` <= "
                    f"`positive_contribution_target` <= `target_max` < 1; got target_entropy={self.target_entropy}, "
                    f"target_adapt_rate={self.target_adapt_rate}, target_min={self.target_min}, "
                    f"positive_contribution_target={self.positive_contribution_target}, target_max={self.target_max}.")
        try:
            server_urls(self.vllm_server_base_url)
        except ValueError as exc:
            errors.append(str(exc))
        return errors + rollout_errors(self)

    @property
    def partial_rollout_enabled(self) -> bool:
        return self.partial_rollout_budget is not None

    @property
    def replay_enabled(self) -> bool:
        return self.replay_buffer_size > 0

    def _settings_dict(self) -> dict:
        """The search settings as set; ``delta`` (TRL's field, checked in :meth:`bapo_errors`) joins in
        :attr:`bapo_settings`."""
        return {name: getattr(self, name) for name in BAPOSettings.__dataclass_fields__ if name != "delta"}

    @property
    def bapo_settings(self) -> BAPOSettings:
        """The search settings as the frozen object :func:`bapo_trl.search_clip_bounds` takes. With a clipped loss
        and ``delta`` set, the settings carry it (the gradient share leaves out the negatives above it, which TRL's
        two-sided clip gives no gradient), and below ``ratio_upper_max`` the upper path ends at ``delta`` (TRL caps
        every ratio there). Other loss types ignore ``delta``, as TRL does."""
        settings = self._settings_dict()
        if self._loss.kind == "clip" and self.delta is not None:
            settings["delta"] = self.delta
            settings["ratio_upper_max"] = min(self.ratio_upper_max, self.delta)
        return BAPOSettings(**settings)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trainer_config(args, model) -> BAPOConfig:
    """``BAPOTrainer``'s ``args``: TRL's default when None (``<model name>-BAPO``), a clear error for a GRPOConfig."""
    if args is None:
        name = model if isinstance(model, str) else model.config.name_or_path
        return BAPOConfig(f"{name.split('/')[-1]}-BAPO")
    if not isinstance(args, BAPOConfig):
        raise TypeError(
            f"BAPOTrainer needs `args` to be a BAPOConfig, got {type(args).__name__}. BAPOConfig takes every "
            "GRPOConfig field unchanged: replace `GRPOConfig(...)` by `BAPOConfig(...)` (from bapo_trl import "
            "BAPOConfig); BAPO then adds its search settings with the paper's defaults (positive_contribution_"
            "target=0.5, c_low 0.6..0.9, c_high 1.2..3.0) and ignores `epsilon`/`epsilon_high`.")
    return args
