"""What each loss type's row refuses or warns of in a config, as functions of the config's fields: a loss type's
checks live with its row (:mod:`.loss_types`), so a new loss variant is one row, and the config switches on no loss
type or kind. Each takes ``(args, name)``: the config (read by field name; no import of it here) and the
``loss_type=...`` text the messages use (the search path's values are ``args.search_path``, the user's ``ratio_*``
fields overlaid on the window rule's); it returns messages (errors: ``list[str]``; warnings: ``list[str]``)."""

from __future__ import annotations

from .clipping import is_real

LOWER_FIELDS = ("ratio_lower_start", "ratio_lower_max", "ratio_lower_step")


def _numbers_ok(args) -> bool:
    return all(is_real(args.search_path[n]) for n in ("ratio_upper_start", "ratio_upper_max", "ratio_lower_max"))


def no_problems(args, name: str) -> list[str]:
    return []


def capped_errors(args, name: str) -> list[str]:
    """CISPO: TRL reads ``epsilon_high`` (or ``epsilon`` when it is unset) as the cap on the importance weight itself,
    so a cap not above 1 clips every on-policy weight (1) down to it. BAPO's cap path starts above 1, so it could
    not train TRL's gradient there: refused, naming TRL's documented value."""
    cap = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if is_real(cap) and cap > 1:
        return []
    read = f"epsilon_high={cap!r}" if args.epsilon_high is not None else f"epsilon_high unset, read as epsilon={cap!r}"
    return [f"{name} needs `epsilon_high` > 1: TRL's CISPO caps the importance weight itself at epsilon_high (the "
            f"ScaleRL paper's eps_max; TRL documents 5.0), and with {read} every on-policy weight (1) would be capped "
            "below 1. Set epsilon_high, e.g. epsilon_high=5.0."]


def window_errors(args, name: str) -> list[str]:
    """The clipped losses: TRL's window ``[1 - epsilon, 1 + epsilon_high]``, which the search path starts at, must be
    a window (TRL itself checks neither)."""
    errors = []
    if not (is_real(args.epsilon) and args.epsilon > 0):
        errors.append(f"`epsilon` must be a number > 0 with {name} (the lower half-width of TRL's window "
                      f"[1 - epsilon, 1 + epsilon_high], where BAPO's search starts), got {args.epsilon!r}.")
    if args.epsilon_high is not None and not (is_real(args.epsilon_high) and args.epsilon_high > 0):
        errors.append(f"`epsilon_high` must be a number > 0 with {name} (the upper half-width of TRL's window), or "
                      f"unset to take epsilon's, got {args.epsilon_high!r}.")
    return errors


def clipped_errors(args, name: str) -> list[str]:
    """The clipped losses: a window (:func:`window_errors`), and TRL's two-sided clip ``delta`` must leave the
    search's first ``c_high`` room to act."""
    errors = window_errors(args, name)
    if errors:
        return errors
    start = args.search_path["ratio_upper_start"]
    if args.delta is None or not _numbers_ok(args) or (is_real(args.delta) and args.delta >= start):
        return []
    return [f"`delta` ({args.delta}) must be >= `ratio_upper_start` ({start}) with BAPO: TRL caps every ratio at "
            "delta, so no c_high of the search path could act. Raise `delta` or lower `ratio_upper_start`."]


def clipped_warnings(args, name: str) -> list[str]:
    upper_max = args.search_path["ratio_upper_max"]
    if args.delta is None or not args.delta < upper_max:
        return []
    return [f"`delta` ({args.delta}) is below `ratio_upper_max` ({upper_max}): TRL's two-sided clip caps every "
            "ratio at delta, so a c_high above it would change nothing; the upper search path ends at "
            f"{min(upper_max, args.delta)} (paper: the last step <= delta; verl: delta itself). Raise `delta` to >= "
            "`ratio_upper_max` for the full path, or set `ratio_upper_max` to delta to silence this warning."]


