"""``BAPOGMPOTrainer``: BAPO's window search on TRL's experimental GMPO loss (geometric-mean policy optimisation).

Why a class and not a ``loss_type``: TRL ships GMPO as a trainer of its own (``trl.experimental.gmpo.GMPOTrainer``,
a ``GRPOTrainer`` subclass whose ``_compute_loss`` reads ``epsilon_low`` / ``epsilon_high`` as log-space bounds).
This class puts ``BAPOTrainer`` in front of it: TRL's GMPO loss runs as TRL wrote it, BAPO's loss hook installs the
window it chose (as ``epsilon_low = -log c_low``, ``epsilon_high = log c_high``) before that loss reads it, and the
search balances GMPO's own share (:mod:`.geometric_mean`). Everything else is ``BAPOTrainer``'s.

Its config is :class:`~.config.GMPOBAPOConfig` (GMPO's search path as defaults; what GMPO's loss never reads refused
there, by name, before TRL loads anything).
"""

from __future__ import annotations

import warnings

from ...trainer.bapo_config import run_name
from ...trainer.bapo_trainer import BAPOTrainer
from ...trainer.trl_seams import GMPO_SEAMS, check_trl_seams
from .config import GMPOBAPOConfig

with warnings.catch_warnings():  # TRL's notice that trl.experimental is experimental: this class is named for it
    warnings.simplefilter("ignore")
    from trl.experimental.gmpo import GMPOTrainer

check_trl_seams(GMPO_SEAMS)  # GMPO is experimental in TRL: a release that moves it fails here, by name


class BAPOGMPOTrainer(BAPOTrainer, GMPOTrainer):
    """TRL's GMPO with BAPO's adaptive window on the log-ratio clip. Takes ``BAPOTrainer``'s arguments (``args`` a
    :class:`~.config.GMPOBAPOConfig`; None: its defaults, which start the window at GMPO's documented one)."""

    _tag_names = ["trl", "gmpo", "bapo"]
    _name = "BAPO-GMPO"

    def __init__(self, model, reward_funcs=None, args: GMPOBAPOConfig | None = None, **kwargs):
        if args is None:
            args = GMPOBAPOConfig(f"{run_name(model)}-BAPO-GMPO")
        if not isinstance(args, GMPOBAPOConfig):
            raise TypeError(f"BAPOGMPOTrainer needs `args` to be a GMPOBAPOConfig, got {type(args).__name__}. It "
                            "takes BAPOConfig's fields and starts the search at TRL's documented GMPO window: "
                            "GMPOBAPOConfig(output_dir, ...) (from bapo_trl.experimental.gmpo import "
                            "GMPOBAPOConfig); BAPO chooses epsilon/epsilon_high itself.")
        super().__init__(model, reward_funcs, args=args, **kwargs)
