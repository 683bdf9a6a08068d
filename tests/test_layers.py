"""Layers, checked from the code: core < rollout sources < trainer < command line and recipes.

Every module of the package has a layer below; an import (anywhere in the module: top level, inside a function, under
``TYPE_CHECKING``) of a module of a HIGHER layer fails the test, and so does a module nobody placed. Same-layer
imports are allowed. Why: a lower layer that knows an upper one (the rollout sources calling back into the trainer,
the config loading the rollout package) is how cycles and untestable modules start.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bapo_trl"

CORE, ROLLOUT, TRAINER, OUTER = 0, 1, 2, 3
NAMES = {CORE: "core", ROLLOUT: "rollout sources", TRAINER: "trainer", OUTER: "command line and recipes"}
#: Module (or package prefix) -> layer. The longest matching prefix wins.
LAYERS = {
    "bapo_trl.core": CORE,
    "bapo_trl.reward_funcs": CORE,
    "bapo_trl.datasets_io": CORE, "bapo_trl.toy": CORE,
    "bapo_trl.models": CORE, "bapo_trl.generation": CORE,  # the vLLM plumbing the trainer mixes in
    "bapo_trl.rollout": ROLLOUT,
    "bapo_trl.trainer": TRAINER,
    "bapo_trl.cli": OUTER, "bapo_trl.math_recipe": OUTER, "bapo_trl.plot": OUTER,
    "bapo_trl.generation.serve": OUTER,  # the `bapo serve` command
}
#: Modules placed by their exact name only (no prefix match: a new top-level module must be placed on purpose).
EXACT = {"bapo_trl": OUTER, "bapo_trl._compat": OUTER}  # the package face: lazy names for users


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    if module in EXACT:
        return EXACT[module]
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


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
            problems.append(f"{here} has no layer: add it to tests/test_layers.py LAYERS")
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
        config: "from ..rollout.queue import SAMPLING\n",
    })
    assert len(problems) == 2
    assert "bapo_trl/rollout/partial.py:3" in problems[0] and "bapo_trl.trainer (trainer)" in problems[0]
    assert "bapo_trl/core/clipping.py:1" in problems[1] and "bapo_trl.rollout.queue (rollout sources)" in problems[1]


def test_a_module_without_a_layer_is_reported():
    problems = upward_imports({PACKAGE / "brand_new.py": "import os\n"})
    assert problems == ["bapo_trl.brand_new has no layer: add it to tests/test_layers.py LAYERS"]


def test_importing_the_config_or_the_rollout_package_loads_no_source(fresh_imports):
    """The config imports nothing from rollout/ but the rollout settings it inherits, and the rollout package's face
    imports lazily."""
    rollout = {m for m in fresh_imports["config"] if m == "bapo_trl.rollout" or m.startswith("bapo_trl.rollout.")}
    assert rollout == {"bapo_trl.rollout", "bapo_trl.rollout.settings"}