def _unclipped_warnings(args, name: str) -> list[str]:
    """A loss without TRL's two-sided clip, where every token keeps a gradient."""
    rows = []
    if args.delta is not None:
        rows.append(f"`delta` ({args.delta}) has no effect with {name}: TRL applies it to the clipped losses only. "
                    "Drop `delta`.")
    if args.positive_contribution_mode != "value":
        rows.append(f"`positive_contribution_mode` ({args.positive_contribution_mode!r}) has no effect with {name}: "
                    "every token keeps a gradient, so the value and the gradient share are one (the share of the "
                    "weight each token's gradient carries; docs/loss_types.md).")
    return rows


def capped_warnings(args, name: str) -> list[str]:
    """CISPO: a cap from above only."""
    rows = _unclipped_warnings(args, name)
    if any(field in args.ratio_fields_set for field in LOWER_FIELDS):
        rows.append(f"`ratio_lower_start`/`ratio_lower_max`/`ratio_lower_step` have no effect with {name}: CISPO "
                    "caps the importance weight from above only (c_high is the cap; bapo/clip_low is 0, no lower "
                    "bound). Drop them.")
    return rows


def gate_errors(args, name: str) -> list[str]:
    """The soft gates: each sign's sharpness is read off its half-width relative to the start's."""
    if not _numbers_ok(args):
        return []
    errors, start, lower_max = [], args.search_path["ratio_upper_start"], args.search_path["ratio_lower_max"]
    if not start > 1.0:
        errors.append(f"`ratio_upper_start` must be > 1 with {name} (the positive gate's sharpness is "
                      f"(ratio_upper_start - 1) / (c_high - 1)), got {start}: use e.g. 1.2.")
    if not lower_max < 1.0:
        errors.append(f"`ratio_lower_max` must be < 1 with {name} (the negative gate's sharpness is "
                      f"(1 - ratio_lower_start) / (1 - c_low)), got {lower_max}: use e.g. 0.9.")
    return errors


def sapo_errors(args, name: str) -> list[str]:
    errors = gate_errors(args, name)
    for field in ("sapo_temperature_pos", "sapo_temperature_neg"):
        value = getattr(args, field)
        if not (is_real(value) and value > 0):
            errors.append(f"`{field}` must be a finite number > 0 with BAPO (the start of the gate's path, scaled "
                          f"along it), got {value!r}.")
    return errors


#: The ``vllm_importance_sampling_mode`` values TRL's VESPO accepts with vLLM (token-level: VESPO folds the weights
#: into its own sequence weight); TRL refuses the others in its trainer, after the model has loaded.
VESPO_VLLM_MODES = ("token_truncate", "token_mask")


def vespo_errors(args, name: str) -> list[str]:
    """VESPO: the gates' checks, and TRL's refusal of a sequence-level vLLM correction, made at construction."""
    errors = gate_errors(args, name)
    if (args.use_vllm and args.vllm_importance_sampling_correction
            and args.vllm_importance_sampling_mode not in VESPO_VLLM_MODES):
        errors.append(f"`vllm_importance_sampling_mode` must be one of {VESPO_VLLM_MODES} with {name} and vLLM "
                      f"(TRL's VESPO requires a token-level correction), got {args.vllm_importance_sampling_mode!r}: "
                      "set vllm_importance_sampling_mode='token_truncate', or "
                      "vllm_importance_sampling_correction=False.")
    return errors


gate_warnings = _unclipped_warnings


def vespo_warnings(args, name: str) -> list[str]:
    """VESPO folds TRL's vLLM importance-sampling weights into its sequence weight."""
    rows = _unclipped_warnings(args, name)
    if args.positive_contribution_is_weighted:
        rows.append(f"`positive_contribution_is_weighted` has no effect with {name}: TRL folds the vLLM "
                    "importance-sampling weights into the sequence weight w, and the search always measures the "
                    "share on that w.")
    return rows
