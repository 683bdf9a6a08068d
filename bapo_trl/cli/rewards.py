"""Reward functions by name for ``bapo train`` / ``train_bapo.py``: the general registry
(:mod:`bapo_trl.recipes.reward_funcs`: the toy task's reward, TRL's own rewards) and the math recipe's
(:mod:`bapo_trl.recipes.math_reasoning.rewards`), or dotted import paths."""

from __future__ import annotations

from typing import Callable

from ..recipes import reward_funcs
from ..recipes.math_reasoning import rewards as math_rewards  # names and loaders only: nothing heavy is imported
from ..trainer.reward_errors import RewardFunctionError, name_errors  # noqa: F401  (re-exported with the registry)

#: name -> zero-argument loader (lazy, so optional dependencies such as math-verify load only when used).
REWARD_FUNCS: dict[str, Callable[[], Callable]] = {**reward_funcs.REWARD_FUNCS, **math_rewards.REWARD_FUNCS}


def resolve_reward_funcs(names: list[str]) -> list[Callable]:
    """Registry names or dotted import paths (``pkg.module.func``) -> callables, with a clear error otherwise."""
    return reward_funcs.resolve(names, REWARD_FUNCS)
