"""What a release ships and how the project is set up: the LICENSE in the wheel, the version the changelog names, a
``make`` that never replaces an installed torch, and a wheel that works installed (not editable) in a fresh
virtualenv."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import bapo_trl
from support.launching import REPO, script_module

MAKE_TARGETS = ("install", "install-test", "train", "test", "test-fast")


def test_the_license_is_apache_2_and_the_metadata_ships_it():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    metadata = configparser.ConfigParser()
    metadata.read(REPO / "setup.cfg")
    assert metadata["metadata"]["license"] == "Apache-2.0"
    assert "LICENSE" in metadata["metadata"]["license_files"].split()


def test_the_version_and_the_changelog_agree():
    """The top entry of CHANGELOG.md is the version the package reports (``## 0.1.0`` or ``## 0.1.0 (unreleased)``);
    setup.cfg reads the version from the package, so the wheel's metadata says the same."""
    metadata = configparser.ConfigParser()
    metadata.read(REPO / "setup.cfg")
    assert metadata["metadata"]["version"].strip() == "attr: bapo_trl.__version__"
    headings = re.findall(r"^## (.+)$", (REPO / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings, "CHANGELOG.md has no '## <version>' entry"
    top = re.fullmatch(r"(\S+)(?: \(unreleased\)| - \d{4}-\d{2}-\d{2})?", headings[0].strip())
    assert top and top.group(1) == bapo_trl.__version__, (headings[0], bapo_trl.__version__)


def _stub(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("torch_installed", [True, False])
@pytest.mark.parametrize("target", MAKE_TARGETS)
def test_make_installs_torch_only_where_none_is_importable(target, torch_installed, tmp_path):
    """Every make target with a stand-in Python (``import torch`` succeeds or fails) and a stand-in pip that records
    its arguments: torch is installed only where ``import torch`` failed, and then as the pinned CPU build."""
    log = tmp_path / "pip.log"
    python = _stub(tmp_path / "python", f'case "$*" in *"import torch"*) exit {0 if torch_installed else 1};; esac\n'
                                        f'echo "python $*" >> {log}\n')
    pip = _stub(tmp_path / "pip", f'echo "pip $*" >> {log}\n')
    proc = subprocess.run(["make", "-s", "-C", str(REPO), target, f"PYTHON={python}", f"PIP={pip}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    torch_installs = [c for c in calls if c.startswith("pip install") and "torch" in c]
    assert torch_installs == ([] if torch_installed else ["pip install -q torch==2.13.0"]), calls
    assert any(c.startswith("pip install -q -e .") for c in calls), calls  # the package itself is still installed


def test_ci_runs_make_test():
    """CI (.ci/run) runs `make test` in a fresh virtualenv, so the Makefile's install logic is the only copy."""
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == "make test"
    assert not any("pip install" in line for line in commands)


def _tracked_tree(destination: Path) -> Path:
    """The files git tracks (as they are in the working tree): what a clean clone builds from."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _quick_start() -> str:
    """The README's first Python example that trains."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return next(block for block in blocks if "BAPOTrainer(" in block)


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core (BAPO_TEST_CPU_LOG), no shared server, no timing bound
def test_the_wheel_installs_and_runs_in_a_fresh_virtualenv(tmp_path):
    """``python -m build`` from the tracked files (the sdist, then the wheel built FROM the sdist, so the sdist is
    complete); ``pip install --no-deps`` of that wheel into a new virtualenv; then, from a directory outside the
    repository, the README's quick start and every ``bapo`` subcommand's ``--help`` run against the installed package
    (not the repository's source).

    The new virtualenv reaches the dependencies (torch, TRL, ...) through a path file listing this interpreter's
    site-packages: a path listed there is put on ``sys.path`` but its own ``.pth`` files are not run, so this
    environment's editable install of bapo_trl (a ``.pth`` finder) is not seen."""
    source = _tracked_tree(tmp_path / "source")
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    (wheel,), (sdist,) = dist.glob("bapo_trl-*.whl"), dist.glob("bapo_trl-*.tar.gz")
    assert sdist.name == f"bapo_trl-{bapo_trl.__version__}.tar.gz"
    with tarfile.open(sdist) as archive:
        shipped = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "setup.cfg", "bapo_trl/__init__.py",
            "bapo_trl/cli/train_options.json"} <= shipped, sorted(shipped)[:40]
    assert wheel.name.startswith(f"bapo_trl-{bapo_trl.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert f"bapo_trl-{bapo_trl.__version__}.dist-info/licenses/LICENSE" in names
        metadata = archive.read(f"bapo_trl-{bapo_trl.__version__}.dist-info/METADATA").decode()
    assert "License: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert not [n for n in names if n.split("/")[0] not in ("bapo_trl", f"bapo_trl-{bapo_trl.__version__}.dist-info")]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               BAPO_TRL_CACHE=str(tmp_path / "cache"), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")

    def run(*command: str, timeout: float = 300) -> str:
        proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (command, (proc.stdout + proc.stderr)[-4000:])
        return proc.stdout

    where = run(str(python), "-c", "import bapo_trl, importlib.metadata as m; "
                "print(bapo_trl.__file__); print(m.version('bapo_trl')); print(m.distribution('bapo_trl')._path)")
    package_file, version, dist_info = where.split()
    assert Path(package_file).is_relative_to(Path(purelib)), package_file  # the wheel's copy, not /work/...
    assert not Path(package_file).is_relative_to(REPO)
    assert version == bapo_trl.__version__ and Path(dist_info).is_relative_to(Path(purelib))

    assert run(str(python), "-c", _quick_start(), timeout=600).strip()  # trained, and printed its bounds
    bapo = str(venv / "bin" / "bapo")  # the console script the wheel installed
    usage = run(bapo, "--help")
    subcommands = re.findall(r"^  (\w+)  ", usage, flags=re.M)
    assert {"train", "serve", "evaluate", "plot", "models"} <= set(subcommands), usage
    for name in subcommands:
        assert "usage: bapo " + name in run(bapo, name, "--help"), name


@pytest.mark.parametrize("platform, driver, reachable, expected", [
    ("linux", False, True, ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]),
    ("linux", False, False, []),  # an index that cannot be reached: pip's own configuration, no failure
    ("linux", True, True, []),  # a driver: PyPI's CUDA build
    ("darwin", False, True, []),  # PyPI's macOS wheel is the CPU build
    ("win32", False, True, []),
], ids=["cpu-linux", "cpu-linux-offline", "nvidia-driver", "macos", "windows"])
def test_make_asks_for_pytorchs_cpu_build_only_on_linux_without_a_driver(platform, driver, reachable, expected):
    """Issue 77 (1): against the public index, ``pip install torch==2.13.0`` on Linux is the CUDA build (~6 GB);
    without an NVIDIA driver make adds PyTorch's CPU index (its ``+cpu`` local version wins the pin), unless it cannot
    be reached. The decision logic, with the machine's facts stood in for (nothing is downloaded); the index is asked
    only where it would be used."""
    module = script_module("torch_index")
    asked = []
    arguments, why = module.pip_arguments(platform, driver, lambda: asked.append(1) or reachable)
    assert arguments == expected and why
    assert bool(asked) == (platform == "linux" and not driver)


def test_the_driver_and_the_index_are_detected_without_a_download(tmp_path):
    module = script_module("torch_index")
    present = tmp_path / "version"
    present.write_text("NVRM version: 550")
    assert module.has_nvidia_driver(files=(str(present),), which=lambda _: None)
    assert module.has_nvidia_driver(files=(), which=lambda name: "/usr/bin/nvidia-smi")
    assert not module.has_nvidia_driver(files=(str(tmp_path / "none"),), which=lambda _: None)

    def refused(url, timeout):
        raise OSError("unreachable")

    class Answer:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    assert not module.reachable(opener=refused)
    assert module.reachable(opener=lambda url, timeout: Answer())
