"""Both notebooks run top to bottom on the tiny offline model, in a scratch directory, as a user would run them; they
are stored with the outputs of the code they show (``python scripts/execute_notebooks.py``) and import only the
package's public API (``bapo_trl``'s ``__all__``). A fresh run prints what the stored one printed, every number
within :data:`TOLERANCE` (slow tier), so the text that quotes the stored numbers holds for a reader who runs them.
The README links them, and the ``notebooks`` extra installs a Jupyter to open them in. The quickstart's
``USE_SMOLLM2`` branch is not run here (its imports are checked as public names; the parts it calls run on SmolLM2 in
tests/test_smollm2.py: the README's real-model example, LoRA on stale SmolLM2 data): run with the switch on, it took
90 s of CI per run."""

import ast
import configparser
import importlib.util
import json
import math
import re
import warnings

import pytest

import bapo_trl
from support.launching import REPO

NOTEBOOKS = ["bapo_quickstart.ipynb", "bapo_vs_grpo.ipynb"]
#: a stored notebook's size limit: outputs, figures included, but no widget state or huge logs
MAX_BYTES = 400_000
#: How far a number a fresh run prints may be from the stored one (absolute). The runs are seeded (the trainer's
#: ``seed=0``, which TRL also sets before the LoRA weights are drawn; the sample reports seed their own sampling), and
#: on a CPU of the kind they were stored on a fresh run printed every number exactly (3 runs of each notebook, a fresh
#: model cache for one). The tolerance absorbs a last-digit rounding difference only. Another kind of CPU changes the
#: sums and, over the 800 warm-start steps and 96-120 training steps, the numbers (an AMD EPYC and an Intel Xeon with
#: AVX-512 print others): a run is compared with the stored run of its own kind (scripts/execute_notebooks.py keeps
#: one per kind), and on a kind with none recorded only with the stored text, numbers aside (with a warning naming
#: the command that records it). Other torch / transformers versions can change the numbers too: run
#: ``python scripts/execute_notebooks.py`` there, and reread the text that quotes them.
TOLERANCE = 0.02
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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
    assert non_public_uses(notebook("from bapo_trl.reporting.summary import format_summary\n"))[1] == [
        "imports the internal module bapo_trl.reporting.summary",
        "reaches into bapo_trl's modules (bapo_trl.<module>)"]
    assert non_public_uses(notebook("from bapo_trl import config\n"))[1] == ["config is not in bapo_trl.__all__"]
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
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_end_to_end(name, tmp_path, monkeypatch):
    """Run top to bottom in a scratch directory, a fresh model cache: every number it prints is the stored one within
    TOLERANCE."""
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
    runner = _execute_notebooks()
    stored = nbformat.read(REPO / "notebooks" / name, as_version=4)
    here, fresh = runner.cpu_kind(), runner.printed(runner.compact(notebook))
    expected = runner.printed_on(name, stored, here)
    if expected is None:  # the text only: the numbers of this kind of CPU were never recorded
        warnings.warn(f"{name}: no stored run on a CPU of this kind ({here}): its printed numbers are not compared "
                      f"(record them: python scripts/execute_notebooks.py notebooks/{name})")
    differences = printed_differences(runner.printed(stored) if expected is None else expected, fresh,
                                      math.inf if expected is None else TOLERANCE)
    assert differences == [], "\n".join(differences)  # the numbers the text quotes are the ones a run prints

    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the dynamics plot is shown inline"
    outputs = tmp_path / "outputs"
    assert outputs.is_dir()  # written to the working directory...
    after = {p: p.stat().st_mtime_ns for p in repo_outputs.rglob("*")} if repo_outputs.exists() else None
    assert after == before  # ...and nothing written under the repository's notebooks/
    if name == "bapo_quickstart.ipynb":
        adapter = next(outputs.glob("*/adapter"))
        assert (adapter / "adapter_model.safetensors").is_file() and (adapter.parent / "dynamics.png").is_file()


def printed_differences(before: dict[str, str], after: dict[str, str], tolerance: float = TOLERANCE) -> list[str]:
    """Where ``after`` (what each cell printed, by cell index) printed other text than ``before``, or a number more
    than ``tolerance`` away from it."""
    problems = []
    for index in sorted(before.keys() | after.keys(), key=int):
        old, new = before.get(index, ""), after.get(index, "")
        if NUMBER.sub("#", old) != NUMBER.sub("#", new):
            problems.append(f"cell {index}: printed {new!r}, stored {old!r}")
            continue
        for a, b in zip(NUMBER.findall(old), NUMBER.findall(new)):
            if abs(float(a) - float(b)) > tolerance:
                problems.append(f"cell {index}: printed {b} where the stored output says {a}")
    return problems


