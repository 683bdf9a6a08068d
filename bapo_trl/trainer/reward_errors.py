"""Reward functions that raise, or return something other than a list, are named in the error: the trainer wraps
every callable reward with this. Batches that none of them rewards are counted (:class:`RewardTally`).

Core, not command line: the trainer needs it whatever the rewards are (the registry in :mod:`bapo_trl.cli.rewards`
serves ``train_bapo.py`` only).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

from ..core.metrics import REWARDS


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned no list: the message names the function, so a long traceback is not
    needed to find it."""


def checked_output(name: str, output: Any, kwargs: dict) -> Any:
    """``output`` when it can be TRL's list of rewards (one float, or None, per completion); else the error naming the
    function and what it returned (TRL would fail with ``'NoneType' object is not iterable``, naming nothing)."""
    if (output is None or isinstance(output, (str, bytes, dict)) or not hasattr(output, "__iter__")
            or getattr(output, "ndim", None) == 0):  # a 0-d tensor or array has __iter__, but iterating it raises
        completions = kwargs.get("completions")
        count = f" ({len(completions)} here)" if hasattr(completions, "__len__") else ""
        raise RewardFunctionError(
            f"reward function {name!r} returned {output!r:.80} ({type(output).__name__}); expected a list with one "
            f"reward per completion{count}: a float, or None where the function does not apply to a completion.")
    return output


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
                output = await func(*args, **kwargs)
            except Exception as err:
                raise named(err) from err
            return checked_output(name, output, kwargs)

        wrapper = async_wrapper
    else:

        def wrapper(*args, **kwargs):
            try:
                output = func(*args, **kwargs)
            except Exception as err:
                raise named(err) from err
            return checked_output(name, output, kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name  # kept for callable objects, which have no __name__ of their own
    # Only the identity attributes: an instance's __dict__ is not copied onto the wrapper.
    functools.update_wrapper(wrapper, func, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    wrapper._bapo_named = True
    return wrapper


class RewardTally:
    """The generation batches one ``train()`` scored, and those in which no completion got a reward (every reward
    function returned None for every completion, on every process).

    TRL keeps training on such a batch (its advantages are all 0: loss 0, no update) and only logs a warning per batch,
    which is easy to miss; so the first one warns here, naming the reward functions, and the counts are logged as
    :data:`~bapo_trl.core.metrics.REWARDS` (totals since the start of the run, a resume included), which the run
    summary reports and ``bapo train`` reads to exit non-zero when no batch had a reward.
    """

    #: The first generation batches of a run after which a reward function that gave exactly 0 to every completion of
    #: each of them is named in a warning: it most likely does not fit the dataset (a math reward on the embedded
    #: reversal task trained 706 s on reward 0).
    ZERO_BATCHES = 2

    def __init__(self, reward_func_names: list[str]):
        self.names = list(reward_func_names)
        self.scored = self.without_reward = 0
        self._started = False
        self._zero_batches = dict.fromkeys(self.names, 0)
        self._resumed = False  # a resumed run's first batches are not its first: no zero-reward check

    def counting(self, score: Callable, trainer) -> Callable:
        """``score`` (TRL's ``_generate_and_score_completions``, training only) counting each batch it scores: TRL's
        ``reward`` metric of the batch (over all processes) is NaN when no completion has a reward."""

        def scored(inputs):
            output = score(inputs)
            metrics = trainer._metrics["train"]
            self.observe(metrics["reward"][-1], trainer.state, trainer.accelerator.is_main_process)
            if not self._resumed and self.scored <= self.ZERO_BATCHES:
                self.observe_zeros({name: (metrics[f"rewards/{name}/mean"][-1], metrics[f"rewards/{name}/std"][-1])
                                    for name in self.names if metrics.get(f"rewards/{name}/mean")},
                                   trainer.train_dataset, trainer.accelerator.is_main_process)
            for name, value in zip(REWARDS, (self.scored, self.without_reward)):
                metrics[name] = [float(value)]  # a total, not a mean: one value for TRL's log to average
            return output

        return scored

    def observe(self, batch_reward: float, state, warn: bool = True) -> None:
        if not self._started:  # a resumed run goes on counting from its checkpoint's log
            self._started = True
            last = next((h for h in reversed(state.log_history) if REWARDS[0] in h), None)
            if last is not None:
                self.scored, self.without_reward = int(last[REWARDS[0]]), int(last[REWARDS[1]])
                self._resumed = True
        self.scored += 1
        if not math.isnan(batch_reward):
            return
        self.without_reward += 1
        if self.without_reward == 1 and warn:
            warnings.warn(
                f"BAPO: no completion of the generation batch scored at step {state.global_step} got a reward: every "
                f"reward function ({', '.join(map(repr, self.names))}) returned None for all of them. The batch's "
                "advantages are all 0, so it trains nothing (TRL goes on; None means 'does not apply'). Such batches "
                "are counted in the run summary, and `bapo train` exits non-zero when no batch had a reward.",
                UserWarning, stacklevel=2)

    def observe_zeros(self, per_function: dict[str, tuple[float, float]], dataset, warn: bool = True) -> None:
        """Count, per reward function, the first batches in which it gave exactly 0 to every completion (mean and
        spread 0); after :attr:`ZERO_BATCHES` of them, warn naming it and the dataset."""
        for name, (mean, spread) in per_function.items():
            self._zero_batches[name] += int(mean == 0 and spread == 0)
        if self.scored != self.ZERO_BATCHES or not warn:
            return
        silent = [name for name, count in self._zero_batches.items() if count == self.ZERO_BATCHES]
        if silent:
            warnings.warn(
                f"BAPO: reward function(s) {', '.join(map(repr, silent))} gave 0 to every completion of the first "
                f"{self.ZERO_BATCHES} generation batches, on {describe_dataset(dataset)}: check that the reward fits "
                "this dataset (a math reward on the embedded reversal task, say, never rewards anything), or that its "
                "column (e.g. `answer`) is there. The run goes on.", UserWarning, stacklevel=2)


def describe_dataset(dataset) -> str:
    """The train set in a few words for a message: its columns and first prompt."""
    columns = getattr(dataset, "column_names", None)
    try:
        prompt = dataset[0]["prompt"]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        prompt = None
    shown = f", first prompt {prompt!r:.80}" if prompt is not None else ""
    return f"the train_dataset ({type(dataset).__name__}, columns {columns}{shown})"
