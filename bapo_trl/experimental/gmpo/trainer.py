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
from ...trainer.bapo_config import BAPOConfig, run_name
from ...trainer.bapo_trainer import BAPOTrainer
from ...trainer.trl_seams import GMPO_SEAMS, check_trl_seams
from .geometric_mean import GEOMETRIC_MEAN
from .presets import gmpo_balanced

with warnings.catch_warnings():  # TRL's notice that trl.experimental is experimental: this class is named for it
    warnings.simplefilter("ignore")
    from trl.experimental.gmpo import GMPOTrainer

check_trl_seams(GMPO_SEAMS)  # GMPO is experimental in TRL: a release that moves it fails here, by name


class BAPOGMPOTrainer(BAPOTrainer, GMPOTrainer):
    """TRL's GMPO with BAPO's adaptive window on the log-ratio clip. Takes ``BAPOTrainer``'s arguments (``args`` a
    :class:`BAPOConfig`; None: ``BAPOConfig(**gmpo_balanced())``, which starts the window at GMPO's documented one)."""

    _tag_names = ["trl", "gmpo", "bapo"]
    _name = "BAPO-GMPO"
    loss_row = GEOMETRIC_MEAN

    def __init__(self, model, reward_funcs=None, args: BAPOConfig | None = None, **kwargs):
        if args is None:
            args = BAPOConfig(f"{run_name(model)}-BAPO-GMPO", **gmpo_balanced())
        if not isinstance(args, BAPOConfig):
            raise TypeError(f"BAPOGMPOTrainer needs `args` to be a BAPOConfig, got {type(args).__name__}. For TRL's "
                            "GMPO window as the search's start: BAPOConfig(..., **gmpo_balanced()) (from bapo_trl "
                            "import gmpo_balanced); BAPO chooses epsilon/epsilon_high itself.")
        errors = self.loss_row.config_errors(args, "BAPOGMPOTrainer")  # GMPO's row: what its loss never reads
        if errors:
            raise ValueError("BAPOGMPOTrainer:\n  - " + "\n  - ".join(errors))
        for row in self.loss_row.config_warnings(args, "BAPOGMPOTrainer"):
            warnings.warn(row, UserWarning, stacklevel=2)
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # the path GMPO's loss can use: without the dual clip's delta, which would otherwise end c_high's path there
        self._base_settings = BAPOSettings(**args._settings_dict())
