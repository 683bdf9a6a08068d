"""``BAPOConfig``: TRL's ``GRPOConfig`` plus the BAPO bound-search settings, validated before anything is built."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..core.clipping import MODES, VARIANTS, BAPOSettings, is_real, settings_errors
from ..core.loss_types import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SUPPORTED_LOSS_TYPES
from ..core.window_rule import RATIO_FIELDS, WIDENING, derived_path, lower_is_clamped
from ..generation.adapter_sync import LORA_SYNC_MODES
from ..generation.contract import samples_for_every_source
from ..generation.fleet import normalized_server_urls, server_urls
from ..rollout.settings import OnPolicyWarning, RolloutSettings, field_default, rollout_errors

#: The official code caps the loss of negative-advantage tokens at ``3.0 * |A|`` (dual clip); in TRL that is the
#: two-sided clipping ``delta``, identical as long as ``c_high <= delta``. BAPOConfig applies it by default
#: (``dual_clip``): in the evidence study of docs/results.md it lowered the largest gradient norm in every scenario
#: and mostly tied the final reward (the exceptions are listed there).
DUAL_CLIP = 3.0
#: The search's defaults, declared once (:class:`~bapo_trl.core.clipping.BAPOSettings`): the config's fields take
#: theirs (the ``ratio_*`` fields default to None: the window rule derives them, :mod:`bapo_trl.core.window_rule`).
SEARCH_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BAPOSettings)}


@dataclass
class BAPOConfig(RolloutSettings, GRPOConfig):
    r"""
    Configuration for [`BAPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the adaptive clipping of BAPO
    (Balanced Policy Optimization with Adaptive Clipping, Xi et al., 2025, [arXiv 2510.18927](https://arxiv.org/abs/2510.18927)).

    At every loss computation BAPO replaces the fixed PPO window ``[1 - epsilon, 1 + epsilon_high]`` by a window
    ``[c_low, c_high]`` chosen so that positive-advantage tokens hold at least ``positive_contribution_target`` of
    the loss. The search path is derived from the window you set (:mod:`bapo_trl.core.window_rule`): ``c_high``
    starts at your bound and rises only as far as the balance needs; ``c_low`` starts wider than yours (2x the
    half-width for token ratios, 30x for sequence ratios) and narrows. So on a stale batch where the search takes no
    step, the window differs from yours below 1; on on-policy data every ratio is 1 and BAPO equals TRL. The
    ``ratio_*`` fields you leave unset are derived from ``epsilon``, ``epsilon_high`` and
    ``importance_sampling_level`` (the fields keep what you set; the path the search runs on is
    :attr:`search_path`). At TRL's defaults (``epsilon=0.2``, token ratios) that is the paper's path, ``c_high``
    1.2..3.0 and ``c_low`` 0.6..0.9; around GSPO's documented window (``3e-4``/``4e-4`` on the sequence ratio) it is
    ``c_high`` 1.0004..1.04 and ``c_low`` 0.991..0.9997 (``gspo_balanced()``). A ``ratio_*`` field you set
    overrides the rule for that field.

    Every TRL ``loss_type`` and both ``importance_sampling_level`` values are balanced (``docs/loss_types.md``): the
    clipped losses (dapo, bnpo, grpo, dr_grpo, luspo) through their window; ``cispo`` through its cap on the
    importance weight (``c_high`` is the cap, there is no lower bound); ``sapo`` and ``vespo`` through each sign's
    gate sharpness, read off the window's half-widths relative to the start window (their configured temperatures /
    shapes are the path's start). With ``delta`` below ``ratio_upper_max`` the upper path ends at ``delta``.

    ``vllm_server_base_url`` may list several generation servers (a list, or a comma-separated string on the command
    line): requests are spread over them and every weight push reaches each (:mod:`bapo_trl.generation.fleet`).

    Where batches come from (replay, partial rollout, async generation and ``rollout_source``) are the fields of
    [`~bapo_trl.rollout.settings.RolloutSettings`], which BAPOConfig inherits (declared, documented and checked there).

    Parameters:
        positive_contribution_target (`float`, *optional*, defaults to `0.5`):
            Target share rho0 of the loss held by positive-advantage tokens, in (0, 1). The paper's experiments use
            0.4 (0.45 for a Llama model).
        ratio_lower_start (`float`, *optional*):
            Start a- (the widest value) of the lower bound ``c_low``, in (0, 1]. Reset for every update. Unset:
            ``1 - W epsilon`` (``W`` = 2 for token ratios, 30 for sequence ratios): 0.6 at TRL's defaults.
        ratio_lower_max (`float`, *optional*):
            Largest value b- the lower bound may reach, in [ratio_lower_start, 1]. Unset: ``1 - N epsilon`` (``N`` =
            0.5 for token ratios, 1 for sequence ratios): 0.9 at TRL's defaults.
        ratio_lower_step (`float`, *optional*):
            Step d- of the lower bound, > 0. Unset: the lower range in 16 points (0.02 at TRL's defaults).
        ratio_upper_start (`float`, *optional*):
            Start a+ of the upper bound ``c_high``, >= 1. Reset for every update. Unset: ``1 + epsilon_high`` (or
            ``1 + epsilon``): 1.2 at TRL's defaults.
        ratio_upper_max (`float`, *optional*):
            Largest value b+ the upper bound may reach, >= ratio_upper_start. Unset: ``1 + U epsilon_high`` (``U`` =
            10 for token ratios, 100 for sequence ratios): 3.0 at TRL's defaults.
        ratio_upper_step (`float`, *optional*):
            Step d+ of the upper bound, > 0. Unset: the upper range in 37 points (0.05 at TRL's defaults).
        bapo_variant (`str`, *optional*, defaults to `"paper"`):
            `"paper"`: Algorithm 1 (raise ``c_high`` first, then ``c_low``; compare the share with the target).
            `"verl"`: the official code (raise ``c_low`` first, then ``c_high``; compare ``pos / neg`` with
            ``rho0 / (1 - rho0)``).
        dual_clip (`bool`, *optional*, defaults to `True`):
            Cap the loss of negative-advantage tokens at ``delta |A|`` (the official code's dual clip; TRL's
            two-sided clip ``delta``), for the clipped losses (grpo, bnpo, dr_grpo, dapo, luspo). When ``delta`` is
            left unset it becomes 3.0, the official code's value (or ``ratio_upper_max`` if larger, so the search path
            is never cut). Without it a negative token whose ratio has run far above 1 keeps its whole weight
            ``r |A|``. In the evidence study of docs/results.md the dual clip lowered the largest gradient norm in
            every scenario and mostly tied the final reward (the exceptions are listed there). ``False``: TRL's
            one-sided clip, unless ``delta`` is set.
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
            Clamp of the log importance ratio to the behaviour policy, as in the official code, so ``exp`` never
            overflows. Must exceed ``log(ratio_upper_max)`` so it never interferes with the clipping window; it is the
            ratio all of TRL's loss reads, so for a token more than this many nats from the behaviour policy it also
            changes GSPO's sequence ratio, a negative token's weight without a dual clip, the bias-corrected KL's ratio
            factor and (without sampler log-probs) the off-policy mask. The sampler's own log-probs are not clamped.
            The reference log-ratio of TRL's KL term (``beta > 0``) is not clamped at it: it is TRL's but where the
            reference log-prob is more than 44 nats (float32; 10 in float16) above the policy's, where ``exp``
            overflows or nearly does, or 10,000 below it.

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
        target_adapt_rate (`float`, *optional*, defaults to `0.005`):
            Step of the closed-loop target, > 0.
        target_min (`float`, *optional*, defaults to `0.3`):
            Lowest target the closed loop may set, in (0, 1).
        target_max (`float`, *optional*, defaults to `0.7`):
            Highest target the closed loop may set, in (0, 1).
        vllm_lora_sync (`str`, *optional*, defaults to `"adapter"`):
            How a LoRA (peft) run updates vLLM: in ``vllm_mode="server"``, ``"adapter"`` pushes only the adapter
            (peft's files), which every server loads under a fresh name per push; requests name the adapter of the
            push they were queued after (:mod:`bapo_trl.generation.adapter_sync`; the servers need LoRA enabled:
            ``bapo serve MODEL --lora-rank R``). In colocate mode the in-process engine is built with LoRA enabled and
            loads each push's adapter the same way (not with ``vllm_enable_sleep_mode``, which pushes merged weights).
            ``"merged"`` merges it and pushes the full weights (TRL's way). Ignored without a peft model.
    """

    positive_contribution_target: float = field(
        default=SEARCH_DEFAULTS["positive_contribution_target"],
        metadata={"help": "BAPO target share rho0 of the loss held by positive-advantage tokens, in (0, 1)."},
    )
    ratio_lower_start: float | None = field(
        default=None, metadata={"help": "BAPO: start (widest) of the lower clipping bound c_low, in (0, 1]. Unset: "
                                "derived from your window (epsilon, epsilon_high, importance_sampling_level): "
                                "0.6 at TRL's defaults."}
    )
    ratio_lower_max: float | None = field(
        default=None, metadata={"help": "BAPO: largest value of the lower clipping bound c_low, in (0, 1]. Unset: "
                                "derived from your window (0.9 at TRL's defaults)."}
    )
    ratio_lower_step: float | None = field(
        default=None, metadata={"help": "BAPO: step of the lower bound, > 0. Unset: derived (0.02 at TRL's defaults)."}
    )
    ratio_upper_start: float | None = field(
        default=None, metadata={"help": "BAPO: start of the upper clipping bound c_high, >= 1. Unset: 1 + your "
                                "epsilon_high (or epsilon): 1.2 at TRL's defaults."}
    )
    ratio_upper_max: float | None = field(
        default=None, metadata={"help": "BAPO: largest value of the upper clipping bound c_high, >= 1. Unset: derived "
                                "from your window (3.0 at TRL's defaults)."}
    )
    ratio_upper_step: float | None = field(
        default=None, metadata={"help": "BAPO: step of the upper bound, > 0. Unset: derived (0.05 at TRL's defaults)."}
    )
    bapo_variant: str = field(
        default=SEARCH_DEFAULTS["bapo_variant"],
        metadata={
            "help": "BAPO search variant: 'paper' (Algorithm 1, c_high moves first) or 'verl' (official code: "
            "c_low first, pos/neg ratio target). The dual clip is `dual_clip`'s, for both.",
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
        default=SEARCH_DEFAULTS["positive_contribution_mode"],
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
        default=20.0,
        metadata={"help": "Clamp of the log importance ratio to the behaviour policy (official code: 20); "
                          "> log(ratio_upper_max). Beyond it TRL's whole loss reads the clamped ratio; not applied to "
                          "the KL term's reference log-ratio nor to the sampler's log-probs."},
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
    vllm_lora_sync: str = field(
        default="adapter",
        metadata={"help": "LoRA (peft) runs with vLLM: 'adapter' pushes only the adapter, which every server (or the "
                  "colocated engine) loads under a fresh name per push (start a server with `bapo serve MODEL "
                  "--lora-rank R`); 'merged' pushes merged full weights (TRL's way). Ignored without a peft model.",
                  "choices": list(LORA_SYNC_MODES)},
    )
    def __post_init__(self):
        self._derive_search_path()
        # Validate BAPO's own fields first: a bad value must fail before TrainingArguments sets up devices.
        self._refuse(self.bapo_errors())
        self.vllm_server_base_url = normalized_server_urls(self.vllm_server_base_url)  # several: a list
        super().__post_init__()
        self._refuse(self.whole_group_errors())
        # Settings that are valid one by one but under which something the user turned on can never act.
        inert = self.inert_settings()
        self._refuse([message for kind, message in inert if kind == "error"])
        for kind, message in inert:
            if kind in ("warning", "on-policy"):
                warnings.warn(f"BAPO: {message}", OnPolicyWarning if kind == "on-policy" else UserWarning,
                              stacklevel=2)

    def _refuse(self, errors: list[str]) -> None:
        """Raise every problem at once, under the config's own class name (a research config names itself)."""
        if errors:
            raise ValueError(f"Invalid {type(self).__name__}:\n  - " + "\n  - ".join(errors))

    def _derive_search_path(self) -> None:
        """The search path: the ``ratio_*`` fields you set, the window rule's values for the others
        (:mod:`bapo_trl.core.window_rule`), once per window (no per-step cost). The fields keep what you set (None
        where unset), so a config rebuilt from this one's values (``dataclasses.replace``, ``to_dict``, a saved
        YAML, a sweep over ``epsilon``) derives its own path again instead of inheriting this one's;
        :attr:`search_path_origin` says where the path comes from, for the run's plan."""
        key = self._window_key()
        path, origin = derived_path(self.loss_row.kind, self.epsilon, self.epsilon_high, key[3])
        mine = self.ratio_fields_set
        if len(mine) == len(RATIO_FIELDS):
            origin = "your ratio_* settings"
        elif mine:
            origin += f"; your {', '.join(mine)} override{'s' if len(mine) == 1 else ''} the rule"
        values = {name: getattr(self, name) if name in mine else path[name] for name in RATIO_FIELDS}
        self.__dict__["_search_path"] = (key, values, origin)  # not a field: never saved as yours

    def _window_key(self) -> tuple:
        """What the search path is derived from: the loss kind, the window, its level and your ``ratio_*`` fields."""
        level = self.importance_sampling_level if self.importance_sampling_level in WIDENING else "token"
        return (self.loss_row.kind, self.epsilon, self.epsilon_high, level,
                tuple(getattr(self, n) for n in RATIO_FIELDS))

    def _search_path_now(self) -> tuple:
        """``(key, values, origin)`` for the window the config holds now (derived again when it changed)."""
        cached = self.__dict__.get("_search_path")
        if cached is None or cached[0] != self._window_key():
            self._derive_search_path()
        return self.__dict__["_search_path"]

    @property
    def ratio_fields_set(self) -> tuple[str, ...]:
        """The ``ratio_*`` fields you set (they override the window rule)."""
        return tuple(name for name in RATIO_FIELDS if getattr(self, name) is not None)

    @property
    def search_path(self) -> dict[str, float]:
        """The six ``ratio_*`` values the search runs on: yours where set, the window rule's elsewhere."""
        return dict(self._search_path_now()[1])

    @property
    def search_path_origin(self) -> str:
        """Where :attr:`search_path` comes from, in words (the run's plan prints it)."""
        return self._search_path_now()[2]

    @property
    def effective_delta(self) -> float | None:
        """TRL's two-sided clip as BAPO's loss applies it: your ``delta``; else, with ``dual_clip`` and a clipped loss,
        the dual clip's ``max(3.0, ratio_upper_max)`` (installed in TRL's loss for each call, never written into
        ``delta``, so a config rebuilt from this one's values with ``dual_clip=False`` has none); else None."""
        if self.delta is not None or not (self.dual_clip and self.loss_row.takes_delta):
            return self.delta
        return max(DUAL_CLIP, self.search_path["ratio_upper_max"])

    def inert_settings(self) -> list[tuple[str, str]]:
        """``("error" | "warning" | "on-policy", message)`` for every setting that can never act in this combination
        (the table "Settings that would do nothing" of docs/configuration.md): the rollout settings' rows
        (:meth:`~bapo_trl.rollout.settings.RolloutSettings.inert_rollout_settings`), then the search's. Errors: a
        feature the user turned on would never act. Warnings: the run is legitimate but a setting is useless in it.
        Every row compares a setting with its field's declared default."""
        return self.inert_rollout_settings() + self._logging_rows() + self._loss_type_rows() + self._window_rows()

    def _window_rows(self) -> list[tuple[str, str]]:
        """Inert-setting rows of the search path (a research window with a path of its own replaces them)."""
        rows = []
        path = self.loss_row.path(self.bapo_settings)
        window = f"[{path.clip_low[0]}, {path.clip_high[0]}]"
        ratio = self.search_path
        if (self.bapo_variant == "paper" and len(path.low_grid) == 1
                and ratio["ratio_upper_max"] > ratio["ratio_upper_start"] and not path.negatives_on_high):
            rows.append(("warning", (
                "`ratio_lower_start` + `ratio_lower_step` exceeds `ratio_lower_max`, so the paper's search loop never "
                f"runs and `c_high` stays at `ratio_upper_start`: the window is fixed at {window}; "
                "`ratio_upper_max` and `ratio_upper_step` have no effect.")))
        if len(path) == 1:
            moved = [f"{name}={getattr(self, name)!r}" for name in
                     ("positive_contribution_target", "positive_contribution_mode", "target_entropy")
                     if getattr(self, name) != field_default(self, name)]
            if moved:
                rows.append(("warning", (
                    f"the search path has a single window {window}, so {', '.join(moved)} only matter(s) for a moving "
                    "search and has no effect: widen `ratio_upper_max` / `ratio_lower_max` or drop the setting.")))
        level = self.importance_sampling_level if self.importance_sampling_level in WIDENING else "token"
        if (self.loss_row.kind == "clip" and "ratio_lower_start" not in self.ratio_fields_set and is_real(self.epsilon)
                and self.epsilon > 0 and lower_is_clamped(self.epsilon, level)):
            rows.append(("warning", (
                f"your window's epsilon={self.epsilon} leaves no room to widen c_low below it ({level} ratios), so "
                f"c_low's search path is clamped to {ratio['ratio_lower_start']}..{ratio['ratio_lower_max']} "
                "(c_high keeps your window's bound); set `ratio_lower_start` / `ratio_lower_max` to choose it.")))
        window = [f"{name}={getattr(self, name)!r}" for name in ("epsilon", "epsilon_high")
                  if getattr(self, name) != field_default(self, name)]
        if len(self.ratio_fields_set) == len(RATIO_FIELDS) and window and self.loss_row.kind in ("clip", "cap"):
            rows.append(("warning", (
                f"{', '.join(window)} ha{'s' if len(window) == 1 else 've'} no effect: the six ratio_* fields you set "
                f"(a preset such as gspo_balanced() sets them all) are the whole search path, which starts at "
                f"[{ratio['ratio_lower_start']}, {ratio['ratio_upper_start']}] whatever your window. Leave the "
                "ratio_* fields unset for a path derived from your window, or drop the window fields.")))
        sampler_behaviour = [name for name, on in (("async_generation", self.async_generation), (
            f"generation_backend={self.generation_backend!r}", samples_for_every_source(self.generation_backend)))
            if on]
        is_settings = [f"{name}={getattr(self, name)!r}" for name in (
            "positive_contribution_is_weighted", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_clip_max") if hasattr(self, name) and getattr(self, name) != field_default(
            self, name)]
        if sampler_behaviour and is_settings:
            rows.append(("warning", (
                f"{', '.join(is_settings)} ha{'s' if len(is_settings) == 1 else 've'} no effect on the batches "
                f"{' and '.join(sampler_behaviour)} samples: their behaviour log-probs are the sampler's own, so "
                "TRL's importance-sampling weight is 1 there and the sampler's gap is in BAPO's ratio instead.")))
        elif self.positive_contribution_is_weighted and not (
                self.use_vllm and self.vllm_importance_sampling_correction):
            rows.append(("warning", (
                "`positive_contribution_is_weighted` only acts on TRL's vLLM importance-sampling weights, and this "
                f"run has none (use_vllm={self.use_vllm}, vllm_importance_sampling_correction="
                f"{self.vllm_importance_sampling_correction}): the share is measured unweighted.")))
        return rows

    def _logging_rows(self) -> list[tuple[str, str]]:
        """A run too short for its first log: no metric, summary or plot (the model is still trained and saved)."""
        strategy = getattr(self.logging_strategy, "value", self.logging_strategy)
        steps = self.logging_steps
        if strategy == "steps" and self.max_steps > 0 and steps >= 1 and steps > self.max_steps:
            return [("warning", (f"`logging_steps` ({steps:g}) exceeds `max_steps` ({self.max_steps}): no training "
                                 "step will be logged, so the run has no metric, summary or plot (it still trains and "
                                 "saves). Set `logging_steps` to at most max_steps, e.g. --logging_steps 1."))]
        return []

    @property
    def loss_row(self):
        """The loss type's row (:mod:`bapo_trl.core.loss_types`), whose share the trainer balances; the clipped
        surrogate's for an unknown one (refused). A research config whose trainer runs another loss returns its row."""
        return LOSS_TYPES.get(self.loss_type, LOSS_TYPES["dapo"])

    def _loss_type_rows(self) -> list[tuple[str, str]]:
        """Inert-setting rows of the loss type: its row's ``config_warnings`` (:mod:`bapo_trl.core.loss_checks`)."""
        return [("warning", text) for text in self.loss_row.config_warnings(self, self._loss_name)]

    @property
    def _loss_name(self) -> str:
        """How the loss's checks name it in a message: the config's ``loss_type`` (a research config whose trainer
        chooses the loss names that trainer)."""
        return f"loss_type={self.loss_type!r}"

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
        if self.vllm_lora_sync not in LORA_SYNC_MODES:
            errors.append(f"`vllm_lora_sync` must be one of {LORA_SYNC_MODES}, got {self.vllm_lora_sync!r}.")
        if self.use_liger_kernel:
            errors.append("`use_liger_kernel` must be False with BAPO (the Liger GRPO loss has a fixed window), got "
                          "True: set use_liger_kernel=False.")
        if self.loss_type in SUPPORTED_LOSS_TYPES:
            errors += self.loss_row.config_errors(self, self._loss_name)  # the row's own checks
        if not (isinstance(self.max_log_ratio, (int, float)) and math.isfinite(self.max_log_ratio)) or (
            not errors and self.max_log_ratio <= math.log(self.search_path["ratio_upper_max"])
        ):
            upper_max = self.search_path["ratio_upper_max"]
            log_upper_max = math.log(upper_max) if isinstance(upper_max, (int, float)) and upper_max > 0 else "n/a"
            errors.append(
                f"`max_log_ratio` must be a finite number > log(ratio_upper_max) = {log_upper_max}, "
                f"got {self.max_log_ratio!r}."
            )
        if self.target_entropy is not None:
            numbers = (self.target_entropy, self.target_adapt_rate, self.target_min, self.target_max)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
                errors.append(f"`target_entropy`, `target_adapt_rate`, `target_min`, `target_max` must be finite "
                              f"numbers, got {numbers}.")
            elif not (self.target_entropy > 0 and self.target_adapt_rate > 0
                      and 0 < self.target_min <= self.positive_contribution_target <= self.target_max < 1):
                errors.append(
                    "the closed-loop target needs `target_entropy` > 0, `target_adapt_rate` > 0 and "
                    "0 < `target_min` <= `positive_contribution_target` <= `target_max` < 1; got "
                    f"target_entropy={self.target_entropy}, target_adapt_rate={self.target_adapt_rate}, "
                    f"target_min={self.target_min}, positive_contribution_target={self.positive_contribution_target}, "
                    f"target_max={self.target_max}.")
        try:
            server_urls(self.vllm_server_base_url)
        except ValueError as exc:
            errors.append(str(exc))
        return errors + rollout_errors(self)

    def _settings_dict(self) -> dict:
        """The search settings as set; ``delta`` (TRL's field, checked in :meth:`bapo_errors`) joins in
        :attr:`bapo_settings`."""
        return {**{name: getattr(self, name) for name in BAPOSettings.__dataclass_fields__ if name != "delta"},
                **self.search_path}

    @property
    def bapo_settings(self) -> BAPOSettings:
        """The search settings as the frozen object :func:`bapo_trl.search_clip_bounds` takes. With a clipped loss
        and ``delta`` set, the settings carry it (the gradient share leaves out the negatives above it, which TRL's
        two-sided clip gives no gradient), and below ``ratio_upper_max`` the upper path ends at ``delta`` (TRL caps
        every ratio there). Other loss types ignore ``delta``, as TRL does."""
        settings = self._settings_dict()
        delta = self.effective_delta
        if self.loss_row.takes_delta and delta is not None:
            settings["delta"] = delta
            settings["ratio_upper_max"] = min(settings["ratio_upper_max"], delta)
        return BAPOSettings(**settings)



def run_name(model) -> str:
    """The last part of a model's name or path (a trainer's default output folder starts with it, as TRL's)."""
    name = model if isinstance(model, str) else model.config.name_or_path
    return name.split("/")[-1]


def trainer_config(args, model) -> BAPOConfig:
    """``BAPOTrainer``'s ``args``: TRL's default when None (``<model name>-BAPO``), a clear error for a GRPOConfig."""
    if args is None:
        return BAPOConfig(f"{run_name(model)}-BAPO")
    if not isinstance(args, BAPOConfig):
        raise TypeError(
            f"BAPOTrainer needs `args` to be a BAPOConfig, got {type(args).__name__}. BAPOConfig takes every "
            "GRPOConfig field unchanged: replace `GRPOConfig(...)` by `BAPOConfig(...)` (from bapo_trl import "
            "BAPOConfig); BAPO then searches the clipping window around yours (`epsilon`, `epsilon_high`, "
            "`importance_sampling_level`; the paper's path c_low 0.6..0.9, c_high 1.2..3.0 at TRL's defaults).")
    return args
