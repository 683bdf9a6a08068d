"""Prompt datasets for ``train_bapo.py``: the embedded task, local files or hub datasets, one prompt column (or a math format)."""

from __future__ import annotations

import os

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _load(name: str, config: str | None, split: str, train_split: str = "train"):
    from datasets import load_dataset, load_from_disk

    ext = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if ext not in FILE_FORMATS:
            raise ValueError(f"`dataset_name` file {name!r} must end in one of {sorted(FILE_FORMATS)}.")
        if split != train_split:  # one file is one split: it would silently evaluate on the training prompts
            raise ValueError(
                f"`dataset_name` {name!r} is a single file, which holds only the training split; evaluation (the "
                f"{split!r} split, from `dataset_test_split`) needs a dataset with that split: a directory saved with "
                "`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a hub dataset. Or set `--eval_strategy no`.")
        return load_dataset(FILE_FORMATS[ext], data_files=name, split="train")
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
        dataset = load_from_disk(name)
        return dataset[split] if hasattr(dataset, "keys") else dataset
    if ext in FILE_FORMATS:
        raise ValueError(f"`dataset_name` {name!r} looks like a file but does not exist.")
    return load_dataset(name, name=config, split=split)


def prepare_prompts(dataset, prompt_column: str = "prompt"):
    """Check the prompt column exists and name it ``prompt``; the error lists the columns there are."""
    if prompt_column not in dataset.column_names:
        raise ValueError(
            f"The dataset has no column {prompt_column!r} (from `prompt_column`); its columns are "
            f"{dataset.column_names}. Pass --prompt_column NAME."
        )
    if prompt_column != "prompt":
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    return dataset


def load_prompts(script_args, training_args):
    """``(train, eval)`` datasets; eval only when ``eval_strategy`` is not ``"no"``."""
    wants_eval = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    if script_args.dataset_name is None:
        from ..toy import make_reverse_dataset

        train = make_reverse_dataset(script_args.num_train_prompts, seed=training_args.seed)
        evaluation = make_reverse_dataset(64, seed=training_args.seed, split="test") if wants_eval else None
        return train, evaluation
    train = _prompts(script_args, script_args.dataset_train_split)
    evaluation = _prompts(script_args, script_args.dataset_test_split) if wants_eval else None
    return train, evaluation


def _prompts(script_args, split: str):
    """One split: mapped by its math format when ``math_dataset_format`` is set, else by its prompt column."""
    name, config = script_args.dataset_name, script_args.dataset_config
    math_format = getattr(script_args, "math_dataset_format", None)
    if not math_format:
        return prepare_prompts(_load(name, config, split, script_args.dataset_train_split), script_args.prompt_column)
    from ..math_recipe.data import default_config, to_math_prompts

    dataset = _load(name, config or default_config(name), split, script_args.dataset_train_split)
    return to_math_prompts(dataset, math_format, dataset_name=name,
                           instruction_role=getattr(script_args, "math_instruction_role", "system"))
