"""``LengthFairBAPOTrainer``: ``BAPOTrainer`` whose window is one per sequence, as wide as the noise of the sequence's
own mean log-ratio (:mod:`.search`). It overrides one hook, the window a micro-batch gets."""

from __future__ import annotations

import dataclasses
from functools import partial

from ...core.loss_types import token_log_ratio
from ...core.numerics import loss_mask
from ...trainer.bapo_config import run_name
from ...trainer.bapo_trainer import BAPOTrainer
from ...trainer.loss_hook import WindowChoice
from .config import LengthFairBAPOConfig
from .metrics import length_fair_values
from .presets import gspo_length_fair
from .search import length_fair_choice, length_fair_path


class LengthFairBAPOTrainer(BAPOTrainer):
    """BAPO's balance with the length-fair window. Takes ``BAPOTrainer``'s arguments with ``args`` a
    :class:`LengthFairBAPOConfig` (None: ``LengthFairBAPOConfig(**gspo_length_fair())``)."""

    _tag_names = ["trl", "grpo", "bapo", "length-fair"]
    _name = "BAPO-length-fair"

    def __init__(self, model, reward_funcs=None, args: LengthFairBAPOConfig | None = None, **kwargs):
        if args is None:
            args = LengthFairBAPOConfig(f"{run_name(model)}-BAPO-length-fair", **gspo_length_fair())
        if not isinstance(args, LengthFairBAPOConfig):
            raise TypeError(f"LengthFairBAPOTrainer needs `args` to be a LengthFairBAPOConfig, got "
                            f"{type(args).__name__}: LengthFairBAPOConfig(..., **gspo_length_fair()) (from "
                            "bapo_trl.experimental.length_fair import LengthFairBAPOConfig, gspo_length_fair).")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self._length_fair_base = args.length_fair_settings

    @property
    def _length_fair_settings(self):
        """The length-fair search's settings, with the closed-loop target's rho0 when it is on."""
        if self.target_controller is None:
            return self._length_fair_base
        return dataclasses.replace(self._length_fair_base, positive_contribution_target=self.target_controller.value)

    def _choose_window(self, logps, inputs, mask, ratio, advantages) -> WindowChoice:
        """Every sequence's window (sums reduced over all processes): the chosen widths (``result.clip_low`` /
        ``clip_high`` are ``k_low``/``k_high``) and the per-sequence bounds TRL's loss clips with. The band's
        statistics are taken over TRL's loss mask (its sequence mean's)."""
        settings = self._length_fair_settings
        result, window = length_fair_choice(token_log_ratio(logps, inputs), advantages, mask, settings,
                                            self.port.sum_over_processes, statistics_mask=loss_mask(inputs))
        return WindowChoice(result, length_fair_path(settings), window.bounds(),
                            partial(length_fair_values, window=window))
