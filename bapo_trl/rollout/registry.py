"""Which rollout source a run uses: a table of names, and the one function the trainer calls to build its source.

A source is registered by name with its class (or ``"module:Class"``, imported only when chosen); the class takes
``(port)`` and may carry ``argument_errors(args, trainer_kwargs) -> list[str]``, the ``GRPOTrainer`` arguments it
cannot serve, checked before TRL loads anything. ``BAPOConfig.rollout_source`` picks a source by name; ``"auto"``
picks the built-in one the settings turn on. Replay, when on, wraps whichever source was chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from .contract import RolloutSource, TrainerPort
from .settings import auto_source_name

_SOURCES: dict[str, Any] = {
    "trl": "bapo_trl.rollout.trl_generation:TRLGeneration",
    "partial": "bapo_trl.rollout.partial:PartialRollout",
    "async": "bapo_trl.rollout.async_generation:AsyncGeneration",
    "async_partial": "bapo_trl.rollout.async_partial:AsyncPartialRollout",
}
_REPLAY = "bapo_trl.rollout.replay:ReplaySource"


def register_source(name: str, source: type | str) -> None:
    """Make ``BAPOConfig(rollout_source=name)`` build ``source`` (a class taking ``(port)``, or ``"module:Class"``)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a rollout source needs a name other than 'auto', got {name!r}")
    _SOURCES[name] = source


def registered_sources() -> list[str]:
    return sorted(_SOURCES)


def _load(entry: type | str) -> type:
    if not isinstance(entry, str):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def source_name(args) -> str:
    """The registered name of the source ``args`` choose (before replay wraps it)."""
    return args.rollout_source if args.rollout_source != "auto" else auto_source_name(args)


def source_classes(args) -> list[type]:
    """The classes that will make this run's batches, outermost first (replay, then the chosen source)."""
    name = source_name(args)
    if name not in _SOURCES:
        raise ValueError(f"Invalid BAPOTrainer arguments:\n  - `rollout_source` {name!r} is not a registered rollout "
                         f"source; registered: {registered_sources()} (or 'auto'). Register yours with "
                         "bapo_trl.rollout.register_source(name, cls).")
    return ([_load(_REPLAY)] if args.replay_enabled else []) + [_load(_SOURCES[name])]


def check_source_arguments(args, trainer_kwargs: dict) -> None:
    """Refuse, by name and before anything is loaded, ``GRPOTrainer`` arguments the run's sources cannot serve."""
    problems = []
    for cls in source_classes(args):
        check = getattr(cls, "argument_errors", None)
        problems += check(args, trainer_kwargs) if check is not None else []
    if problems:
        raise ValueError("Invalid BAPOTrainer arguments:\n  - " + "\n  - ".join(problems))


def build_source(port: TrainerPort, args) -> RolloutSource:
    """The run's source over ``port``, as ``args`` (the config) choose it: the chosen one, wrapped by replay when it
    is on."""
    *wrappers, cls = source_classes(args)
    source = cls(port)
    for wrapper in reversed(wrappers):
        source = wrapper(port, source)
    return source
