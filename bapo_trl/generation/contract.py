"""The generation contract: what the trainer and its rollout sources need of the engine that generates for them, and a
registry of such engines by name.

A backend is built with the trainer (``build(trainer)``, a class or a function; it reads what it needs: the model,
the accelerator, the config) and follows :class:`GenerationBackend`. ``BAPOConfig.generation_backend`` picks one by
name. The built-in ``"vllm"`` is TRL's vLLM backend itself, as bapo_trl builds it
(:class:`~.vllm_generation.BAPOVLLMGeneration`: one or several vLLM servers): the synchronous sources keep TRL's own
generate call on it (transformers' ``generate`` without vLLM), async generation samples through this contract. A
backend registered under another name serves every source: TRL's default generation, partial rollout and async
generation sample through it. Adding one is one file with its class and one :func:`register_backend` call; the
trainer, the port and the sources stay as they are.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class GenerationBackend(Protocol):
    """What a generation backend does for the trainer (its port onto TRL calls these; the producer thread too)."""

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None) -> dict[str, list]:
        """``n`` completions of every prompt (token ids; any thread), at most ``max_tokens`` each, sampled with the
        run's sampling settings: ``{"completion_ids": [...], "logps": [...]}``, prompt-major, with each token's
        log-prob under the distribution it was sampled from (the behaviour log-probs). With ``seed`` the same call
        samples the same completions, and no two sequences of it share a random stream. (``generate`` in 0.1: TRL's
        vLLM backend, which implements this contract, has a ``generate`` of its own.)"""

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


def sampled_or_error(name: str, output: Any, prompts: int, n: int, max_tokens: int) -> dict[str, list]:
    """``output`` of backend ``name``'s :meth:`GenerationBackend.sample` for ``prompts`` prompts, checked: every
    source trusts it (a log-prob list one token short shifts every later token's behaviour log-prob, a missing value
    becomes a ratio against log-prob 0), so a wrong shape is an error naming the backend and what was expected."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"generation backend {name!r}: sample() must return {{'completion_ids': [...], 'logps': "
                          f"[...]}}, prompt-major, with a log-prob per completion token; {what}.")

    if not isinstance(output, dict) or not {"completion_ids", "logps"} <= output.keys():
        raise refuse(f"got {type(output).__name__} with keys {sorted(output) if isinstance(output, dict) else None}")
    ids, logps = output["completion_ids"], output["logps"]
    if len(ids) != prompts * n or len(logps) != len(ids):
        raise refuse(f"asked for {n} completion(s) of {prompts} prompt(s) ({prompts * n}), got {len(ids)} completions "
                     f"and {len(logps)} log-prob lists")
    for i, (tokens, values) in enumerate(zip(ids, logps)):
        if len(values) != len(tokens) or len(tokens) > max_tokens:
            raise refuse(f"completion {i} has {len(tokens)} token(s) (at most {max_tokens} asked) and {len(values)} "
                         "log-prob(s)")
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            raise refuse(f"completion {i} has a log-prob that is not a number (NaN is allowed: a token the sampler "
                         "could not score)")
    return output


#: name -> what builds the backend from the trainer (a class or a function), or ``"module:name"`` (imported only when
#: chosen)
_BACKENDS: dict[str, Any] = {"vllm": "bapo_trl.generation.vllm_generation:trainer_vllm_backend"}
#: The built-in backend (the default): TRL's own vLLM backend, which TRL's generate call uses too.
BUILT_IN_BACKEND = "vllm"


def samples_for_every_source(name: str) -> bool:
    """Whether the backend named ``name`` samples for every source: one of the user's own does; the built-in one
    samples for async generation only (the synchronous sources keep TRL's generate call, which uses it too)."""
    return name != BUILT_IN_BACKEND


def register_backend(name: str, backend: Any) -> None:
    """Make ``BAPOConfig(generation_backend=name)`` build ``backend`` (a class or function taking ``(trainer)``, or
    ``"module:name"``)."""
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
