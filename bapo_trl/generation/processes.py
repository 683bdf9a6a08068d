"""An error on the main process, raised on every trainer process: where the main process alone talks to a server
(checks, weight writes, the async producer), the other processes must not wait forever in a collective it skips."""

from __future__ import annotations

from typing import Any, Callable


def broadcast_from_main(obj: Any, num_processes: int) -> Any:
    """The main process's ``obj`` on every process (a collective: all call it at the same point)."""
    if num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


def raise_everywhere(error: BaseException | None, num_processes: int, broadcast: Callable[[Any], Any], where: str,
                     kinds: dict[str, type[Exception]] | None = None, default: type[Exception] = RuntimeError) -> None:
    """Raise the main process's ``error`` (None: there was none) on every process. ``broadcast(obj)`` returns the main
    process's ``obj`` on every process (a collective: all call this at the same point). The main process raises its
    own error; another raises ``kinds[class name]`` (else ``default``) with ``"{where}: {class name}: {message}"``."""
    if num_processes > 1:
        sent = broadcast(None if error is None else (type(error).__name__, str(error)))
        if sent is not None and error is None:
            name, message = sent
            raise (kinds or {}).get(name, default)(f"{where}: {name}: {message}")
    if error is not None:
        raise error
