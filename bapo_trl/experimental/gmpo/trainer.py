"""``BAPOGMPOTrainer``: BAPO's window search on TRL's experimental GMPO loss (geometric-mean policy optimisation).

Why a class and not a ``loss_type``: TRL ships GMPO as a trainer of its own (``trl.experimental.gmpo.GMPOTrainer``,
a ``GRPOTrainer`` subclass whose ``_compute_loss`` reads ``epsilon_low`` / ``epsilon_high`` as log-space bounds).
This class puts ``BAPOTrainer`` in front of it: TRL's GMPO loss runs as TRL wrote it, BAPO's loss hook installs the
window it chose (as ``epsilon_low = -log c_low``, ``epsilon_high = log c_high``) before that loss reads it, and the
search balances GMPO's own share (:mod:`.geometric_mean`). Everything else is ``BAPOTrainer``'s.

What GMPO's loss never reads is refused here, by name, before TRL loads anything: sequence-level ratios (GMPO's
ratio is already its geometric mean), another candidate's config, TRL's off-policy mask (GMPO's loss does not apply it,
so the search would balance tokens the loss keeps). The dual clip's ``delta`` is left out of the path (GMPO has no
two-sided clip); TRL's vLLM importance-sampling weights are not in GMPO's loss, nor in its share.
"""

from __future__ import annotations

import warnings

from ...core.clipping import BAPOSettings
from ...core.window_rule import RATIO_FIELDS
from ...trainer.bapo_config import BAPOConfig
from ...trainer.bapo_trainer import BAPOTrainer
from ...trainer.trl_seams import GMPO_SEAMS, check_trl_seams
from .geometric_mean import GEOMETRIC_MEAN
from .presets import gmpo_balanced

with warnings.catch_warnings():  # TRL's notice that trl.experimental is experimental: this class is named for it
    warnings.simplefilter("ignore")
    from trl.experimental.gmpo import GMPOTrainer

check_trl_seams(GMPO_SEAMS)  # GMPO is experimental in TRL: a release that moves it fails here, by name


def gmpo_errors(args: BAPOConfig) -> list[str]:
    """The config fields GMPO's loss never reads, set to something that would need it."""
    errors = []
    if type(args) is not BAPOConfig:
        errors.append(f"`args` must be a BAPOConfig, got {type(args).__name__}: another research window or "
                      "correction does not combine with GMPO's loss.")
    if args.loss_type != BAPOConfig.__dataclass_fields__["loss_type"].default:
        errors.append(f"`loss_type` ({args.loss_type!r}) has no effect with BAPOGMPOTrainer: GMPO's loss replaces "
                      "TRL's loss types. Drop it.")
    if args.importance_sampling_level != "token":
        errors.append(f"`importance_sampling_level` must be 'token' with BAPOGMPOTrainer, got "
                      f"{args.importance_sampling_level!r}: GMPO's ratio is the geometric mean of the token ratios.")
    if args.off_policy_mask_threshold is not None:
        errors.append(f"`off_policy_mask_threshold` ({args.off_policy_mask_threshold}) has no effect in GMPO's loss "
                      "(TRL's GMPOTrainer does not apply it): drop it.")
    derived = [name for name in RATIO_FIELDS if name not in args.ratio_fields_set]
    window_set = args.epsilon != BAPOConfig.__dataclass_fields__["epsilon"].default or args.epsilon_high is not None
    if derived and window_set:
        errors.append(f"`epsilon` ({args.epsilon}) / `epsilon_high` ({args.epsilon_high}) with BAPOGMPOTrainer: "
                      "BAPOConfig derives the unset ratio_* fields from a window [1 - epsilon, 1 + epsilon_high], "
                      "while GMPO reads its epsilons as log-space bounds [exp(-epsilon), exp(epsilon_high)]. Set the "
                      "ratio_* fields instead: **gmpo_balanced() starts at TRL's documented GMPO window exp(+-0.4).")
    return errors


def gmpo_warnings(args: BAPOConfig) -> list[str]:
    """Fields GMPO's loss never reads, left at a value that would act in another loss (they change nothing here)."""
    rows = []
    if args.delta is not None:
        rows.append(f"`delta` ({args.delta}, the dual clip's) has no effect with BAPOGMPOTrainer: GMPO's loss has no "
                    "two-sided clip, and its search path ignores it. Pass dual_clip=False (gmpo_balanced() does).")
    if args.positive_contribution_is_weighted:
        rows.append("`positive_contribution_is_weighted` has no effect with BAPOGMPOTrainer: GMPO's loss does not "
                    "apply TRL's vLLM importance-sampling weights, so neither does its share.")
    return rows


class BAPOGMPOTrainer(BAPOTrainer, GMPOTrainer):
    """TRL's GMPO with BAPO's adaptive window on the log-ratio clip. Takes ``BAPOTrainer``'s arguments (``args`` a
    :class:`BAPOConfig`; None: ``BAPOConfig(**gmpo_balanced())``, which starts the window at GMPO's documented one)."""

    _tag_names = ["trl", "gmpo", "bapo"]
    _name = "BAPO-GMPO"
    loss_row = GEOMETRIC_MEAN

    def __init__(self, model, reward_funcs=None, args: BAPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config.name_or_path
            args = BAPOConfig(f"{name.split('/')[-1]}-BAPO-GMPO", **gmpo_balanced())
        if not isinstance(args, BAPOConfig):
            raise TypeError(f"BAPOGMPOTrainer needs `args` to be a BAPOConfig, got {type(args).__name__}. For TRL's "
                            "GMPO window as the search's start: BAPOConfig(..., **gmpo_balanced()) (from bapo_trl "
                            "import gmpo_balanced); BAPO chooses epsilon/epsilon_high itself.")
        errors = gmpo_errors(args)
        if errors:
            raise ValueError("BAPOGMPOTrainer:\n  - " + "\n  - ".join(errors))
        for row in gmpo_warnings(args):
            warnings.warn(row, UserWarning, stacklevel=2)
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # the path GMPO's loss can use: without the dual clip's delta, which would otherwise end c_high's path there
        self._base_settings = BAPOSettings(**args._settings_dict())
