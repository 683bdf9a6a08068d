"""The README's examples are tested: python blocks are executed, training commands are parsed."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from launching import REPO

README = (REPO / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def commands():
    """`python train_bapo.py ...`, `accelerate launch ... train_bapo.py ...` and `bapo train ...` lines, continuations
    joined."""
    for block in BASH_BLOCKS:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if "train_bapo.py" in line or line.startswith("bapo train"):
                yield line


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_examples_run(index, tmp_path):
    env = {**os.environ, "BAPO_TRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_search_example_prints_the_documented_window():
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[1]], capture_output=True, text=True, timeout=120)
    assert "'clip_low': 0.6" in proc.stdout and "'clip_high': 1.5" in proc.stdout


@pytest.mark.parametrize("command", list(commands()))
def test_training_commands_parse(command):
    from bapo_trl.cli.train import make_parser, parse_args

    argv = shlex.split(command)
    argv = argv[argv.index("train_bapo.py") + 1 :] if "train_bapo.py" in argv else argv[argv.index("train") + 1 :]
    if "--bf16" in argv:  # a GPU command: on this CPU machine check everything but the precision flags
        argv += ["--bf16", "false", "--use_cpu", "true"]
    script_args, training_args, model_args = parse_args(argv, parser=make_parser())
    assert training_args.output_dir


def test_the_layout_table_names_every_module_of_the_package():
    """README's 'Project layout' table stays true: every module and subpackage of bapo_trl appears in it."""
    section = README.split("## Project layout")[1].split("\n## ")[0]
    package = REPO / "bapo_trl"
    for path in sorted(package.iterdir()):
        if path.name.startswith("_") or path.name == "__pycache__":
            continue
        name = f"bapo_trl/{path.name}" + ("/" if path.is_dir() else "")
        assert f"`{name}`" in section, f"{name} is missing from README's Project layout"
