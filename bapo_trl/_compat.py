"""The import paths of bapo_trl 0.1 before its layers became folders: each still works for one release.

An old module path (``bapo_trl.clipping``, ``bapo_trl.toy.task``, ...) is the module it became: the same object, so
there is never a second copy of a module and patching either name patches both. Importing it warns once, with a
``DeprecationWarning`` that names the new path; ``python -m <old path>`` runs the command that took its place.

``bapo_trl.config`` stays for good, without a warning: every saved run's ``training_args.bin`` pickles
``bapo_trl.config.BAPOConfig``, and unpickling imports that path.

Installed by ``bapo_trl/__init__.py`` (one finder in front of ``sys.meta_path`` that answers only the names below).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module (a package's submodules follow it) -> the module it became
MOVED: dict[str, str] = {
    **{f"bapo_trl.{name}": f"bapo_trl.core.{name}" for name in (
        "clipping", "clipping_reference", "loss_types", "gates", "metrics", "entropy_clip", "numerics",
        "target_controller")},
    "bapo_trl.config": "bapo_trl.trainer.bapo_config",
    **{f"bapo_trl.{name}": f"bapo_trl.trainer.{name}" for name in (
        "loss_hook", "checkpoints", "model_card", "trl_seams", "reward_errors")},
    "bapo_trl.rollout_settings": "bapo_trl.rollout.settings",
    "bapo_trl.rollout.queue": "bapo_trl.rollout.replay_queue",  # it shadowed the standard library's queue
    "bapo_trl.rollout.port": "bapo_trl.trainer.trl_port",  # the trainer's adapter onto TRL
    "bapo_trl.toy": "bapo_trl.recipes.toy",
    "bapo_trl.math_recipe": "bapo_trl.recipes.math_reasoning",
    "bapo_trl.reward_funcs": "bapo_trl.recipes.reward_funcs",
    "bapo_trl.datasets_io": "bapo_trl.recipes.datasets_io",
    "bapo_trl.plot": "bapo_trl.cli.plot",
    "bapo_trl.generation.serve": "bapo_trl.cli.serve",
    "bapo_trl.generation.vllm_server": "bapo_trl.generation.vllm_generation",  # the "vllm" backend is TRL's own
    "bapo_trl.cli.summary": "bapo_trl.trainer.summary",  # a library module: the public face takes nothing from cli
    # research candidates, out of the method's files (bapo_trl.experimental)
    "bapo_trl.core.length_fair": "bapo_trl.experimental.length_fair.search",
    "bapo_trl.core.off_policy": "bapo_trl.experimental.decoupled.weights",
    "bapo_trl.core.geometric_mean": "bapo_trl.experimental.gmpo.geometric_mean",
    "bapo_trl.trainer.decoupled": "bapo_trl.experimental.decoupled.trainer",
    "bapo_trl.trainer.gmpo": "bapo_trl.experimental.gmpo.trainer",
}
#: old module that was split -> the modules its names went to, searched in order (the first holds its functions)
SPLIT: dict[str, tuple[str, ...]] = {
    "bapo_trl.models": ("bapo_trl.recipes.models", "bapo_trl.cli.models"),
    "bapo_trl.math_recipe.evaluate": ("bapo_trl.recipes.math_reasoning.evaluate", "bapo_trl.cli.evaluate"),
    "bapo_trl.generation.cpu_server": ("bapo_trl.generation.vllm_generation", "bapo_trl.generation.http_client",
                                       "bapo_trl.generation.gather"),
}
#: a split module whose command moved: ``python -m <old module>`` runs this one (its ``main`` and ``make_parser``)
SPLIT_COMMANDS: dict[str, str] = {
    "bapo_trl.models": "bapo_trl.cli.models",
    "bapo_trl.math_recipe.evaluate": "bapo_trl.cli.evaluate",
}
#: old modules kept for good, without a warning
PERMANENT = frozenset({"bapo_trl.config"})
#: the release that drops the deprecated paths
REMOVED_IN = "0.2"


def new_name(old: str) -> str | None:
    """The module an old path became (longest moved prefix wins; a split one: where its functions went), or None for a
    path that did not move."""
    if old in SPLIT:
        return SPLIT[old][0]
    matches = [name for name in MOVED if old == name or old.startswith(name + ".")]
    if not matches:
        return None
    name = max(matches, key=len)
    return MOVED[name] + old[len(name):]


def deprecated(old: str, new: str, stacklevel: int = 2) -> None:
    warnings.warn(f"{old} moved to {new}; the old path is deprecated and goes away in bapo_trl {REMOVED_IN}.",
                  DeprecationWarning, stacklevel=stacklevel)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module it became."""

    def __init__(self):
        self._specs = {}  # old name -> the new module's own spec, while the import system loads the old name

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        spec = None if new is None else importlib.util.find_spec(new)
        if spec is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=spec.submodule_search_locations is not None)

    def create_module(self, spec):
        new = new_name(spec.name)
        if spec.name in SPLIT:
            deprecated(spec.name, " and ".join(SPLIT[spec.name]), stacklevel=_callers_level())
            return _split_module(spec.name)
        if spec.name not in PERMANENT:
            deprecated(spec.name, new, stacklevel=_callers_level())
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system now sets the old name's spec on it
        return module

    def exec_module(self, module):
        if module.__name__ in SPLIT:
            return
        old = next(name for name, spec in self._specs.items() if spec.name == module.__name__)
        module.__spec__ = self._specs.pop(old)

    def get_code(self, fullname):
        """``python -m <old path>``: warn, then run the command that took its place as ``__main__``."""
        new = SPLIT_COMMANDS.get(fullname) or new_name(fullname)
        message = (f"python -m {fullname} moved to python -m {new}; the old form is deprecated and goes away in "
                   f"bapo_trl {REMOVED_IN}.")
        source = ("import runpy, warnings\n"
                  f"warnings.warn({message!r}, DeprecationWarning)\n"
                  f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n")
        return compile(source, f"<{fullname}, moved to {new}>", "exec")


def _split_module(old: str) -> types.ModuleType:
    """A module standing for one that was split: each name comes from the first of its new modules that has it."""
    module = types.ModuleType(old, f"Deprecated: {old} is now {' and '.join(SPLIT[old])}.")

    def __getattr__(name):
        for new in SPLIT[old]:
            found = getattr(importlib.import_module(new), name, module)
            if found is not module:
                return found
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    module.__getattr__ = __getattr__
    return module


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside the import system and this file (the ``import`` statement)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__):
        frame, level = frame.f_back, level + 1
    return level


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
