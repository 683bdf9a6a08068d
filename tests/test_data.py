"""Local dataset files for train_bapo.py: every format the README names (.json, .jsonl, .parquet, .csv)."""

import json
import re

import pytest
from datasets import Dataset

from bapo_trl.cli.data import FILE_FORMATS, load_prompts
from bapo_trl.cli.train import parse_args

ROWS = [{"question": f"{i:03d}>", "answer": f"{i:03d}"[::-1]} for i in range(6)]


def write(path, rows):
    """Each format as a user would have it: a JSON array, JSON lines, parquet, csv."""
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif path.suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        Dataset.from_list(rows).to_csv(str(path), index=False)


def load(path, *flags):
    script_args, training_args, _ = parse_args(["--dataset_name", str(path), *flags,
                                                "--output_dir", str(path.parent / "out")])
    return load_prompts(script_args, training_args)


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet", ".csv"])
def test_every_documented_file_format_loads_its_prompts(suffix, tmp_path):
    assert suffix in FILE_FORMATS
    path = tmp_path / f"prompts{suffix}"
    write(path, ROWS)
    train, evaluation = load(path, "--prompt_column", "question")
    assert evaluation is None
    assert train.column_names == ["prompt", "answer"]
    assert train["prompt"] == [r["question"] for r in ROWS]
    # csv carries no types: digit strings come back as numbers
    expected = [int(r["answer"]) if suffix == ".csv" else r["answer"] for r in ROWS]
    assert train["answer"] == expected


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_chat_message_prompts_load_from_files(suffix, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i:03d}>"}]} for i in range(3)]
    path = tmp_path / f"chat{suffix}"
    write(path, rows)
    train, _ = load(path)
    assert train["prompt"] == [r["prompt"] for r in rows]


def test_an_unknown_file_format_is_refused(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("123>\n")
    with pytest.raises(ValueError, match=r"must end in one of \['.csv', '.json', '.jsonl', '.parquet'\]"):
        load(path)


def _bad_rows():
    yield from ROWS  # question and answer, no prompt


@pytest.mark.parametrize("kind", ["train", "iterable", "eval_dict"])
def test_a_dataset_without_a_prompt_column_is_refused_when_the_trainer_is_built(kind, tmp_path):
    """The Python API checks as ``bapo train`` does (issue 52): before any model is loaded (here: a model path that
    does not exist), naming the dataset and the columns it has; an IterableDataset without known columns is read
    by its first example, an eval set of several datasets set by set."""
    from datasets import IterableDataset

    from bapo_trl import BAPOTrainer
    from bapo_trl.trainer.input_checks import check_prompt_column
    from support.harness import cpu_config

    good, bad = Dataset.from_list([{"prompt": "123>"}]), Dataset.from_list(ROWS)
    datasets, name = {"train": ({"train_dataset": bad}, "`train_dataset`"),
                      "iterable": ({"train_dataset": IterableDataset.from_generator(_bad_rows)}, "`train_dataset`"),
                      "eval_dict": ({"train_dataset": good, "eval_dataset": {"easy": good, "hard": bad}},
                                    "`eval_dataset`['hard']")}[kind]
    if kind == "iterable":
        assert datasets["train_dataset"].column_names is None  # the case the check must read an example for
    args = cpu_config(tmp_path, gradient_checkpointing=True)  # TRL's default, as this check has always run
    with pytest.raises(ValueError, match=re.escape(f"{name} has no column 'prompt'") + ".*"
                       + re.escape("its columns are ['question', 'answer']")):
        BAPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda completions, **kw: [0.0], args=args,
                    **datasets)
    check_prompt_column(IterableDataset.from_generator(lambda: iter([{"prompt": "1>"}])))  # has one: no error
