"""Reward functions that raise are named in the error: the trainer wraps every callable reward with this.

Core, not command line: the trainer needs it whatever the rewards are (the registry in :mod:`bapo_trl.cli.rewards`
serves ``train_bapo.py`` only).
"""

from __future__ import annotations

from typing import Callable


class RewardFunctionError(RuntimeError):
    """A reward function raised: the message names the function, so a long traceback is not needed to find it."""


def name_errors(func: Callable, name: str) -> Callable:
    """Wrap a reward function so that an exception names it.

    Asynchronous reward functions (``async def`` functions, partials of them, and objects whose ``__call__`` is
    ``async``) get an ``async`` wrapper, so TRL's own ``is_async_callable`` still sees them as asynchronous and awaits
    them with its other async rewards; synchronous ones get a plain wrapper.
    """
    import functools

    from trl.trainer.utils import is_async_callable

    if getattr(func, "_bapo_named", False):
        return func

    def named(err: Exception) -> RewardFunctionError:
        return RewardFunctionError(f"reward function {name!r} raised {type(err).__name__}: {err}")

    if is_async_callable(func):

        async def async_wrapper(*args, **kwargs):
            try:
                return await func(*args, **kwargs)
            except Exception as err:
                raise named(err) from err

        wrapper = async_wrapper
    else:

        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except Exception as err:
                raise named(err) from err

    wrapper.__name__ = wrapper.__qualname__ = name  # kept for callable objects, which have no __name__ of their own
    # Only the identity attributes: an instance's __dict__ is not copied onto the wrapper.
    functools.update_wrapper(wrapper, func, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    wrapper._bapo_named = True
    return wrapper
