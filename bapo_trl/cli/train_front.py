"""``bapo train``'s front door: the help and the misspelled flags, answered without importing torch or TRL.

Why: ``bapo train``'s options are the fields of ``BAPOConfig``, TRL's ``GRPOConfig`` and transformers'
``TrainingArguments``, and reading them imports torch and TRL (4 s on an idle 2-core machine, up to 2 minutes on a
busy one) before ``--help`` or a typo's error could be printed. So the help texts and the list of known flags are
kept as a snapshot (:func:`snapshot`), valid for the exact versions of Python, TRL, transformers and bapo_trl it was
taken with and the declarations of the options (:func:`options_digest`): shipped in the package
(``train_options.json``; ``python -m bapo_trl.cli.train_front --write`` refreshes it, and a test fails until it
matches the parser) and written to the cache (``$BAPO_TRL_CACHE/cli``) by the first run under anything else. With no
snapshot of the running versions, everything goes to :mod:`.train`, as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from .flag_hints import unknown_flags

#: The program name's stand-in in the stored texts.
PROG = "@PROG@"
SHIPPED = Path(__file__).with_name("train_options.json")
HELP, HELP_ALL = ("-h", "--help"), ("--help-all", "--help_all")


#: The package's files that declare ``bapo train``'s options, their help and groups: a snapshot is valid for their
#: declarations (an edited field in a development checkout must not be answered from an older snapshot).
OPTION_SOURCES = ("trainer/bapo_config.py", "rollout/settings.py", "trainer/option_groups.py", "cli/train.py")


def declarations(source: str) -> list[str]:
    """What in one option source can change an option: the fields of its classes (name, type, default, help), its
    module-level constants (the groups, the embedded settings) and every ``add_argument`` call, as source text.
    Docstrings, comments and the bodies of functions are left out, so editing them keeps the snapshot (the test that
    holds the snapshot to the parser still catches a change of how the help is laid out)."""
    import ast

    tree = ast.parse(source)
    found = [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found += [ast.unparse(item) for item in node.body if isinstance(item, (ast.Assign, ast.AnnAssign))]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.append(ast.unparse(node))
    return found


def options_digest(package: Path) -> str:
    """The digest of :data:`OPTION_SOURCES`' :func:`declarations` under ``package`` (the folder of ``bapo_trl``)."""
    texts = ["\n".join(declarations((package / name).read_text())) for name in OPTION_SOURCES]
    return hashlib.sha256("\n\f".join(texts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """What the option texts depend on: Python (argparse's layout), TRL, transformers, bapo_trl and the digest of
    the options' declarations (:func:`options_digest`)."""
    from .. import __version__

    digest = options_digest(Path(__file__).resolve().parents[1])
    return {"python": "%d.%d" % sys.version_info[:2], "trl": metadata.version("trl"),
            "transformers": metadata.version("transformers"), "bapo_trl": __version__, "options_source": digest}


def cached_path(found: dict[str, str]) -> Path:
    from ..recipes.cache import default_cache_dir

    key = hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]
    return Path(default_cache_dir()) / "cli" / f"train-options-{key}.json"


def load() -> dict | None:
    """The snapshot of the running versions (the cache's, else the shipped one), or None."""
    found = versions()
    for path in (cached_path(found), SHIPPED):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("versions") == found:
            return data
    return None


def snapshot(make_parser) -> dict:
    """The help texts and the known flags of the parser ``make_parser(prog=...)`` builds."""
    parser = make_parser(prog=PROG)
    return {"versions": versions(), "help": parser.format_help(), "help_all": parser.format_help(full=True),
            "options": sorted({o for action in parser._actions for o in action.option_strings})}


def remember(make_parser) -> None:
    """Write the running versions' snapshot to the cache, once (:func:`command` calls it before a run of
    :mod:`.train`); never fails a run."""
    path = cached_path(versions())
    if path.exists() or load() is not None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(snapshot(make_parser)))
        os.replace(tmp, path)
    except OSError:
        pass


def answer(argv: list[str], prog: str, data: dict | None = None) -> int | None:
    """The exit code when the snapshot (``data``, or :func:`load`'s) answers ``argv`` (the help, or an unknown flag
    refused), else None."""
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        return None  # a recipe's values are the help's defaults, and its keys are checked by TRL's parser
    data = data or load()
    if data is None:
        return None
    if any(a in HELP_ALL for a in argv) or any(a in HELP for a in argv):
        text = data["help_all" if any(a in HELP_ALL for a in argv) else "help"]
        sys.stdout.write(text.replace(PROG, prog))
        return 0
    problem = unknown_flags(set(data["options"]), argv)
    if problem:
        sys.stderr.write(f"{prog}: error: {problem}\n")
        return 2
    return None


def command(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``bapo train``: the snapshot's answer where it has one, else :func:`bapo_trl.cli.train.command`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or "bapo train"
    data = load()
    code = answer(argv, prog, data)
    if code is not None:
        return code
    from .train import command as train
    from .train import make_parser

    if data is None:
        remember(make_parser)  # the help and flags of these versions, for the next `bapo train --help` without torch
    return train(argv, prog=prog)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        from .train import make_parser

        SHIPPED.write_text(json.dumps(snapshot(make_parser), indent=0) + "\n")
        print(f"wrote {SHIPPED}")
    else:
        sys.exit(command())
