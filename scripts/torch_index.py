"""Where ``make install`` asks pip for torch, beyond pip's own configuration (its first step, only where no torch is
importable): prints the pip arguments, nothing for pip's configured index alone, and why on stderr.

Why: on Linux, PyPI's default torch wheel is the CUDA build (with triton and 15 ``nvidia-*`` wheels, ~6 GB). On a
machine without an NVIDIA driver that is gigabytes of nothing: there PyTorch's CPU index is added as an EXTRA index,
so its local version ``2.13.0+cpu`` wins the pin ``torch==2.13.0`` (a local version sorts above the public one).
Where that index cannot be reached (an offline mirror, a machine that reaches only PyPI), nothing is added and pip
installs from what it is configured with (a local ``+cpu`` wheel where its find-links hold one) instead of failing.
A machine with a driver, or another OS (PyPI's macOS and Windows wheels are CPU builds), gets pip's default."""

from __future__ import annotations

import os
import shutil
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Files the NVIDIA kernel driver provides where it is loaded.
DRIVER_FILES = ("/proc/driver/nvidia/version",)


def has_nvidia_driver(files=DRIVER_FILES, which=shutil.which) -> bool:
    """An NVIDIA driver is loaded (its /proc file) or its tool is installed (``nvidia-smi``)."""
    return any(os.path.exists(path) for path in files) or which("nvidia-smi") is not None


def reachable(url: str = CPU_INDEX, timeout: float = 5.0, opener=urllib.request.urlopen) -> bool:
    """The index answers within ``timeout`` seconds (any failure, a refusal or a time-out, is "no")."""
    try:
        with opener(f"{url}/torch/", timeout=timeout):
            return True
    except Exception:  # noqa: BLE001 - unreachable for whatever reason: use pip's own index
        return False


def pip_arguments(platform: str, driver: bool, index_reachable) -> tuple[list[str], str]:
    """``(arguments, why)``; ``index_reachable`` is asked only where the CPU index would be used."""
    if not platform.startswith("linux"):
        return [], f"{platform}: PyPI's torch wheel is a CPU build"
    if driver:
        return [], "an NVIDIA driver is present: PyPI's torch wheel (CUDA)"
    if not index_reachable():
        return [], f"no NVIDIA driver, but {CPU_INDEX} cannot be reached: pip's configured index"
    return ["--extra-index-url", CPU_INDEX], f"no NVIDIA driver: the CPU build from {CPU_INDEX}"


def main() -> int:
    arguments, why = pip_arguments(sys.platform, has_nvidia_driver(), reachable)
    print(f"torch: {why}", file=sys.stderr)
    print(" ".join(arguments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
