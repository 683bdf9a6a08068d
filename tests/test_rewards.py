"""Reward functions: failures name the function; None results are handled as TRL documents."""

import math
import re

import pytest

from bapo_trl.cli.rewards import RewardFunctionError, resolve_reward_funcs
from bapo_trl.recipes.toy import reverse_reward
from support.harness import cpu_config, tiny_trainer


def trainer_with(reward, model_dir, tmp_path):
    args = cpu_config(tmp_path, save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=2, logging_steps=1, steps_per_generation=2)
    return tiny_trainer(model_dir, args, reward=[reverse_reward, reward], prompts=16, model=model_dir)


def test_a_reward_that_raises_is_named(tiny_model_dir, tmp_path):
    def length_bonus(completions, **kwargs):
        raise KeyError("missing column 'solution'")

    trainer = trainer_with(length_bonus, tiny_model_dir, tmp_path)
    with pytest.raises(RewardFunctionError, match="reward function 'length_bonus' raised KeyError"):
        trainer.train()


def test_none_rewards_are_skipped_as_trl_documents(tiny_model_dir, tmp_path):
    def only_even(completions, **kwargs):  # None = "this reward does not apply to this sample"
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    trainer = trainer_with(only_even, tiny_model_dir, tmp_path)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert logs[0]["rewards/only_even/mean"] == 1.0  # the mean over the samples it applies to


def test_registry_resolves_names_and_paths():
    funcs = resolve_reward_funcs(["reverse", "bapo_trl.recipes.toy.reverse_reward"])
    assert funcs[0] is reverse_reward and funcs[1] is reverse_reward
    with pytest.raises(ValueError, match="no attribute|has no reward function"):
        resolve_reward_funcs(["bapo_trl.recipes.toy.nope"])


class AsyncReward:
    """A callable object whose ``__call__`` is async (TRL awaits such objects with its other async rewards)."""

    def __init__(self, fail: bool):
        self.fail = fail
        self.__name__ = "async_object_reward"  # TRL names callables by __name__ (else by class name)

    async def __call__(self, completions, **kwargs):
        if self.fail:
            raise KeyError("missing column 'solution'")
        return [0.25] * len(completions)


async def async_length_bonus(completions, **kwargs):
    raise KeyError("missing column 'solution'")


async def async_quarter(completions, **kwargs):
    return [0.25] * len(completions)


@pytest.mark.parametrize("reward, name", [(async_length_bonus, "async_length_bonus"),
                                          (AsyncReward(fail=True), "async_object_reward")])
def test_an_async_reward_that_raises_is_named(reward, name, tiny_model_dir, tmp_path):
    from trl.trainer.utils import is_async_callable

    trainer = trainer_with(reward, tiny_model_dir, tmp_path)
    assert is_async_callable(trainer.reward_funcs[1])  # TRL still awaits it
    with pytest.raises(RewardFunctionError, match=f"reward function '{name}' raised KeyError"):
        trainer.train()


@pytest.mark.parametrize("reward, name", [(async_quarter, "async_quarter"),
                                          (AsyncReward(fail=False), "async_object_reward")])
def test_async_rewards_are_awaited_and_logged(reward, name, tiny_model_dir, tmp_path):
    trainer = trainer_with(reward, tiny_model_dir, tmp_path)
    trainer.train()
    logs = [h for h in trainer.state.log_history if f"rewards/{name}/mean" in h]
    assert logs and all(h[f"rewards/{name}/mean"] == 0.25 for h in logs)


def test_registry_names_of_trl_rewards_resolve_to_trl_and_score():
    """The README's registry names for TRL's rewards: TRL's own functions, scoring a right and a wrong answer."""
    import trl.rewards

    names = ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"]
    funcs = resolve_reward_funcs(names)
    assert funcs == [getattr(trl.rewards, name) for name in names]
    accuracy, reasoning_accuracy, think_format = funcs
    right = [{"role": "assistant", "content": "<think>2 + 2 = 4</think>The answer is $\\boxed{4}$."}]
    wrong = [{"role": "assistant", "content": "The answer is $\\boxed{5}$."}]
    solution = ["$4$", "$4$"]
    assert accuracy([right, wrong], solution=solution) == [1.0, 0.0]
    assert reasoning_accuracy([right, wrong], solution=solution)[0] == 1.0
    assert think_format([right, wrong]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="Unknown reward function 'accuracy'.*'accuracy_reward'"):
        resolve_reward_funcs(["accuracy"])


def forgot_return(completions, **kwargs):
    [1.0 for _ in completions]  # noqa: B018  (the return the user forgot)


async def async_forgot_return(completions, **kwargs):
    return None


@pytest.mark.parametrize("reward, name", [(forgot_return, "forgot_return"),
                                          (async_forgot_return, "async_forgot_return")])
