"""Layers, read from the folders: core < generation < rollout sources < trainer < reporting < research candidates <
recipes < command line.

A module's layer is the folder of ``bapo_trl/`` it is in; the package face (``bapo_trl/__init__.py`` and
``config.py``, the path old runs' ``training_args.bin`` pickle ``BAPOConfig`` under) sits above them all, and any
other module outside the folders fails. An import
(anywhere in the module: top level, inside a function, under ``TYPE_CHECKING``) of a module of a HIGHER layer fails
the test; same-layer imports are allowed, as long as no chain of imports runs in a circle. Why: a lower layer that
knows an upper one (the rollout sources calling back into the trainer, the config loading a rollout source) is how
cycles and untestable modules start.

The tests are shaped like the package: no module under ``tests/`` imports a test module (``test_*``); a helper that
several test modules share lives in ``tests/support/`` (or is a ``conftest.py`` fixture), in one place.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bapo_trl"
TESTS = ROOT / "tests"

#: The layers, lowest first: one folder of bapo_trl/ each.
LAYERS = ("core", "generation", "rollout", "trainer", "reporting", "experimental", "recipes", "cli")
FACE = len(LAYERS)
NAMES = {**dict(enumerate(("core", "generation", "rollout sources", "trainer", "reporting", "research candidates",
                            "recipes", "command line"))),
         FACE: "package face"}
#: The modules outside the folders: the package face.
EXACT = {"bapo_trl": FACE, "bapo_trl.config": FACE}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of a module: its folder's; None for a module outside every layer's folder."""
    if module in EXACT:
        return EXACT[module]
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[0] == "bapo_trl" and parts[1] in LAYERS else None


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """``(line, bapo_trl module)`` for every import of the package in the file, relative ones resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "bapo_trl"]
    return found


def upward_imports(files: dict[Path, str | None]) -> list[str]:
    problems = []
    for path, source in files.items():
        here = module_name(path)
        mine = layer_of(here)
        if mine is None:
            problems.append(f"{here} has no layer: move it into the folder of its layer, one of {', '.join(LAYERS)}")
            continue
        for line, target in imports(path, source):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {here} ({NAMES[mine]}) imports {target} "
                                f"({NAMES[theirs]}), a higher layer")
    return problems


def package_files() -> dict[Path, None]:
    return {path: None for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_imports_a_higher_layer():
    assert upward_imports(package_files()) == []


def test_an_upward_import_is_caught():
    """The check itself: a rollout source that imports the trainer (even only for a type) and a config that loads the
    rollout package are both reported, with the file and line."""
    source = PACKAGE / "rollout" / "partial.py"
    config = PACKAGE / "core" / "clipping.py"
    problems = upward_imports({
        source: "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..trainer import BAPOTrainer\n",
        config: "from ..rollout.replay_queue import SAMPLING\n",
    })
    assert len(problems) == 2
    assert "bapo_trl/rollout/partial.py:3" in problems[0] and "bapo_trl.trainer (trainer)" in problems[0]
    assert ("bapo_trl/core/clipping.py:1" in problems[1]
            and "bapo_trl.rollout.replay_queue (rollout sources)" in problems[1])


def test_a_module_without_a_layer_is_reported():
    problems = upward_imports({PACKAGE / "brand_new.py": "import os\n"})
    assert problems == ["bapo_trl.brand_new has no layer: move it into the folder of its layer, "
                        "one of core, generation, rollout, trainer, reporting, experimental, recipes, cli"]


def test_importing_the_config_or_the_rollout_package_loads_no_source(fresh_imports):
    """The config imports nothing from rollout/ but the rollout settings it inherits, and the rollout package's face
    imports lazily."""
    rollout = {m for m in fresh_imports["config"] if m == "bapo_trl.rollout" or m.startswith("bapo_trl.rollout.")}
    assert rollout == {"bapo_trl.rollout", "bapo_trl.rollout.settings"}


def import_cycles(files: dict[Path, str | None]) -> list[list[str]]:
    """Every circle of imports between the package's modules (any import, wherever it stands), each once."""
    known = {module_name(path) for path in files}
    graph = {}
    for path, source in files.items():
        targets = set()
        for _, target in imports(path, source):
            while target and target not in known:  # `from .x import name`: the module is x
                target = target.rpartition(".")[0]
            if target and target != module_name(path):
                targets.add(target)
        graph[module_name(path)] = targets
    cycles, state = [], {}

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycle():
    """Inside a layer too (a package's face importing its own modules lazily is no cycle: they never import it)."""
    cycles = import_cycles(package_files())
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_an_import_cycle_is_caught():
    pool, queue = PACKAGE / "rollout" / "pool.py", PACKAGE / "rollout" / "replay_queue.py"
    assert import_cycles({pool: "from .replay_queue import ReplayQueue\n", queue: "from . import pool\n"}) == [
        ["bapo_trl.rollout.pool", "bapo_trl.rollout.replay_queue", "bapo_trl.rollout.pool"]]


def test_core_imports_torch_and_the_standard_library_only():
    """The method stays a set of pure tensor functions: nothing of TRL, transformers or the rest of the package."""
    problems = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            problems += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                         if name.split(".")[0] not in sys.stdlib_module_names | {"torch"}]
    assert problems == []


