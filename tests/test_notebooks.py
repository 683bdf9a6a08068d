"""Both notebooks run top to bottom on the tiny offline model, in a scratch directory, as a user would run them; they
are stored with the outputs of the code they show (``python scripts/execute_notebooks.py``) and import only the
package's public API (``bapo_trl``'s ``__all__``)."""

import ast
import importlib.util
import json

import pytest

import bapo_trl
from launching import REPO

NOTEBOOKS = ["bapo_quickstart.ipynb", "bapo_vs_grpo.ipynb"]
#: a stored notebook's size limit: outputs, figures included, but no widget state or huge logs
MAX_BYTES = 400_000


def _execute_notebooks():
    spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_listed():
    assert sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")) == sorted(NOTEBOOKS)


def non_public_uses(notebook: dict) -> tuple[list[str], list[str]]:
    """The names a notebook imports from ``bapo_trl``, and every use of it beyond ``from bapo_trl import X`` with X
    in ``bapo_trl.__all__``: a submodule import (``bapo_trl.cli...``, ``bapo_trl.recipes...``), an attribute path."""
    names, problems = [], []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bapo_trl":
                if node.module != "bapo_trl":
                    problems.append(f"imports the internal module {node.module}")
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                problems += [f"imports {a.name}" for a in node.names if a.name.startswith("bapo_trl.")]
        if "bapo_trl." in source.replace("bapo_trl.__version__", ""):
            problems.append("reaches into bapo_trl's modules (bapo_trl.<module>)")
    problems += [f"{name} is not in bapo_trl.__all__" for name in names if name not in bapo_trl.__all__]
    return names, problems


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_imports_only_public_names(name):
    names, problems = non_public_uses(json.loads((REPO / "notebooks" / name).read_text()))
    assert names and not problems, problems
    for public in names:
        assert getattr(bapo_trl, public) is not None


def test_the_check_catches_an_internal_import():
    def notebook(*lines):
        return {"cells": [{"cell_type": "code", "source": list(lines)}]}

    assert non_public_uses(notebook("from bapo_trl import BAPOTrainer, format_summary\n"))[1] == []
    assert non_public_uses(notebook("from bapo_trl.cli.summary import format_summary\n"))[1] == [
        "imports the internal module bapo_trl.cli.summary", "reaches into bapo_trl's modules (bapo_trl.<module>)"]
    assert non_public_uses(notebook("from bapo_trl import _compat\n"))[1] == ["_compat is not in bapo_trl.__all__"]
    assert non_public_uses(notebook("import bapo_trl\n", "bapo_trl.recipes.toy.build_tiny_model()\n"))[1] == [
        "reaches into bapo_trl's modules (bapo_trl.<module>)"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_with_the_outputs_of_its_code(name):
    """Every code cell ran, in order, without an error; the figures are there; the code is the code that ran (the
    digest ``scripts/execute_notebooks.py`` stores); and the file stays small."""
    import nbformat

    path = REPO / "notebooks" / name
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "run top to bottom, once"
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(bool(cell.outputs) for cell in code) >= len(code) // 2
    assert [o for o in outputs if "image/png" in o.get("data", {})], "the dynamics plot is stored"
    stored = notebook.metadata.get("bapo_trl", {}).get("executed_source_sha256")
    assert stored == _execute_notebooks().source_digest(notebook), (
        f"a code cell changed since {name} was run: python scripts/execute_notebooks.py notebooks/{name}")
    assert "widgets" not in notebook.metadata
    assert path.stat().st_size < MAX_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_end_to_end(name, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: offline, and the tiny model built into (and cached in) tmp_path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)  # stored with outputs: running replaces them

    repo_outputs = REPO / "notebooks" / "outputs"  # a user's own runs may have left files there: compare, not require
    before = {p: p.stat().st_mtime_ns for p in repo_outputs.rglob("*")} if repo_outputs.exists() else None
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on any failing cell

    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the dynamics plot is shown inline"
    outputs = tmp_path / "outputs"
    assert outputs.is_dir()  # written to the working directory...
    after = {p: p.stat().st_mtime_ns for p in repo_outputs.rglob("*")} if repo_outputs.exists() else None
    assert after == before  # ...and nothing written under the repository's notebooks/
    if name == "bapo_quickstart.ipynb":
        adapter = next(outputs.glob("*/adapter"))
        assert (adapter / "adapter_model.safetensors").is_file() and (adapter.parent / "dynamics.png").is_file()
