"""Local dataset files for train_bapo.py: every format the README names (.json, .jsonl, .parquet, .csv)."""

import json

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
