"""``bapo models``: prepare a registry model offline and print its directory, or list the registry (the registry:
:mod:`bapo_trl.recipes.models`).

    bapo models smollm2          # prints the local checkpoint directory (converted once, cached)
    bapo models --list

(``python -m bapo_trl.cli.models ...`` is the same command.)
"""

from __future__ import annotations

import os
import sys

from ..recipes import models
from ..recipes.cache import default_cache_dir


def main(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.models") -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=models.__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("name", nargs="?", help=f"registry name: {', '.join(models.NAMES)}")
    parser.add_argument("--cache_dir", default=None,
                        help="default $BAPO_TRL_CACHE or ~/.cache/bapo_trl, where the other commands look for a "
                        "registry name")
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    parser.add_argument("--list", action="store_true", help="list the registry and exit")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for spec in models.MODELS.values():
            path = models.model_dir(spec.name, args.cache_dir)
            state = "prepared" if models.is_prepared(path) else "not prepared"
            print(f"{spec.name} (aliases: {', '.join(spec.aliases)}; {spec.package}=={spec.package_version}, "
                  f"{spec.license}): {path} [{state}]")
        return 0
    try:
        path = models.prepare_model(args.name, cache_dir=args.cache_dir, force=args.force)
    except models.ModelSetupError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(path)
    default = default_cache_dir()
    if args.cache_dir and os.path.abspath(args.cache_dir) != os.path.abspath(default):
        print(f"note: bapo train, serve and evaluate look for {args.name!r} in {default}, not in --cache_dir: give "
              f"them this directory as the model, or set BAPO_TRL_CACHE={args.cache_dir}.", file=sys.stderr)
    return 0


def command(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.models") -> int:
    """``bapo models``'s contract (:mod:`.main`): ``main`` parses ``argv`` and returns the exit code."""
    return main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(command())
