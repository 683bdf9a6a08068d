"""Prompt datasets for ``train_bapo.py``: the embedded task, local files or hub datasets, one prompt column
(or a math format)."""

from __future__ import annotations

from ..recipes.datasets_io import FILE_FORMATS, load_split  # noqa: F401  (FILE_FORMATS: re-exported)
from ..rollout.settings import changed

#: Tasks the package ships, by the name ``--dataset_name`` takes, with the reward that scores them (the default
#: ``--reward_funcs`` for them): the README's SmolLM2 example as one command.
SHIPPED_TASKS = {"chat_arithmetic": ("bapo_trl.recipes.math_reasoning.chat_arithmetic:splits", "boxed_accuracy")}


def shipped_task(name: str | None):
    """``(splits function, reward name)`` of a shipped task named ``name`` (None for any other dataset name)."""
    if name not in SHIPPED_TASKS:
        return None
    import importlib

    target, reward = SHIPPED_TASKS[name]
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function), reward


def prepare_prompts(dataset, prompt_column: str = "prompt"):
    """Check the prompt column exists and name it ``prompt``; the error lists the columns there are (the trainer's
    check, :func:`~bapo_trl.trainer.input_checks.check_prompt_column`, with this command's flag as the fix)."""
    from ..trainer.input_checks import check_prompt_column

    check_prompt_column(dataset, "The dataset", prompt_column, why=" (from `prompt_column`)",
                        fix="Pass --prompt_column NAME.")
    if prompt_column != "prompt":
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    return dataset


def set_flags(args, names: tuple[str, ...]) -> list[str]:
    """The fields among ``names`` that ``args`` (a dataclass of this command's options) sets away from their
    defaults, as ``"`name`"``: what a refusal names when those flags would do nothing."""
    return [f"`{name}`" for name in names if name in args.__dataclass_fields__ and changed(args, name)]


def load_prompts(script_args, training_args):
    """``(train, eval)`` datasets; eval only when ``eval_strategy`` is not ``"no"``."""
    wants_eval = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    if getattr(script_args, "dataset_streaming", False):  # TRL's ScriptArguments has it; bapo train loads whole
        raise ValueError("`dataset_streaming` is not supported by bapo train, which loads the split whole: leave it "
                         "off, or stream through the Python API (BAPOTrainer takes a 🤗 IterableDataset, "
                         "load_dataset(..., streaming=True)).")
    if script_args.dataset_name is None:
        from ..recipes.toy import make_reverse_dataset

        ignored = set_flags(script_args, ("dataset_config", "prompt_column", "math_dataset_format",
                                          "dataset_train_split", "dataset_test_split"))
        if ignored:  # the embedded task is built, not loaded: a flag for a dataset would do nothing
            raise ValueError(f"{', '.join(ignored)} set{'s' if len(ignored) == 1 else ''} how a dataset is read, and "
                             "no `dataset_name` is given (the embedded reversal task is built, not loaded): pass "
                             "--dataset_name, or drop them.")

        train = make_reverse_dataset(script_args.num_train_prompts, seed=training_args.seed)
        evaluation = make_reverse_dataset(64, seed=training_args.seed, split="test") if wants_eval else None
        return train, evaluation
    train = _prompts(script_args, script_args.dataset_train_split)
    evaluation = _prompts(script_args, script_args.dataset_test_split) if wants_eval else None
    return train, evaluation


def _prompts(script_args, split: str):
    """One split: a shipped task's (:data:`SHIPPED_TASKS`), mapped by its math format when ``math_dataset_format`` is
    set, else by its prompt column."""
    name, config = script_args.dataset_name, script_args.dataset_config
    task = shipped_task(name)
    if task is not None:
        from datasets import Dataset

        ignored = set_flags(script_args, ("dataset_config", "prompt_column", "math_dataset_format"))
        if ignored:  # the shipped task brings its own prompts and format: a flag for another dataset would do nothing
            raise ValueError(f"{', '.join(ignored)} cannot be used with the shipped task {name!r}, which has its own "
                             "prompts (a chat column `prompt`) and answers: drop them.")
        splits = task[0]()
        if split not in splits:
            raise ValueError(f"the shipped task {name!r} has the splits {sorted(splits)}, not {split!r} (from "
                             "`dataset_train_split` / `dataset_test_split`).")
        return Dataset.from_list(splits[split])
    math_format = getattr(script_args, "math_dataset_format", None)
    if not math_format:
        dataset = load_split(name, config, split, script_args.dataset_train_split)
        return prepare_prompts(dataset, script_args.prompt_column)
    from ..recipes.math_reasoning.data import default_config, to_math_prompts

    dataset = load_split(name, config or default_config(name), split, script_args.dataset_train_split)
    return to_math_prompts(dataset, math_format, dataset_name=name,
                           instruction_role=getattr(script_args, "math_instruction_role", "system"))
