"""What GMPO's loss never reads, refused or warned of in a config: GMPO's row's checks
(:data:`~.geometric_mean.GEOMETRIC_MEAN`, ``config_errors`` / ``config_warnings``), which
:class:`~.config.GMPOBAPOConfig` runs when it is built, before TRL loads anything."""

from __future__ import annotations

from ...trainer.bapo_config import BAPOConfig


def gmpo_config_errors(args, name: str) -> list[str]:
    """The config fields GMPO's loss never reads, set to something that would need it."""
    errors = []
    if args.loss_type != BAPOConfig.__dataclass_fields__["loss_type"].default:
        errors.append(f"`loss_type` ({args.loss_type!r}) has no effect with {name}: GMPO's loss replaces "
                      "TRL's loss types. Drop it.")
    if args.importance_sampling_level != "token":
        errors.append(f"`importance_sampling_level` must be 'token' with {name}, got "
                      f"{args.importance_sampling_level!r}: GMPO's ratio is the geometric mean of the token ratios.")
    if args.off_policy_mask_threshold is not None:
        errors.append(f"`off_policy_mask_threshold` ({args.off_policy_mask_threshold}) has no effect in GMPO's loss "
                      "(TRL's GMPOTrainer does not apply it): drop it.")
    window_set = args.epsilon != BAPOConfig.__dataclass_fields__["epsilon"].default or args.epsilon_high is not None
    if window_set:
        errors.append(f"`epsilon` ({args.epsilon}) / `epsilon_high` ({args.epsilon_high}) have no effect with {name}: "
                      "GMPO reads its epsilons as log-space bounds, and BAPO chooses them from the ratio_* path "
                      "(by default TRL's documented GMPO window exp(+-0.4), then wider). Drop them; set "
                      "`ratio_upper_start` / `ratio_lower_start` (ratios) for another start.")
    return errors


def gmpo_config_warnings(args, name: str) -> list[str]:
    """Fields GMPO's loss never reads, left at a value that would act in another loss (they change nothing here)."""
    rows = []
    if args.effective_delta is not None:
        rows.append(f"`delta` ({args.effective_delta}, the dual clip's) has no effect with {name}: GMPO's loss has no "
                    "two-sided clip, and its search path ignores it. Pass dual_clip=False (gmpo_balanced() does).")
    if args.positive_contribution_is_weighted:
        rows.append(f"`positive_contribution_is_weighted` has no effect with {name}: GMPO's loss does not "
                    "apply TRL's vLLM importance-sampling weights, so neither does its share.")
    return rows
