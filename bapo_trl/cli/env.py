"""``bapo env``: the versions and the device a bug report needs, one ``- name: value`` line each.

    bapo env

(or ``python -m bapo_trl.cli.env``, the same command.) Python, the platform, bapo_trl (with its git commit when it
runs from a clone), torch, TRL, transformers, accelerate, datasets, PEFT, DeepSpeed and vLLM, then the device:
the CUDA GPUs torch sees, or the CPU. A package that is not installed reads ``not installed``; nothing here fails
because one is missing. vLLM on a CPU-only machine lives in its own venv (``scripts/install_vllm_cpu.sh``, the one
``bapo serve`` uses): its version is read from that venv's files, without starting it.

Only the standard library is imported until the device is probed (that imports torch, when it is installed).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import platform
import subprocess
import sys

#: (label, distribution names to try, first found wins)
PACKAGES = [
    ("torch", ("torch",)),
    ("TRL", ("trl",)),
    ("transformers", ("transformers",)),
    ("accelerate", ("accelerate",)),
    ("datasets", ("datasets",)),
    ("PEFT", ("peft",)),
    ("DeepSpeed", ("deepspeed",)),
    ("vLLM", ("vllm", "vllm-cpu")),
]
NOT_INSTALLED = "not installed"


def installed_version(*names: str, path: list[str] | None = None) -> str | None:
    """The version of the first of ``names`` installed (in ``path``, a list of site-packages folders, if given), or
    None. ``vllm-cpu`` is reported with its name, as it is a different build from ``vllm``."""
    for name in names:
        try:
            if path is None:
                version = importlib.metadata.version(name)
            else:
                dist = next(iter(importlib.metadata.distributions(name=name, path=path)), None)
                version = dist.version if dist is not None else None
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version:
            return version if name == names[0] else f"{version} ({name})"
    return None


def git_commit(directory: str) -> str | None:
    """The short commit of the git checkout holding ``directory`` (an editable install from a clone), or None."""
    try:
        proc = subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def bapo_trl_version() -> str:
    from .. import __version__

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = git_commit(package_dir) if os.path.exists(os.path.join(package_dir, "..", ".git")) else None
    return f"{__version__} (git {commit})" if commit else __version__


def vllm_cpu_venv() -> str:
    """The vllm-cpu venv ``bapo serve`` would use, and the vLLM version installed there, or that there is none."""
    from .serve import default_venv  # standard library only

    venv = default_venv()
    site = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
    version = installed_version("vllm-cpu", "vllm", path=site) if site else None
    return f"{version} at {venv}" if version else f"none at {venv}"


def device() -> str:
    """``CUDA N x <GPU name>, ...`` (with the CUDA version torch was built for), else ``CPU (...)``."""
    try:
        import torch
    except Exception as err:  # not installed, or broken: say which, do not stop the report
        return f"unknown (torch cannot be imported: {type(err).__name__})"
    cores = os.cpu_count()
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        counted = {name: names.count(name) for name in names}
        gpus = ", ".join(f"{n} x {name}" for name, n in counted.items())
        return f"CUDA {torch.version.cuda}: {gpus}"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "MPS (Apple GPU)"
    built = f"torch built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only torch build"
    return f"CPU, {cores} cores (no CUDA device; {built})"


def report() -> dict[str, str]:
    """Label -> value, in the order printed."""
    info = {"Python": f"{platform.python_version()} ({sys.executable})", "Platform": platform.platform(),
            "bapo_trl": bapo_trl_version()}
    for label, names in PACKAGES:
        info[label] = installed_version(*names) or NOT_INSTALLED
    if info["vLLM"] == NOT_INSTALLED:
        info["vLLM CPU venv (bapo serve)"] = vllm_cpu_venv()
    info["Device"] = device()
    return info


def make_parser(prog: str = "python -m bapo_trl.cli.env") -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description="Print the versions of python, torch, TRL, transformers, accelerate, datasets, PEFT, "
        "DeepSpeed, vLLM and bapo_trl, and the device (CUDA GPUs or CPU): paste them into a bug report.")


def main(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.env") -> int:
    make_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    lines = [f"- {label}: {value}" for label, value in report().items()]
    print("Paste these lines into a bug report:\n\n" + "\n".join(lines))
    return 0


def command(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.env") -> int:
    """``bapo env``'s contract (:mod:`.main`): ``main`` parses ``argv`` and returns the exit code."""
    return main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(command())
