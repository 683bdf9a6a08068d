"""An error on one process, raised on every trainer process: where the main process alone talks to a server (checks,
weight writes, the async producer), or one process's step may fail where the others' do not, the other processes must
not wait forever in a collective the failed one skips."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator


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


def gather_from_all(obj: Any, num_processes: int) -> list[Any]:
    """Every process's ``obj``, in process order, on every process (a collective: all call it at the same point)."""
    if num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def raise_if_any(error: BaseException | None, num_processes: int, where: str,
                 gather: Callable[[Any], list[Any]] | None = None) -> None:
    """Raise on every process when ``error`` is not None on any of them. ``gather(obj)`` returns every process's
    ``obj`` in process order (a collective: all call this at the same point; default :func:`gather_from_all`). A
    process raises its own error; one that had none raises ``RuntimeError("{where}: on process {i}: {class name}:
    {message}")`` for the first that had one."""
    if num_processes > 1:
        gather = gather or (lambda obj: gather_from_all(obj, num_processes))
        sent = gather(None if error is None else (type(error).__name__, str(error)))
        failed = [(i, s) for i, s in enumerate(sent) if s is not None]
        if failed and error is None:
            i, (name, message) = failed[0]
            raise RuntimeError(f"{where}: on process {i}: {name}: {message}")
    if error is not None:
        raise error


@contextmanager
def raised_on_every_process(num_processes: int, where: str,
                            gather: Callable[[Any], list[Any]] | None = None) -> Iterator[None]:
    """Run the block on every process, then :func:`raise_if_any` its error: one process's failure is raised on all
    (every process leaves the block through the same collective, failed or not)."""
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - raised below, on every process
        error = exc
    raise_if_any(error, num_processes, where, gather)


class FailedHere:
    """Sent in place of a result that failed on the process that computes it for all (the main process's server
    request, which TRL broadcasts): using it (iterating it) raises, on every process that received it, an error
    naming the failure, after the collective that shares it, which the others would otherwise wait in forever."""

    def __init__(self, where: str, error: BaseException):
        self.message = f"{where}: {type(error).__name__}: {error}"

    def __iter__(self):
        raise RuntimeError(self.message)
