"""The TRL seam check: every private TRL method/attribute bapo_trl builds on is present, and a missing or changed
one stops the import with a message naming it and the tested TRL versions.

And the scan that keeps that list complete: every private trl/transformers name bapo_trl touches, and every
trl/transformers method or class attribute a bapo_trl class (or mixin) overrides, must be a seam; an unlisted one
fails, named by file and line."""

import ast
import functools
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trl import GRPOTrainer

import bapo_trl
from bapo_trl.trainer.trl_seams import SEAMS, TESTED_TRL_VERSIONS, Seam, check_trl_seams, seam_problems


def test_the_installed_trl_has_every_seam():
    assert seam_problems() == []


def test_a_removed_method_is_named(monkeypatch):
    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(ImportError) as err:
        check_trl_seams()
    assert "GRPOTrainer._generate_single_turn is missing" in str(err.value)
    assert TESTED_TRL_VERSIONS in str(err.value) and "pip install 'trl>=1.16,<1.17'" in str(err.value)


def test_a_changed_signature_is_named(monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", lambda self, model, batch: None)
    problems = seam_problems()
    assert len(problems) == 1 and "_get_per_token_logps_and_entropies takes ['model', 'batch']" in problems[0]


def test_a_loss_that_stopped_reading_epsilon_is_named(monkeypatch):
    def _compute_loss(self, model, inputs):  # clips with something else: our window would be ignored
        return self.clip_range

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", _compute_loss)
    problems = seam_problems()
    assert len(problems) == 1 and "self.epsilon_low" in problems[0] and "_compute_loss" in problems[0]


def test_each_seam_is_listed_once():
    assert len({s.target for s in SEAMS}) == len(SEAMS)


def test_importing_the_trainer_fails_loudly_when_a_seam_is_gone():
    code = ("import trl.trainer.grpo_trainer as g; del g.GRPOTrainer._generate_and_score_completions; "
            "import bapo_trl.trainer.bapo_trainer")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ImportError: bapo_trl was tested with TRL" in proc.stderr
    assert "_generate_and_score_completions is missing" in proc.stderr


# -- the scan: every private TRL/transformers name bapo_trl touches, and every TRL/transformers attribute a bapo_trl
# class overrides, is a seam -----------------------------------------------------------------------------------------

#: Top-level packages whose names are seams.
EXTERNAL = ("trl", "transformers")
#: Modules whose private names count, besides those the scan finds itself: every trl/transformers module bapo_trl
#: imports (and the module defining each name it imports), and the module of every class in the MRO of a
#: trl/transformers class that a bapo_trl class subclasses.
TRL_MODULES = ("trl.trainer.grpo_trainer", "trl.trainer.utils", "trl.generation.vllm_generation",
               "trl.generation.vllm_client", "trl.models.utils", "transformers.trainer",
               "transformers.configuration_utils")
PACKAGE_DIR = Path(bapo_trl.__file__).resolve().parent
_PRIVATE = re.compile(r"_[A-Za-z0-9]\w*\Z")  # `_x`: neither a dunder nor a name-mangled `__x`
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def _is_private(name) -> bool:
    return isinstance(name, str) and _PRIVATE.match(name) is not None


def _is_external(dotted: str) -> bool:
    return dotted.split(".")[0] in EXTERNAL


@dataclass
class _Class:
    """A ``class`` statement of bapo_trl."""

    module: str
    name: str
    bases: list[str]  # dotted names, through the module's imports
    body: dict[str, str]  # each name its body defines (method, class attribute) -> where


@dataclass
class _Use:
    """A private name in bapo_trl code: an attribute, an import from trl/transformers, a keyword, a string, or a
    parameter of a method."""

    name: str
    where: str
    how: str
    owner: str | None = None  # the class whose own object (self, cls, super()) it goes through; None: any object


class _ModuleScan(ast.NodeVisitor):
    """One bapo_trl module: its imports, its classes, its private names."""

    def __init__(self, label: str, module: str, is_package: bool, source: str):
        self.label, self.module = label, module
        self.package = module if is_package else module.rpartition(".")[0]
        tree = ast.parse(source, filename=label)
        self.imports: dict[str, str] = {}  # local name -> dotted name it was imported as
        self.external_imports: set[str] = set()  # dotted trl/transformers names imported
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:  # `import a.b` binds `a`
                        self.imports[alias.name.split(".")[0]] = alias.name.split(".")[0]
                    if _is_external(alias.name):
                        self.external_imports.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                source_module = self._absolute(node)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{source_module}.{alias.name}"
                    if _is_external(source_module):
                        self.external_imports.add(f"{source_module}.{alias.name}")
        self.classes: list[_Class] = []
        self.uses: list[_Use] = []
        self._stack: list[ast.AST] = []  # enclosing classes and functions
        self.visit(tree)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        parts = self.package.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{base}.{node.module}" if node.module else base

    def _where(self, node) -> str:
        return f"{self.label}:{node.lineno}"

    def _dotted(self, node) -> str | None:
        """``a.b.C`` for a base-class expression, its first name resolved through the imports."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id, f"{self.module}.{node.id}")
        if isinstance(node, ast.Attribute):
            head = self._dotted(node.value)
            return None if head is None else f"{head}.{node.attr}"
        if isinstance(node, ast.Subscript):  # Generic[T]
            return self._dotted(node.value)
        return None

    def _owner(self) -> str | None:
        classes = [n for n in self._stack if isinstance(n, ast.ClassDef)]
        return f"{self.module}.{classes[-1].name}" if classes else None

    def visit_ClassDef(self, node):
        body = {}
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [stmt.name]
            elif isinstance(stmt, ast.Assign):
                names = [n.id for target in stmt.targets for n in ast.walk(target) if isinstance(n, ast.Name)]
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names = [stmt.target.id]
            else:
                names = []
            for name in names:
                body.setdefault(name, self._where(stmt))
        bases = [b for b in map(self._dotted, node.bases) if b is not None]
        self.classes.append(_Class(self.module, node.name, bases, body))
        self._stack.append(node)
        self.generic_visit(node)
        self._stack.pop()

    def visit_FunctionDef(self, node):
        if self._stack and isinstance(self._stack[-1], ast.ClassDef):  # a method: private parameters count
            arguments = node.args
            for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
                if _is_private(arg.arg):
                    self.uses.append(_Use(arg.arg, self._where(arg), "parameter", self._owner()))
        self._stack.append(node)
        self.generic_visit(node)
        self._stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node):
        if _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            imported = isinstance(root, ast.Name) and root.id in self.imports
            if not (imported and not _is_external(self.imports[root.id])):  # not another library's, nor ours
                own = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) or (
                    isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "super")
                self.uses.append(_Use(node.attr, self._where(node), "attribute", self._owner() if own else None))
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if not node.level and _is_external(node.module):
            for alias in node.names:
                if _is_private(alias.name):
                    self.uses.append(_Use(alias.name, self._where(node), f"imported from {node.module}"))

    def visit_Call(self, node):
        for keyword in node.keywords:
            if _is_private(keyword.arg):
                self.uses.append(_Use(keyword.arg, self._where(keyword), "keyword argument"))
        self.generic_visit(node)

    def visit_Constant(self, node):  # getattr(obj, "_x"), setattr(...), a patched name...
        if _is_private(node.value):
            self.uses.append(_Use(node.value, self._where(node), "string"))

    def visit_JoinedStr(self, node):  # the literal parts of an f-string are text, not names
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                self.visit(value)


@functools.cache
def _module_scan(label: str, module: str, is_package: bool, source: str) -> _ModuleScan:
    return _ModuleScan(label, module, is_package, source)


def _package_sources():
    """``(label, module, is_package, source)`` for every module of the installed-from package directory."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        yield rel.as_posix(), ".".join(parts), is_package, path.read_text()


@functools.cache
def _resolve(dotted: str):
    """The object a dotted name stands for (its longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:cut]).startswith(err.name):
                raise
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _source_file(obj) -> str | None:
    """The trl/transformers file that defines ``obj`` (a decorated function's own, not its decorator's); None for a
    constant, a builtin, or something defined elsewhere."""
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj))
    except TypeError:
        return None
    return path if path is not None and _short(path) is not None else None


@functools.cache
def _external_dirs() -> dict[Path, str]:
    """The folder of each installed trl/transformers package -> its name."""
    return {Path(importlib.import_module(root).__file__).resolve().parent: root for root in EXTERNAL}


def _short(path: str) -> str | None:
    """``trl/trainer/grpo_trainer.py`` for a file of the installed trl/transformers; None for any other file."""
    resolved = Path(path).resolve()
    for folder in _external_dirs():
        if resolved.is_relative_to(folder):
            return resolved.relative_to(folder.parent).as_posix()
    return None


@functools.cache
def _defined_private_names(path: str) -> frozenset[str]:
    """The private names a trl/transformers source defines: module-level names (functions, classes, assignments,
    imports), class attributes and methods, ``self._x = ...`` attributes, and parameters."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    names = set()

    def module_level(statements):
        for stmt in statements:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)):  # `if is_x_available():`, `try: import x`
                for block in ("body", "orelse", "finalbody"):
                    module_level(getattr(stmt, block, []))
                for handler in getattr(stmt, "handlers", []):
                    module_level(handler.body)

    module_level(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            names.update(a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs)
    return frozenset(n for n in names if _is_private(n))


@functools.cache
def _trl_attributes(cls: type) -> dict[str, tuple[str, bool]]:
    """Every attribute a trl/transformers class has from trl/transformers code (its own or a base's: methods, class
    attributes, dataclass fields, ``self.x = ...`` in its source) -> (the class defining it, whether the class itself
    has it, as opposed to its instances only)."""
    found = {}
    for base in reversed(cls.__mro__):
        if not _is_external(base.__module__):
            continue
        names = set(vars(base)) | set(vars(base).get("__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):
            tree = None
        if tree is not None:
            names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"}
        for name in names:
            if not (name.startswith("__") and name.endswith("__")):
                found[name] = (f"{base.__module__}.{base.__qualname__}", hasattr(cls, name))
    return found


def _listed(seams) -> tuple[set[str], set[str]]:
    """(names that are the last part of a seam's target, every name a seam lists: targets, params, mentions)."""
    targets = {s.target.partition(":")[2].split(".")[-1] for s in seams}
    names = set(targets)
    for seam in seams:
        names.update(seam.params)
        for mention in seam.mentions:
            names.update(_IDENTIFIER.findall(mention))
    return targets, names


@dataclass
class SeamScan:
    """What the scan saw: bapo_trl's classes that build on trl/transformers classes, and the names it reports."""

    facing: dict[str, set[type]] = field(default_factory=dict)  # class key -> the trl/transformers classes it
    # builds on (a mixin: those of the classes it is mixed into)
    classes: dict[str, _Class] = field(default_factory=dict)
    trl_files: set[str] = field(default_factory=set)
    unlisted: list[str] = field(default_factory=list)


def scan_seams(seams=SEAMS, extra_sources: dict[str, str] | None = None) -> SeamScan:
    """Scan every module of bapo_trl (plus ``extra_sources``, label -> source, as if they were modules of it) for
    private trl/transformers names and trl/transformers overrides that no seam in ``seams`` lists."""
    sources = list(_package_sources())
    for label, source in (extra_sources or {}).items():
        sources.append((label, f"bapo_trl.{Path(label).stem}", False, source))
    modules = [_module_scan(*s) for s in sources]
    result = SeamScan(classes={f"{c.module}.{c.name}": c for m in modules for c in m.classes})
    by_name: dict[str, list[_Class]] = {}
    for cls in result.classes.values():
        by_name.setdefault(cls.name, []).append(cls)

    # Which classes build on trl/transformers classes: directly, through a bapo_trl base, or as a mixin beside them.
    def parents(cls: _Class) -> tuple[list[type], list[_Class]]:
        external, ours = [], []
        for base in cls.bases:
            module, _, name = base.rpartition(".")
            if _is_external(base):
                external.append(_resolve(base))
            elif base.startswith("bapo_trl."):
                candidates = [c for c in by_name.get(name, []) if c is not cls]
                found = [c for c in candidates if c.module == module] or candidates  # or re-exported
                if not found:  # not a class statement of ours: perhaps a trl/transformers class re-exported
                    try:
                        obj = _resolve(base)
                    except (ImportError, AttributeError):
                        continue
                    if isinstance(obj, type) and _is_external(obj.__module__):
                        external.append(obj)
                ours += found
        return external, ours

    @functools.cache
    def lineage(key: str) -> tuple[frozenset[str], frozenset[type]]:
        external, ours = parents(result.classes[key])
        keys, classes = {key}, set(external)
        for base in ours:
            base_keys, base_classes = lineage(f"{base.module}.{base.name}")
            keys |= base_keys
            classes |= base_classes
        return frozenset(keys), frozenset(classes)

    for key in result.classes:
        keys, external = lineage(key)
        if external:
            for member in keys:
                result.facing.setdefault(member, set()).update(external)

    # The trl/transformers sources whose private names count.
    files = {_resolve(name).__file__ for name in TRL_MODULES}
    for module in modules:
        for dotted in module.external_imports:
            try:
                obj = _resolve(dotted)
            except (ImportError, AttributeError):  # a guarded import of what this trl/transformers lacks
                continue
            if inspect.ismodule(obj):
                files.add(obj.__file__)
            else:  # a name imported from a module: that module, and the one that defines the name
                files.add(_resolve(dotted.rpartition(".")[0]).__file__)
                files.add(_source_file(obj))
    for external in result.facing.values():
        for cls in external:
            files.update(_source_file(base) for base in cls.__mro__ if _is_external(base.__module__))
    result.trl_files = {f for f in files if f and _short(f)}
    defined: dict[str, list[str]] = {}
    for path in sorted(result.trl_files):
        for name in _defined_private_names(path):
            defined.setdefault(name, []).append(_short(path))

    targets, names = _listed(seams)
    reported = {}
    hint = "add a Seam to bapo_trl/trainer/trl_seams.py"
    for module in modules:
        for use in module.uses:
            if use.owner is not None and use.owner not in result.facing:
                continue  # a private name of a bapo_trl object of its own
            if use.name in defined and use.name not in names:
                reported.setdefault((use.where, use.name), f"{use.where}: {use.name} ({use.how}) is defined by "
                                    f"{', '.join(defined[use.name])}, but no seam lists it: {hint}")
    for key, external in result.facing.items():
        cls = result.classes[key]
        attributes = {}
        for base in external:
            attributes.update(_trl_attributes(base))
        for name, where in cls.body.items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if name in attributes:
                owner, on_class = attributes[name]
                # a method or class attribute must be a seam's target (checked to exist); an attribute TRL sets on
                # its instances can only be a mention (checked in the source that sets it)
                if name not in (targets if on_class else names):
                    reported.setdefault((where, name), f"{where}: {cls.name}.{name} overrides {owner}.{name}, but no "
                                        f"seam {'has it as target' if on_class else 'lists it'}: {hint}")
            elif _is_private(name) and name in defined and name not in names:
                reported.setdefault((where, name), f"{where}: {cls.name}.{name} (defined in the class) is also "
                                    f"defined by {', '.join(defined[name])}, but no seam lists it: {hint}")
    result.unlisted = sorted(reported.values())
    return result


def _runtime_checked_classes(scan: SeamScan) -> list[type]:
    """The classes bapo_trl builds on TRL that can be imported: the trainer and the vLLM classes, and every one the
    scan found (a class defined inside a function and not exposed is checked by the scan only)."""
    from bapo_trl.generation.http_client import HTTPVLLMClient
    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration
    from bapo_trl.trainer.bapo_trainer import BAPOTrainer

    found = {BAPOTrainer, BAPOVLLMGeneration, HTTPVLLMClient}
    for key in scan.facing:
        cls = scan.classes[key]
        if cls.module.startswith("bapo_trl._seam_scan"):
            continue
        obj = getattr(importlib.import_module(cls.module), cls.name, None)
        if isinstance(obj, type) and any(_is_external(k.__module__) for k in obj.__mro__):
            found.add(obj)
    return sorted(found, key=lambda k: f"{k.__module__}.{k.__qualname__}")


def _defined_at(cls: type, name: str) -> str:
    """``bapo_trl/x.py:12``: where ``cls`` defines ``name`` (its function's first line, else the class's)."""
    obj = vars(cls)[name]
    obj = getattr(obj, "fget", None) or getattr(obj, "__func__", None) or obj  # property, classmethod
    obj = inspect.unwrap(obj) if callable(obj) else obj
    target = obj if inspect.isfunction(obj) else cls
    path = Path(inspect.getsourcefile(target)).resolve()
    label = path.relative_to(PACKAGE_DIR.parent).as_posix() if path.is_relative_to(PACKAGE_DIR.parent) else path
    return f"{label}:{inspect.getsourcelines(target)[1]}"


def test_every_private_trl_name_and_every_override_is_a_seam():
    unlisted = scan_seams().unlisted
    assert not unlisted, "unlisted TRL/transformers seams:\n" + "\n".join(unlisted)


def test_the_scan_sees_the_trainer_its_mixins_and_the_vllm_classes():
    """Not a vacuous pass: every bapo_trl class in the MRO of a class built on TRL is seen as building on TRL."""
    scan = scan_seams()
    for cls in _runtime_checked_classes(scan):
        ours = {f"{k.__module__}.{k.__name__}" for k in cls.__mro__ if k.__module__.startswith("bapo_trl")}
        assert ours <= scan.facing.keys(), (cls, ours - scan.facing.keys())
    assert {_short(f) for f in scan.trl_files} >= {
        "trl/trainer/grpo_trainer.py", "trl/trainer/base_trainer.py", "transformers/trainer.py",
        "transformers/configuration_utils.py", "trl/generation/vllm_client.py", "trl/generation/vllm_generation.py"}


SNIPPET = "bapo_trl/_seam_scan_snippet.py"


@pytest.mark.parametrize("source, expected", [
    # a private method of transformers' Trainer, reached through any object
    ("def peek(trainer):\n    return trainer._inner_training_loop\n", ":2: _inner_training_loop (attribute)"),
    # a private attribute GRPOTrainer.__init__ sets, reached by name
    ("def peek(trainer):\n    return getattr(trainer, '_last_world_entropy')\n", ":2: _last_world_entropy (string)"),
    # a private function of TRL, imported
    ("from trl.trainer.utils import _find_free_port\n", ":1: _find_free_port (imported from trl.trainer.utils)"),
    # a private module constant
    ("import trl.trainer.utils as u\nCHUNK = u._CHUNKED_LOGPROB_CHUNK_SIZE\n", ":2: _CHUNKED_LOGPROB_CHUNK_SIZE"),
])
def test_the_scan_reports_an_unlisted_private_name(source, expected):
    unlisted = scan_seams(extra_sources={SNIPPET: source}).unlisted
    assert [line for line in unlisted if line.startswith(SNIPPET + expected)], unlisted
    assert all("add a Seam to bapo_trl/trainer/trl_seams.py" in line for line in unlisted)


@pytest.mark.parametrize("source, expected", [
    # a public method of GRPOTrainer, overridden by a mixin of a GRPOTrainer subclass
    ("from trl import GRPOTrainer\n\nclass Mixin:\n    def training_step(self, model, inputs):\n        pass\n\n"
     "class Trainer(Mixin, GRPOTrainer):\n    pass\n",
     ":4: Mixin.training_step overrides trl.trainer.grpo_trainer.GRPOTrainer.training_step"),
    # a public method of TRL's vLLM client
    ("from trl.generation.vllm_client import VLLMClient\n\nclass Client(VLLMClient):\n"
     "    def close_communicator(self):\n        pass\n",
     ":4: Client.close_communicator overrides trl.generation.vllm_client.VLLMClient.close_communicator"),
    # a callback hook, in a class defined inside a function
    ("def make():\n    from transformers import TrainerCallback\n\n    class Hook(TrainerCallback):\n"
     "        def on_epoch_end(self, args, state, control, **kwargs):\n            pass\n\n    return Hook\n",
     ":5: Hook.on_epoch_end overrides transformers.trainer_callback.TrainerCallback.on_epoch_end"),
])
def test_the_scan_reports_an_unlisted_override(source, expected):
    unlisted = scan_seams(extra_sources={SNIPPET: source}).unlisted
    assert [line for line in unlisted if line.startswith(SNIPPET + expected)], unlisted


def test_a_private_name_of_our_own_objects_is_not_a_seam():
    """``self._metrics`` of a class that builds on nothing of TRL's is that class's own attribute."""
    source = "class Own:\n    def __init__(self):\n        self._metrics = {}\n"
    assert scan_seams(extra_sources={SNIPPET: source}).unlisted == []


@pytest.mark.parametrize("removed, reported", [
    ("transformers.trainer:Trainer._load_optimizer_and_scheduler", "bapo_trl/trainer/checkpoints.py"),
    ("trl.generation.vllm_generation:VLLMGeneration._iter_named_params", "bapo_trl/generation/trl_push.py"),
    ("trl.trainer.grpo_trainer:GRPOTrainer._tag_names", "bapo_trl/trainer/bapo_trainer.py"),
    ("trl.generation.vllm_client:VLLMClient.check_server", "bapo_trl/generation/http_client.py"),
])
def test_a_seam_removed_from_the_list_is_reported(removed, reported):
    seams = tuple(s for s in SEAMS if s.target != removed)
    assert len(seams) == len(SEAMS) - 1
    name = removed.rpartition(".")[2].rpartition(":")[2]
    unlisted = scan_seams(seams).unlisted
    assert [line for line in unlisted if line.startswith(reported) and name in line], unlisted


def test_an_instance_attribute_removed_from_the_mentions_is_reported():
    seams = tuple(Seam(s.target, s.why, s.params, tuple(m for m in s.mentions if m != "self._tokenizer"))
                  for s in SEAMS)
    unlisted = scan_seams(seams).unlisted
    assert [line for line in unlisted if "_tokenizer (attribute)" in line], unlisted


def test_every_override_in_the_real_mro_is_a_seam():
    """At run time, through the real MRO: every attribute (public or private) that a bapo_trl class, or a bapo_trl
    mixin beside it, defines and a trl/transformers class in the same MRO defines too is a seam's target."""
    targets, _ = _listed(SEAMS)
    classes = _runtime_checked_classes(scan_seams())
    names = {k.__name__ for k in classes}
    assert {"BAPOTrainer", "BAPOVLLMGeneration", "HTTPVLLMClient"} <= names
    unlisted = []
    for cls in classes:
        theirs = [k for k in cls.__mro__ if _is_external(k.__module__)]
        for ours in (k for k in cls.__mro__ if k.__module__.startswith("bapo_trl")):
            for name in vars(ours):
                if name.startswith("__") and name.endswith("__"):
                    continue
                owner = next((k for k in theirs if name in vars(k)), None)
                if owner is not None and name not in targets:
                    unlisted.append(f"{_defined_at(ours, name)}: {ours.__qualname__}.{name} overrides "
                                    f"{owner.__module__}.{owner.__qualname__}.{name} (in {cls.__name__}'s MRO), "
                                    "but no seam has it as target: add a Seam to bapo_trl/trainer/trl_seams.py")
    assert not unlisted, "\n".join(sorted(set(unlisted)))


# -- every swap of a TRL name lives in bapo_trl/generation/trl_patches.py, and each swapped name is a seam ------------

PATCHES_FILE = "bapo_trl/generation/trl_patches.py"
#: Calls that swap ``obj.name`` when their first argument is a trl/transformers object: ``setattr``/``delattr`` and
#: trl_patches' own helpers.
SWAPPING_CALLS = {"setattr", "delattr", "patched", "patched_for_one_call"}


def trl_swaps(label: str, module: str, is_package: bool, source: str,
              instance_names: frozenset[str] | None = frozenset()) -> list[tuple[str, str]]:
    """``(file:line, what)`` for each swap of a TRL name in a module: a call in :data:`SWAPPING_CALLS` on, or an
    assignment to or ``del`` of an attribute of, a trl/transformers module or an object imported from one (``what``:
    ``trl.module:name``); and an assignment to (or swapping call on) an attribute named in ``instance_names`` of any
    object (``what``: ``.name``; None: every attribute, for the patches' own file)."""
    scan = _module_scan(label, module, is_package, source)

    def swap(node, owner_node, name: str | None) -> tuple[str, str] | None:
        """``name``: the attribute, None where the code computes it."""
        owner = scan._dotted(owner_node)
        if owner is not None and _is_external(owner):
            return f"{label}:{node.lineno}", f"{owner}:{name or '?'}"
        if name is not None and (instance_names is None or name in instance_names):
            return f"{label}:{node.lineno}", f".{name}"
        return None

    found = []
    for node in ast.walk(ast.parse(source, filename=label)):
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            if called in SWAPPING_CALLS:
                found.append(swap(node, node.args[0], name if isinstance(name, str) else None))
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for each in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                if isinstance(each, ast.Attribute):
                    found.append(swap(node, each.value, each.attr))
    return [f for f in found if f is not None]


def _patches() -> list[tuple[str, str]]:
    """The swaps in trl_patches.py (every attribute it assigns counts)."""
    source = next(s for s in _package_sources() if s[0] == PATCHES_FILE)
    return trl_swaps(*source, instance_names=None)


def _instance_names(patches) -> frozenset[str]:
    return frozenset(what[1:] for _, what in patches if what.startswith("."))


def test_every_swap_of_a_trl_name_lives_in_trl_patches():
    """No module but generation/trl_patches.py swaps a TRL module global, an attribute of a TRL class or function, or
    an attribute of a TRL object that trl_patches swaps (``.llm``, ``.rollout_func``): each swap is one small function
    there (the other modules call it)."""
    patches = _patches()
    # not vacuous: the scan sees every patch of the file
    assert {what for _, what in patches} >= {
        "trl.trainer.grpo_trainer:VLLMGeneration", "trl.generation.vllm_generation:VLLMClient",
        "trl.generation.vllm_generation:LLM", "trl.generation.vllm_client:is_vllm_available", ".llm", ".rollout_func"}
    instance = _instance_names(patches)
    elsewhere = sorted(f"{where}: {what}" for source in _package_sources() if source[0] != PATCHES_FILE
                       for where, what in trl_swaps(*source, instance_names=instance))
    assert not elsewhere, ("swaps of a TRL name outside bapo_trl/generation/trl_patches.py (make each a function "
                           "there):\n" + "\n".join(elsewhere))


def test_each_name_trl_patches_swaps_is_a_seam():
    """A swapped module global is a seam's target, with the TRL code whose call the swap serves (``looked_up_by``);
    a swapped attribute of a TRL object is in the mentions of a seam (checked in the TRL source that sets or reads
    it)."""
    by_target = {s.target: s for s in SEAMS}
    missing = []
    for where, what in _patches():
        if what.startswith("."):
            if not any(f"self{what}" in mention for s in SEAMS for mention in s.mentions):
                missing.append(f"{where}: {what} (no seam mentions self{what})")
        elif what not in by_target or not by_target[what].looked_up_by:
            missing.append(f"{where}: {what} (no seam with this target and looked_up_by)")
    assert not missing, "add a Seam to bapo_trl/trainer/trl_seams.py:\n" + "\n".join(missing)


@pytest.mark.parametrize("source, expected", [
    ("import trl.trainer.grpo_trainer as g\nsetattr(g, 'VLLMGeneration', object)\n",
     ":2: trl.trainer.grpo_trainer:VLLMGeneration"),
    ("import trl.generation.vllm_client as c\nfrom bapo_trl.generation.trl_patches import patched\n\n"
     "with patched(c, 'is_vllm_available', bool):\n    pass\n", ":4: trl.generation.vllm_client:is_vllm_available"),
    ("import trl\ntrl.generation.vllm_generation.LLM = object\n", ":2: trl.generation.vllm_generation:LLM"),
    ("from trl import GRPOTrainer\nGRPOTrainer._generate = None\n", ":2: trl.GRPOTrainer:_generate"),
    ("def serve(trainer, func):\n    saved, trainer.rollout_func = trainer.rollout_func, func\n", ":2: .rollout_func"),
    ("def wrap(backend, engine):\n    backend.llm = engine\n", ":2: .llm"),
])
def test_a_swap_outside_trl_patches_is_reported(source, expected):
    found = trl_swaps(SNIPPET, "bapo_trl._seam_scan_snippet", False, source, _instance_names(_patches()))
    assert [f"{where}: {what}" for where, what in found] == [SNIPPET + expected]


def test_the_import_check_covers_each_swapped_name(monkeypatch):
    """Each swapped name is checked where it lives and where TRL looks it up; TRL's ``LLM`` (defined only with vLLM
    installed) wherever vLLM is."""
    import trl.generation.vllm_generation as trl_vllm_generation
    import trl.import_utils as trl_import_utils
    import trl.trainer.grpo_trainer as trl_grpo_trainer

    monkeypatch.delattr(trl_grpo_trainer, "VLLMGeneration")
    assert [p for p in seam_problems() if p.startswith("trl.trainer.grpo_trainer:VLLMGeneration is missing")]
    monkeypatch.undo()

    def _init_vllm(self):  # a TRL that builds its client and engine some other way: the swaps would do nothing
        self.vllm_client = self.llm = None

    monkeypatch.setattr(trl_vllm_generation.VLLMGeneration, "_init_vllm", _init_vllm)
    problems = seam_problems()
    assert [p for p in problems if "_init_vllm no longer calls VLLMClient(...)" in p]
    monkeypatch.undo()

    monkeypatch.setattr(trl_import_utils, "is_vllm_available", lambda *a, **k: True)  # as where vLLM is installed
    monkeypatch.delattr(trl_vllm_generation, "LLM", raising=False)
    assert [p for p in seam_problems() if p.startswith("trl.generation.vllm_generation:LLM is missing")]
    monkeypatch.setattr(trl_vllm_generation, "LLM", object, raising=False)
    assert seam_problems() == []
    monkeypatch.setattr(trl_import_utils, "is_vllm_available", lambda *a, **k: False)  # no vLLM: no LLM to swap
    monkeypatch.delattr(trl_vllm_generation, "LLM")
    assert seam_problems() == []


def test_a_swapped_module_global_serves_one_call_of_the_swapping_thread():
    """trl_patches' swap of a module global: the first call made inside the block, by the thread that swapped it, gets
    the replacement; a later call, or another thread's, gets TRL's own; TRL's own is back after the block."""
    import threading
    import types

    from bapo_trl.generation.trl_patches import patched_for_one_call

    module = types.SimpleNamespace(build=lambda: "trl")
    other = []
    with patched_for_one_call(module, "build", lambda: "ours"):
        thread = threading.Thread(target=lambda: other.append(module.build()))
        thread.start()
        thread.join()
        calls = [module.build(), module.build()]
    assert other == ["trl"] and calls == ["ours", "trl"] and module.build() == "trl"
    with pytest.raises(RuntimeError), patched_for_one_call(module, "build", lambda: "ours"):
        raise RuntimeError  # a block that never made the call: TRL's own is back all the same
    assert module.build() == "trl"
