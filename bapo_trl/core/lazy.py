"""The package's one way of loading a name on first use. In the lowest layer, with no import of its own beyond the
standard library, so every package's ``__init__`` can use it.

A package's ``__init__`` lists its names and where each lives; :func:`lazy_names` gives it the module-level
``__getattr__`` and ``__dir__`` that import the place on first use, so importing a package loads nothing it names
(the math stays importable without TRL, and ``bapo --help`` does not load torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def _resolve(package: str, where: str, name: str):
    module, _, attribute = where.partition(":")
    module = module if "." in module else f"{package}.{module}"
    return module, attribute or name


def lazy_names(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to ``"module"`` or
    ``"module:attribute"`` (a module without a dot is the package's own submodule)."""

    def __getattr__(name: str):
        if name in exports:
            module, attribute = _resolve(package, exports[name], name)
            return getattr(importlib.import_module(module), attribute)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
