"""``LengthFairBAPOConfig``: ``BAPOConfig`` plus the band fields of the length-fair window (:mod:`.search`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.window_rule import RATIO_FIELDS
from ...trainer.bapo_config import BAPOConfig
from ...trainer.presets import GSPO_DOCUMENTED
from .presets import GSPO_BAND
from .search import LengthFairSettings, band_errors


def _band(name: str, help: str):
    return field(default=GSPO_BAND[name], metadata={"help": f"length-fair window: {help}"})


@dataclass
class LengthFairBAPOConfig(BAPOConfig):
    r"""
    Configuration for [`LengthFairBAPOTrainer`] (a research candidate: it tied or lost to ``gspo_balanced()`` in the
    studies of docs/results.md): each sequence's ratio ``R = exp(mean log r)`` is clipped in
    ``log R in [-k_low b, k_high b]``, ``b`` the standard error of the sequence's mean token log-ratio
    (``sd / sqrt(L)``, at least ``band_floor``), so a short answer's noisy mean is not clipped more than a long one's;
    the search chooses ``k_high`` (from ``band_upper_start`` up to ``band_upper_max``), then ``k_low`` (from
    ``band_lower_start`` down to ``band_lower_min``) for the positive share. Needs ``importance_sampling_level=
    "sequence"`` and a clipped loss; the ``ratio_*`` fields do not act. Logged: ``bapo/band_upper``,
    ``bapo/band_lower`` (the widths) and ``bapo/clip_low``/``bapo/clip_high`` (the sequences' mean window).
    Defaults: the band the studies kept (:data:`~.presets.GSPO_BAND`).
    """

    band_upper_start: float = _band("band_upper_start", "start of k_high, > 0. Reset for every update.")
    band_upper_max: float = _band("band_upper_max", "largest k_high, >= band_upper_start.")
    band_upper_step: float = _band("band_upper_step", "step of k_high, > 0.")
    band_lower_start: float = _band("band_lower_start", "start (widest) of k_low, > 0. Reset for every update.")
    band_lower_min: float = _band("band_lower_min", "narrowest k_low, <= band_lower_start.")
    band_lower_step: float = _band("band_lower_step", "step of k_low, > 0.")
    band_floor: float = field(default=GSPO_DOCUMENTED["epsilon"], metadata={
        "help": "length-fair window: the smallest band unit b (a one-token sequence or on-policy data has sd = 0), "
                "> 0: GSPO's documented epsilon. The window at the floor is k times it (about 1e-6 wide at the "
                "default band's start)."})

    def bapo_errors(self) -> list[str]:
        errors = super().bapo_errors() + band_errors(**self._band_dict())
        if self.importance_sampling_level != "sequence":
            errors.append(f"the length-fair window clips each sequence's ratio: it needs "
                          f"`importance_sampling_level='sequence'` (GSPO's ratio), got "
                          f"{self.importance_sampling_level!r}.")
        if not self.loss_row.takes_delta:  # a clipped loss
            errors.append(f"the length-fair window needs a clipped loss (grpo, bnpo, dr_grpo, dapo, luspo), "
                          f"got loss_type={self.loss_type!r}.")
        return errors

    def _window_rows(self) -> list[tuple[str, str]]:
        """The ratio path's fields do not act here: the window's path is the band's."""
        moved = [f"`{n}`" for n in RATIO_FIELDS if n in self.ratio_fields_set]
        moved += ["`bapo_variant`"] if self.bapo_variant != BAPOConfig.__dataclass_fields__["bapo_variant"].default \
            else []
        if not moved:
            return []
        verb, drop = ("has", "it") if len(moved) == 1 else ("have", "them")
        return [("warning", f"{', '.join(moved)} {verb} no effect: the length-fair window's path is "
                            f"band_upper_*/band_lower_*. Drop {drop}.")]

    def _band_dict(self) -> dict:
        return {name: getattr(self, name) for name in LengthFairSettings.__dataclass_fields__
                if name.startswith("band_")}

    @property
    def length_fair_settings(self) -> LengthFairSettings:
        """The length-fair search's settings (``delta`` as :attr:`bapo_settings` takes it)."""
        return LengthFairSettings(**self._band_dict(), positive_contribution_target=self.positive_contribution_target,
                                  positive_contribution_mode=self.positive_contribution_mode,
                                  delta=self.effective_delta if self.loss_row.takes_delta else None)
