"""House style, checked in the fast tier: ruff (pyflakes, pycodestyle, import order; settings in pyproject.toml,
after TRL's: line length 119) over the whole repository: the package, tests, benchmarks, scripts, recipes and
the notebooks (ruff reads ``.ipynb``)."""

import subprocess
import sys

from support.launching import REPO


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
