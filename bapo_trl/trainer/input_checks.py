"""Checks of what the user passes the trainer, run at construction before TRL loads anything (``bapo train`` runs them
too, with its flags as the fix). Imports no torch or TRL."""

from __future__ import annotations


def check_prompt_column(dataset, name: str = "train_dataset", column: str = "prompt",
                        why: str = ", where TRL's GRPOTrainer reads the prompts",
                        fix: str = "Rename the one that holds them: `dataset.rename_column(NAME, 'prompt')`.") -> None:
    """Raise ``ValueError`` when ``dataset`` has no ``column``, naming the columns it has (``bapo train`` uses it too,
    with its flag as the fix). A dict of datasets (``eval_dataset``) is checked set by set; an ``IterableDataset``
    whose columns are unknown (``column_names`` None) by its first example; a dataset of another kind is not checked.
    """
    if isinstance(dataset, dict):
        for key, part in dataset.items():
            check_prompt_column(part, f"{name}[{key!r}]", column, why, fix)
        return
    from datasets import IterableDataset

    columns = getattr(dataset, "column_names", None)
    if columns is None and isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        columns = None if not isinstance(first, dict) else list(first)
    if columns is not None and column not in columns:
        raise ValueError(f"{name} has no column {column!r}{why}; its columns are {list(columns)}. {fix}")
