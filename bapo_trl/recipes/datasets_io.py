"""One dataset split from a local file, a ``save_to_disk`` directory or the hub: what ``bapo train`` and
``bapo evaluate`` both read.

A module of its own, below both users: the training command (:mod:`bapo_trl.cli.data`) and the math recipe's evaluation
(:mod:`bapo_trl.recipes.math_reasoning.evaluate`) load datasets the same way, and the recipe must not depend on the
command line. ``datasets`` is imported only when a split is loaded.
"""

from __future__ import annotations

import os

#: File extension -> the ``datasets`` builder that reads it. A file is one split: the training split.
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


#: How ``bapo train`` names the flags :func:`load_split` reads (its dataset, the evaluation split) and its way out.
TRAIN_FLAGS = {"dataset": "`dataset_name`", "split": "`dataset_test_split`",
               "instead": " Or set `--eval_strategy no`."}
#: How ``bapo evaluate`` names them.
EVALUATE_FLAGS = {"dataset": "`--dataset`", "split": "`--split`", "instead": ""}


def load_split(name: str, config: str | None, split: str, train_split: str = "train", flags: dict = TRAIN_FLAGS):
    """The ``split`` of dataset ``name``: a .json/.jsonl/.parquet/.csv file (only ``train_split``: a file holds one
    split), a directory written by ``save_to_disk``, or a hub dataset id (with ``config``). Mistakes raise
    ``ValueError`` with what to pass instead, naming the caller's ``flags`` (:data:`TRAIN_FLAGS`,
    :data:`EVALUATE_FLAGS`)."""
    from datasets import load_dataset, load_from_disk

    ext = os.path.splitext(name)[1].lower()
    dataset_flag = flags["dataset"]
    if os.path.isfile(name):
        if ext not in FILE_FORMATS:
            raise ValueError(f"{dataset_flag} file {name!r} must end in one of {sorted(FILE_FORMATS)}.")
        if split != train_split:  # one file is one split: it would silently evaluate on the training prompts
            raise ValueError(
                f"{dataset_flag} {name!r} is a single file, which holds only the training split; evaluation (the "
                f"{split!r} split, from {flags['split']}) needs a dataset with that split: a directory saved with "
                f"`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a hub dataset.{flags['instead']}")
        return load_dataset(FILE_FORMATS[ext], data_files=name, split="train")
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
        dataset = load_from_disk(name)
        return dataset[split] if hasattr(dataset, "keys") else dataset
    if ext in FILE_FORMATS:
        raise ValueError(f"{dataset_flag} {name!r} looks like a file but does not exist.")
    return load_dataset(name, name=config, split=split)
