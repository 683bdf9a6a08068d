"""Both notebooks run top to bottom on the tiny offline model, in a scratch directory, as a user would run them."""

import pytest

from launching import REPO

NOTEBOOKS = ["bapo_quickstart.ipynb", "bapo_vs_grpo.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_end_to_end(name, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: offline, and the tiny model built into (and cached in) tmp_path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BAPO_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells), "commit notebooks with outputs cleared"

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