def _printing(text, cpu=None):
    """A one-cell notebook that printed ``text`` (and a warning, which is not compared), run on ``cpu``."""
    return {"metadata": {"bapo_trl": {"cpu": cpu}} if cpu else {}, "cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": text},
        {"output_type": "stream", "name": "stderr", "text": "a warning 12.5"}]}]}


def test_the_comparison_catches_a_number_that_moved():
    def printing(reward, sampled, row="held-out"):
        return _execute_notebooks().printed(_printing(f" {row} prompts             {reward}            {sampled}\n"))

    stored = printing("0.41", "0.15")
    assert printed_differences(stored, printing("0.42", "0.15")) == []
    assert printed_differences(stored, printing("0.13", "0.15")) == [
        "cell 0: printed 0.13 where the stored output says 0.41"]
    assert printed_differences(stored, printing("0.41", "0.15", row="training"))
    # on a CPU with no run recorded: the text, any numbers
    assert printed_differences(stored, printing("0.13", "0.95"), math.inf) == []
    assert printed_differences(stored, printing("0.13", "0.95", row="training"), math.inf)


def test_a_run_is_compared_with_the_stored_run_of_its_cpu_kind(tmp_path, monkeypatch):
    """The notebook's own outputs on its kind, the kept run of another kind, none on a third; re-executing keeps the
    replaced run of another kind while the code is the same, and forgets every other kind's run once it changes."""
    import nbformat

    runner = _execute_notebooks()
    monkeypatch.setattr(runner, "OTHER_CPUS", tmp_path / "other.json")
    intel, amd = "GenuineIntel AVX512", "AuthenticAMD AVX2"

    def run(text, cpu, digest="d1"):
        notebook = nbformat.from_dict(_printing(text, cpu))
        notebook.metadata["bapo_trl"]["executed_source_sha256"] = digest
        return notebook

    old = nbformat.from_dict(_printing("reward 0.41\n"))  # stored before the kind was recorded: AMD, any extensions
    old.metadata["bapo_trl"] = {"executed_source_sha256": "d1"}
    assert runner.printed_on("n", old, amd) == {"0": "reward 0.41\n"} and runner.printed_on("n", old, intel) is None
    new = run("reward 0.66\n", intel)
    runner.keep_other_cpus("n", old, new)
    assert runner.printed_on("n", new, intel) == {"0": "reward 0.66\n"}
    assert runner.printed_on("n", new, amd) == {"0": "reward 0.41\n"}  # kept
    assert runner.printed_on("n", new, "GenuineIntel AVX2") is None
    again = run("reward 0.66\n", intel)
    runner.keep_other_cpus("n", new, again)  # the same kind again: the kept AMD run stays
    assert runner.printed_on("n", again, amd) == {"0": "reward 0.41\n"}
    changed = run("reward 0.70\n", intel, digest="d2")
    runner.keep_other_cpus("n", again, changed)  # the code changed: the AMD run is another program's
    assert runner.printed_on("n", changed, amd) is None and json.loads(runner.OTHER_CPUS.read_text()) == {}


def test_kept_runs_of_other_cpus_ran_the_stored_code():
    """Every run kept for another kind of CPU printed as many cells as the stored notebook has code cells, and its
    text is the stored text (the numbers aside): kept runs of replaced code are dropped when a notebook is re-run."""
    import nbformat

    runner = _execute_notebooks()
    kept = json.loads(runner.OTHER_CPUS.read_text()) if runner.OTHER_CPUS.exists() else {}
    assert set(kept) <= set(NOTEBOOKS)
    for name, runs in kept.items():
        notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
        for kind, cells in runs.items():
            assert not runner.same_cpu(runner.recorded_cpu(notebook), kind), (name, kind)  # its own run is stored
            assert printed_differences(runner.printed(notebook), cells, math.inf) == [], (name, kind)


def test_the_readme_links_every_notebook_and_the_extra_installs_jupyter():
    readme = (REPO / "README.md").read_text()
    for name in NOTEBOOKS:
        assert f"(notebooks/{name})" in readme, name
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extra = config["options.extras_require"]["notebooks"].split()
    assert any(re.match(r"(jupyterlab|notebook)\b", requirement) for requirement in extra), extra
    assert '".[notebooks]"' in readme and "jupyter lab notebooks/" in readme
