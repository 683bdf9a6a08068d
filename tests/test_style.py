"""House style, checked in the fast tier: ruff (pyflakes, pycodestyle, import order; settings in pyproject.toml,
after TRL's: line length 119) over the package, the scripts, the benchmarks and the tests."""

import subprocess
import sys

from launching import REPO


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "bapo_trl", "tests", "benchmarks",
                           "train_bapo.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