def test_the_public_face_takes_nothing_from_the_commands():
    """``bapo_trl``'s names live in library modules (the plot callback and the summary as TRL keeps its callbacks,
    in the trainer's folder); ``cli/`` only parses and calls them."""
    import bapo_trl

    assert {name: where for name, where in bapo_trl._EXPORTS.items() if where.startswith("bapo_trl.cli")} == {}


def imports_of_test_modules(files: dict[Path, str | None]) -> list[str]:
    """``file:line`` of every import of a test module (a module named ``test_*``) in the files: ``import test_x``,
    ``from test_x import ...``, ``from . import test_x``, ``importlib.import_module("test_x")`` or
    ``__import__("test_x")``, anywhere in the file (top level, inside a function, under a condition)."""
    problems = []
    for path, source in files.items():
        for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.module else [a.name for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
                names = [node.args[0].value]
            else:
                continue
            problems += [f"{path.relative_to(ROOT)}:{node.lineno}: imports the test module {name}" for name in names
                         if any(part.startswith("test_") for part in name.split("."))]
    return problems


def test_no_test_module_is_imported_by_another_module():
    """A helper a test module defines and another module needs moves to ``tests/support/`` (the test module then
    imports it from there too): importing a test module runs its module-level code and its fixtures in a second place,
    and hides which tests a change to it touches."""
    problems = imports_of_test_modules({path: None for path in sorted(TESTS.rglob("*.py"))})
    assert problems == [], "move the helper into tests/support/:\n" + "\n".join(problems)


def test_an_import_of_a_test_module_is_caught():
    """The check itself: each form is reported with its file and line, a nested one too; support modules and names
    that only start like a test module (``testing``, ``test``) are not."""
    problems = imports_of_test_modules({
        TESTS / "test_a.py": "import os\nimport test_b\nfrom support.harness import cpu_config\n",
        TESTS / "test_c.py": "def f():\n    if True:\n        from test_d import helper\n",
        TESTS / "support" / "x.py": "import importlib\nimport testing\nimportlib.import_module('test_e')\n",
        TESTS / "dist_scripts" / "y.py": "from . import test_f\nimport test\nx = __import__('test_g')\n",
    })
    assert problems == [
        "tests/test_a.py:2: imports the test module test_b",
        "tests/test_c.py:3: imports the test module test_d",
        "tests/support/x.py:3: imports the test module test_e",
        "tests/dist_scripts/y.py:1: imports the test module test_f",
        "tests/dist_scripts/y.py:3: imports the test module test_g",
    ]


def test_the_trainer_module_keeps_the_trainer_under_200_lines():
    """Issue 78 (4): ``BAPOTrainer``'s module holds its two overrides and the run's lifecycle; what grows goes to a
    module of its own (the loss hook's helpers, the card's metadata, the checkpoints)."""
    lines = len((PACKAGE / "trainer" / "bapo_trainer.py").read_text().splitlines())
    assert lines < 200, f"bapo_trl/trainer/bapo_trainer.py has {lines} lines"


#: The research candidates' names (bapo_trl.experimental): none appears in the method's package outside their folder.
CANDIDATE_NAMES = ("gmpo", "length_fair", "length-fair", "lengthfair", "decoupled")
#: The one file outside the folders that names a candidate, by the project's rule that every private TRL name the
#: package touches is listed in trainer/trl_seams.py (GMPO's seams are TRL's experimental GMPO's private methods).
NAMES_EVERY_TRL_SEAM = "bapo_trl/trainer/trl_seams.py"


def test_a_candidate_is_its_folder_the_method_names_none_of_them():
    """Issue 78 (3): "a candidate is one folder and zero edits elsewhere" (docs/experimental.md): no module of the
    method names a candidate (a docstring included), so adding or deleting one touches its folder only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("bapo_trl/experimental/") or relative == NAMES_EVERY_TRL_SEAM:
            continue
        text = path.read_text().lower()
        found += [f"{relative}: {name}" for name in CANDIDATE_NAMES if name in text]
    assert not found, found


#: Tests outside tests/experimental that name candidates: the tests of the lab's scripts, which run the studies'
#: candidates beside the method (benchmarks/, scripts/gpu_check.py), and this file, which lists their names.
LAB_TESTS = {"tests/test_study.py", "tests/test_benchmarks.py", "tests/test_gpu_check.py", "tests/test_layers.py"}


def test_the_methods_tests_name_no_candidate():
    """A candidate's tests are in tests/experimental: the method's tests and their shared machinery (tests/support:
    the guarantee rows take a candidate's classes and checks as arguments) name none, so deleting a candidate's
    folder and its tests leaves the method's suite whole."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("tests/experimental/") or relative in LAB_TESTS:
            continue
        text = path.read_text().lower()
        found += [f"{relative}: {name}" for name in CANDIDATE_NAMES if name in text]
    assert not found, found


def test_the_generation_folder_keeps_its_modules_under_380_lines():
    """Issue 78 (4): a generation module that grows past 380 lines splits by what it does (the vLLM backend's LoRA
    push left ``vllm_generation.py`` for ``lora_push.py``)."""
    long = {path.name: n for path in sorted((PACKAGE / "generation").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > 380}
    assert not long, long
