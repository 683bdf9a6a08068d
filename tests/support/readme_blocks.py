"""README.md's python blocks and the output it shows under them (tested by test_readme.py; the real-model block runs
in test_smollm2.py)."""

import re

from support.launching import REPO

README = (REPO / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
#: The real-model example (SmolLM2, converted into the default cache): run by the slow tier, in
#: tests/test_smollm2.py, not here (a fresh cache would fetch the model's wheel from the package registry).
REAL_MODEL_BLOCK = next(i for i, block in enumerate(PYTHON_BLOCKS) if 'prepare_model("smollm2")' in block)


def shown_output(index: int) -> str:
    """The ```text block right after the python block ``index`` (what the README says it prints)."""
    after = README.split(f"```python\n{PYTHON_BLOCKS[index]}```", 1)[1]
    return re.match(r"(?:(?!```).)*```text\n(.*?)```", after, flags=re.S).group(1).strip()  # no block between
