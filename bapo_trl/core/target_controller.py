"""A closed-loop positive-share target (experimental): moves rho0 toward a target policy entropy.

Why: BAPO's window keeps positive tokens at a share rho0 of the loss; the Entropy-Clip Rule says letting more
low-probability positives through raises entropy. So, in the spirit of TRL's adaptive entropy coefficient, after
every update (optimizer step: all its micro-batches, :meth:`TargetController.observe`, then one
:meth:`TargetController.step`) the controller raises rho0 by ``rate`` while the update's mean entropy is below
``target_entropy`` and lowers it while above, within ``[low, high]``. It acts on the reduced (all-process) entropy,
so every rank holds the same rho0; its state is saved with the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TargetController:
    target_entropy: float
    rate: float
    low: float
    high: float
    value: float  # the current rho0
    _entropy: list[float] = field(default_factory=lambda: [0.0, 0.0])  # this update's entropy sum and tokens

    def observe(self, entropy_sum: float, tokens: float) -> None:
        """One micro-batch of the current update (sums over all processes)."""
        self._entropy[0] += entropy_sum
        self._entropy[1] += tokens

    def step(self) -> float:
        """The update is over: one step on its mean entropy (none when it had no token); returns the new rho0."""
        total, tokens = self._entropy
        self._entropy = [0.0, 0.0]
        return self.update(total / tokens) if tokens else self.value

    def update(self, entropy: float) -> float:
        """One step toward the target entropy; returns the new rho0 (unchanged when ``entropy`` is NaN)."""
        if entropy == entropy:  # not NaN
            step = self.rate if entropy < self.target_entropy else -self.rate if entropy > self.target_entropy else 0.0
            self.value = min(self.high, max(self.low, self.value + step))
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
