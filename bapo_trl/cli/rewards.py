"""Reward functions by name for ``train_bapo.py``: a small registry, TRL's own rewards where they exist."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable

from ..math_recipe.rewards import SOFT_OVERLONG  # names only: a plain dict, nothing heavy is imported
from ..reward_errors import RewardFunctionError, name_errors  # noqa: F401  (re-exported with the registry)


def _reverse():
    from ..toy import reverse_reward

    return reverse_reward


def _trl(name: str):
    def load():
        import trl.rewards

        return getattr(trl.rewards, name)

    return load


def _math(name: str, needs_math_verify: bool = False):
    """Loader of a math-recipe reward; one missing dependency is a setup error, not a crash mid-training."""

    def load():
        from ..math_recipe import rewards as math_rewards

        if needs_math_verify and importlib.util.find_spec("math_verify") is None:
            raise ValueError(f"reward {name!r} needs math-verify: pip install 'bapo_trl[math]'.")
        if name in math_rewards.SOFT_OVERLONG:
            return math_rewards.soft_overlong(name)
        return getattr(math_rewards, name)

    return load


#: name -> zero-argument loader (lazy, so optional dependencies such as math-verify load only when used).
REWARD_FUNCS: dict[str, Callable[[], Callable]] = {
    "reverse": _reverse,
    "accuracy_reward": _trl("accuracy_reward"),
    "reasoning_accuracy_reward": _trl("reasoning_accuracy_reward"),
    "think_format_reward": _trl("think_format_reward"),
    # math recipe (bapo_trl.math_recipe.rewards): reads the `answer` column of bapo_trl.math_recipe.data
    "boxed_accuracy": _math("boxed_accuracy", needs_math_verify=True),
    "boxed_format_reward": _math("boxed_format_reward"),
    **{name: _math(name) for name in SOFT_OVERLONG},  # DAPO's soft overlong penalty, one per length budget
}


def resolve_reward_funcs(names: list[str]) -> list[Callable]:
    """Registry names or dotted import paths (``pkg.module.func``) -> callables, with a clear error otherwise."""
    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name]())
            continue
        if "." not in name:
            raise ValueError(
                f"Unknown reward function {name!r} in `reward_funcs`: use one of {sorted(REWARD_FUNCS)} or a dotted "
                "import path such as 'my_package.rewards.my_reward'."
            )
        module_name, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"Could not import module {module_name!r} for reward function {name!r}: {err}") from err
        if not hasattr(module, attr):
            raise ValueError(f"Module {module_name!r} has no reward function {attr!r} (from `reward_funcs`).")
        funcs.append(getattr(module, attr))
    return funcs

