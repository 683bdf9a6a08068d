"""The package's one way of loading a name on first use (modules moved whole are answered by
:mod:`bapo_trl._compat`'s finder instead). In the lowest layer, with no import of its own beyond the standard
library, so every package's ``__init__`` can use it.

A package's ``__init__`` lists its names and where each lives; :func:`lazy_names` gives it the module-level
``__getattr__`` and ``__dir__`` that import the place on first use, so importing a package loads nothing it names
(the math stays importable without TRL, and ``bapo --help`` does not load torch). A deprecated name warns once per
use, naming where to import it from.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

#: the release that drops the deprecated names
REMOVED_IN = "0.2"


def _resolve(package: str, where: str, name: str):
    module, _, attribute = where.partition(":")
    module = module if "." in module else f"{package}.{module}"
    return module, attribute or name


def lazy_names(package: str, exports: dict[str, str], deprecated: dict[str, str] | None = None
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to ``"module"`` or
    ``"module:attribute"`` (a module without a dot is the package's own submodule); ``deprecated`` does the same for
    names kept until :data:`REMOVED_IN`, each use warning with where to import it from."""
    deprecated = deprecated or {}

    def __getattr__(name: str):
        if name in deprecated:
            module, attribute = _resolve(package, deprecated[name], name)
            warnings.warn(f"{package}.{name} moved to {module}.{attribute}: import it from {module}; this name goes "
                          f"away in bapo_trl {REMOVED_IN}.", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(module), attribute)
        if name in exports:
            module, attribute = _resolve(package, exports[name], name)
            return getattr(importlib.import_module(module), attribute)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
