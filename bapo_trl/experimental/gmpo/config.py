"""``GMPOBAPOConfig``: ``BAPOConfig`` whose defaults are GMPO's search path and whose checks are GMPO's loss's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.clipping import BAPOSettings
from ...trainer.bapo_config import BAPOConfig
from .geometric_mean import GEOMETRIC_MEAN
from .presets import gmpo_balanced

_PATH = gmpo_balanced()


def _path(name: str, help: str):
    return field(default=_PATH[name], metadata={"help": f"GMPO's search path: {help}"})


@dataclass
class GMPOBAPOConfig(BAPOConfig):
    r"""
    Configuration for [`BAPOGMPOTrainer`] (a research candidate: BAPO's window on TRL's experimental GMPO loss; it
    tied GMPO in the studies of docs/results.md). Its defaults are :func:`~.presets.gmpo_balanced`: the search starts
    at TRL's documented GMPO window ``[exp(-0.4), exp(0.4)]`` and widens it as BAPO's default path does (``c_high`` up
    to 3.0 in 37 points, ``c_low`` up to 0.9 in 16), token-level ratios (GMPO's own), no dual clip (GMPO's loss has no
    two-sided clip). The window reaches GMPO's loss as ``epsilon_low = -log c_low``, ``epsilon_high = log c_high``.

    What GMPO's loss never reads is refused by name when the config is built (before TRL loads anything): a
    ``loss_type``, sequence-level ratios, ``off_policy_mask_threshold``, ``epsilon`` / ``epsilon_high`` (the window
    is the ``ratio_*`` path's); ``delta`` and ``positive_contribution_is_weighted`` warn (they change nothing here).
    """

    dual_clip: bool = field(default=False, metadata={"help": "GMPO's loss has no two-sided clip: off (a True warns)."})
    ratio_upper_start: float | None = _path("ratio_upper_start", "first c_high, TRL's documented exp(0.4).")
    ratio_upper_max: float | None = _path("ratio_upper_max", "largest c_high.")
    ratio_upper_step: float | None = _path("ratio_upper_step", "step of c_high (37 points).")
    ratio_lower_start: float | None = _path("ratio_lower_start", "first c_low, TRL's documented exp(-0.4).")
    ratio_lower_max: float | None = _path("ratio_lower_max", "largest c_low.")
    ratio_lower_step: float | None = _path("ratio_lower_step", "step of c_low (16 points).")

    @property
    def loss_row(self):
        """GMPO's row (:data:`~.geometric_mean.GEOMETRIC_MEAN`): its checks are this config's."""
        return GEOMETRIC_MEAN

    @property
    def _loss_name(self) -> str:
        return "BAPOGMPOTrainer"

    @property
    def bapo_settings(self) -> BAPOSettings:
        """The search settings without ``delta``: GMPO's loss has no two-sided clip, so the path never ends there."""
        return BAPOSettings(**self._settings_dict())
