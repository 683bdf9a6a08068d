"""The generation contract: what the trainer and its rollout sources need of the engine that generates outside TRL's
own generate call (async generation, in-flight updates), and a registry of such backends by name.

A backend is a class built with the trainer (``cls(trainer)``; it reads what it needs: the model, the accelerator,
the config) that follows :class:`GenerationBackend`. ``BAPOConfig.generation_backend`` picks one by name; the
built-in ``"vllm"`` is one or several vLLM servers (:mod:`.vllm_server`). Adding a backend is one file with its class
and one :func:`register_backend` call; the trainer, the port and the sources stay as they are.

TRL's own generation (its ``VLLMGeneration``, or transformers' ``generate``) stays what TRL's generate call uses: the
synchronous sources (TRL's, replay, partial rollout) run on it, and the ``"vllm"`` backend shares its client and
weight pushes.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class GenerationBackend(Protocol):
    """What a generation backend does for the trainer (its port onto TRL calls these; the producer thread too)."""

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None
                 ) -> dict[str, list]:
        """``n`` completions of every prompt (token ids; any thread), at most ``max_tokens`` each, sampled with the
        run's sampling settings: ``{"completion_ids": [...], "logps": [...]}``, prompt-major, with each token's
        log-prob under the distribution it was sampled from (the behaviour log-probs). With ``seed`` the same call
        samples the same completions, and no two sequences of it share a random stream."""

    def requests_answered(self) -> int:
        """How many requests the engine has answered so far (any thread): the progress of a batch in flight, which
        restarts the trainer's bounded waits."""

    def push_weights(self) -> None:
        """Bring the engine to the trainer's current weights, now (every process calls it: gathering may be
        collective)."""

    def gather_weights(self) -> Any:
        """The current weights, for a push applied later from another thread (:meth:`send_weights`); every process
        calls it. ``None`` where only :meth:`push_weights` exists."""

    def send_weights(self, state: Any) -> None:
        """Main process, any thread: have the engine load what :meth:`gather_weights` returned."""

    def close(self) -> None:
        """The run is over: release what the backend holds for it (connections, threads); a later run may use it
        again."""


#: name -> the backend's class, or ``"module:Class"`` (imported only when chosen)
_BACKENDS: dict[str, Any] = {"vllm": "bapo_trl.generation.vllm_server:VLLMServerBackend"}


def register_backend(name: str, backend: type | str) -> None:
    """Make ``BAPOConfig(generation_backend=name)`` build ``backend`` (a class taking ``(trainer)``, or
    ``"module:Class"``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a generation backend needs a name, got {name!r}")
    _BACKENDS[name] = backend


def registered_backends() -> list[str]:
    return sorted(_BACKENDS)


def build_backend(name: str, trainer) -> GenerationBackend:
    """The backend registered as ``name``, built for ``trainer``."""
    if name not in _BACKENDS:
        raise ValueError(f"`generation_backend` {name!r} is not a registered generation backend; registered: "
                         f"{registered_backends()}. Register yours with "
                         "bapo_trl.generation.contract.register_backend(name, cls).")
    entry = _BACKENDS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry(trainer)
