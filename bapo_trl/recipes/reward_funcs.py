"""Reward functions by name: the general registry, and ``registry name or dotted import path -> callable``.

Below both users: ``bapo train --reward_funcs`` (:mod:`bapo_trl.cli.rewards`) and ``bapo evaluate --reward``
(:mod:`bapo_trl.recipes.math_reasoning.evaluate`) accept the same names, each adding the math recipe's own rewards
(:data:`bapo_trl.recipes.math_reasoning.rewards.REWARD_FUNCS`), and the recipe must not depend on the command line. The
registries hold zero-argument loaders, so a reward's module (the toy task, TRL's rewards, math-verify) is imported
only when that reward is used. The trainer imports nothing from here: it takes callables.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Mapping


def _reverse():
    from .toy import reverse_reward

    return reverse_reward


def _trl(name: str):
    def load():
        import trl.rewards

        return getattr(trl.rewards, name)

    return load


#: name -> zero-argument loader: the toy task's reward and TRL's own rewards.
REWARD_FUNCS: dict[str, Callable[[], Callable]] = {
    "reverse": _reverse,
    "accuracy_reward": _trl("accuracy_reward"),
    "reasoning_accuracy_reward": _trl("reasoning_accuracy_reward"),
    "think_format_reward": _trl("think_format_reward"),
}


def import_reward(path: str) -> Callable:
    """``pkg.module.func`` -> that function; the current directory is importable (a ``my_rewards.py`` next to the
    command). Raises ``ValueError`` naming what is missing."""
    module_name, attr = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Could not import module {module_name!r} for reward function {path!r}: {err}") from err
    if not hasattr(module, attr):
        raise ValueError(f"Module {module_name!r} has no reward function {attr!r} (from `reward_funcs`).")
    return getattr(module, attr)


def resolve(names: list[str], registry: Mapping[str, Callable[[], Callable]]) -> list[Callable]:
    """Names of ``registry`` or dotted import paths (``pkg.module.func``) -> callables, with a clear error
    otherwise."""
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name]())
        elif "." in name:
            funcs.append(import_reward(name))
        else:
            raise ValueError(
                f"Unknown reward function {name!r} in `reward_funcs`: use one of {sorted(registry)} or a dotted "
                "import path such as 'my_package.rewards.my_reward'."
            )
    return funcs