def test_a_reward_that_returns_none_instead_of_a_list_is_named(reward, name, tiny_model_dir, tmp_path):
    """Not TRL's ``TypeError: 'NoneType' object is not iterable``: the function and what it returned (issue 52)."""
    trainer = trainer_with(reward, tiny_model_dir, tmp_path)
    expected = f"reward function '{name}' returned None (NoneType); expected a list with one reward per completion"
    with pytest.raises(RewardFunctionError, match=re.escape(expected + " (16 here)")):
        trainer.train()


def test_batches_without_any_reward_train_on_but_warn_and_are_counted(tiny_model_dir, tmp_path):
    """Every reward None for every completion of a batch: TRL trains on (its own test expects it), so the first such
    batch warns naming the reward functions, and the totals are logged for the run summary (issue 52)."""
    from bapo_trl.reporting.summary import format_summary, run_problems

    calls = []

    def late_reward(completions, **kwargs):  # applies to nothing in the first generation batch
        calls.append(len(completions))
        return [None] * len(completions) if len(calls) == 1 else [float(len(c)) for c in completions]

    def never(completions, **kwargs):
        return [None] * len(completions)

    args = cpu_config(tmp_path, save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=4, logging_steps=3, steps_per_generation=2)
    trainer = tiny_trainer(tiny_model_dir, args, reward=[late_reward, never], prompts=16, model=tiny_model_dir)
    with pytest.warns(UserWarning, match=r"generation batch scored at step 0 got a reward: every reward function "
                                         r"\('late_reward', 'never'\) returned None") as record:
        trainer.train()
    assert sum("got a reward" in str(w.message) for w in record) == 1  # once, not per batch
    assert trainer.state.global_step == 4  # trained on
    history = trainer.state.log_history
    assert [(h["bapo/generation_batches"], h["bapo/generation_batches_without_reward"])
            for h in history if "bapo/generation_batches" in h] == [(2, 1)]  # logged at step 3: totals of steps 0, 2
    summary = format_summary(history, args)
    assert "generation batches with no reward (every reward function returned None): 1 of 2 (50%)" in summary
    assert run_problems(history, args) == []  # one batch had rewards


def test_a_reward_that_gives_zero_to_every_completion_of_the_first_batches_is_named(tiny_model_dir, tmp_path):
    """Issue 77 (8): a reward that never fits the data (a math reward on the reversal task) trained 706 s on reward 0
    without a word. After the first 2 generation batches in which it gave exactly 0 to every completion, a warning
    names it and the dataset; a reward that gives something somewhere is not named."""
    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = cpu_config(tmp_path, save_strategy="no", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=6, logging_steps=3, steps_per_generation=2)
    trainer = tiny_trainer(tiny_model_dir, args, reward=[zero, length], prompts=16, model=tiny_model_dir)
    with pytest.warns(UserWarning, match=r"reward function\(s\) 'zero' gave 0 to every completion of the first 2 "
                                         r"generation batches, on the train_dataset \(Dataset, columns \[") as record:
        trainer.train()
    said = [str(w.message) for w in record if "gave 0 to every completion" in str(w.message)]
    assert len(said) == 1 and "'length'" not in said[0] and "first prompt" in said[0], said


def test_the_tally_goes_on_from_a_resumed_runs_log():
    from types import SimpleNamespace

    from bapo_trl.trainer.reward_errors import RewardTally

    tally = RewardTally(["f"])
    state = SimpleNamespace(global_step=7, log_history=[
        {"bapo/generation_batches": 3.0, "bapo/generation_batches_without_reward": 1.0}, {"loss": 0.1}])
    tally.observe(0.5, state)
    tally.observe(math.nan, state)
    assert (tally.scored, tally.without_reward) == (5, 2)



def scalar_reward(completions, **kwargs):
    return 1.0  # one number for the batch, not one per completion


async def async_scalar_reward(completions, **kwargs):
    return 1


def tensor_scalar_reward(completions, **kwargs):
    import torch

    return torch.tensor([float(len(c)) for c in completions]).mean()  # a 0-d tensor: iterable in name only


@pytest.mark.parametrize("reward, shown", [(scalar_reward, "1.0 (float)"), (async_scalar_reward, "1 (int)"),
                                           (tensor_scalar_reward, "tensor(")])
def test_a_reward_that_returns_a_scalar_instead_of_a_list_is_named(reward, shown, tiny_model_dir, tmp_path):
    """A number (or a 0-d tensor) where TRL wants one reward per completion: not TRL's ``'float' object is not
    iterable`` (or ``iteration over a 0-d tensor``), which names nothing, but the function, what it returned and the
    list of floats expected."""
    trainer = trainer_with(reward, tiny_model_dir, tmp_path)
    expected = (re.escape(f"reward function '{reward.__name__}' returned {shown}") + ".*"
                + re.escape("; expected a list with one reward per completion (16 here): a float, or None"))
    with pytest.raises(RewardFunctionError, match=expected):
        trainer.train()
