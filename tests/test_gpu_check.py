"""The parts of the GPU check (benchmarks/gpu_check.py) that a CPU can prove, and the wheels for the GPU machine.

* the host-sync guard refuses what would make the host wait for a GPU (so its "no host sync" verdict on CPU means
  something), lets device-only work through, and the bound search passes it in every variant and mode; a search
  that read one value on the host would fail the check;
* ``scripts/gpu_wheels.sh --list`` names exactly what the GPU machine lacks, pinned to the versions tested here;
  a real download (slow tier: PyPI) gives one wheel each for CPython 3.12 / manylinux x86_64, under 64 MiB with the
  working tree.
"""

import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

from support.launching import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

from bapo_trl import search_clip_bounds  # noqa: E402
from bapo_trl.core import clipping  # noqa: E402
from bapo_trl.experimental.length_fair import search as length_fair  # noqa: E402
from bapo_trl.experimental.length_fair.search import length_fair_search  # noqa: E402

x = torch.arange(1.0, 4.0)

SYNCS = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x.tolist(),
    "bool": lambda: bool(x.sum() > 0),
    "float": lambda: float(x.sum()),
    "int": lambda: int(x.sum()),
    "numpy": lambda: x.numpy(),
    "nonzero": lambda: x.nonzero(),
    "boolean mask read": lambda: x[x > 1],
    "boolean mask write": lambda: x.clone().__setitem__(x > 1, torch.zeros(2)),
    "masked_select": lambda: torch.masked_select(x, x > 1),
    "unique": lambda: torch.unique(x),
    "host data to the device": lambda: torch.tensor([1.0, 2.0]),
    "index by a 0-dim tensor": lambda: x[torch.argmax(x)],  # calls .item() inside PyTorch's indexing
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_guard_refuses_what_would_sync_a_gpu(name):
    with pytest.raises(gpu_check.HostSyncError):
        with gpu_check.host_sync_guard("cpu"):
            SYNCS[name]()


def test_guard_lets_device_only_work_through():
    with gpu_check.host_sync_guard("cpu"):
        y = torch.where(x > 1, x * 2.0, 0.0).cumsum(0).flip(0)
        k = torch.argmax(y)
        picked = y.index_select(0, k.view(1))
        sums = torch.zeros(4).scatter_add_(0, torch.zeros(3, dtype=torch.int64), x)
        z = x.to(torch.float64).masked_fill(x > 2, 0.0)
    assert picked.item() == y.max().item() and sums[0].item() == 6.0 and z.tolist() == [1.0, 2.0, 0.0]


def test_bound_search_makes_no_host_sync_in_any_variant_or_mode():
    report = gpu_check.check_no_host_sync("cpu")
    assert report["searches"] == 6 and report["host_syncs"] == 0, report["errors"]
    ratio, advantages, mask = gpu_check.bound_search.make_batch(64, 256, seed=1)
    for key, guarded in report["results"].items():  # the guard changes nothing in what the search chooses
        variant, mode = key.split("/")
        if variant == "length-fair":
            plain = length_fair_search(torch.where(mask != 0, ratio.log(), 0.0), advantages, mask,
                                       positive_contribution_mode=mode).as_floats()
        else:
            plain = search_clip_bounds(ratio, advantages, mask, bapo_variant=variant,
                                       positive_contribution_mode=mode).as_floats()
        assert guarded == plain
    assert {key.split("/")[0] for key in report["results"]} == {"paper", "verl", "length-fair"}


def test_no_host_sync_check_fails_when_the_search_reads_a_value(monkeypatch):
    original = clipping.choose_bounds

    def reads_a_value(packed, *args, **kwargs):
        if packed.sum().item() < 0:  # one host read, as a debugging line or a Python-side branch would add
            pass
        return original(packed, *args, **kwargs)

    monkeypatch.setattr(clipping, "choose_bounds", reads_a_value)
    monkeypatch.setattr(length_fair, "choose_bounds", reads_a_value)
    report = gpu_check.check_no_host_sync("cpu")
    assert report["host_syncs"] == 6
    assert all("Tensor.item()" in error for error in report["errors"])


def test_no_host_sync_check_fails_when_the_length_fair_search_uploads_its_grid_every_call(monkeypatch):
    """The band widths' grids are made on the device once per path; a fresh ``torch.tensor`` per call copies host
    data to the device in every update (what the first version did)."""
    def fresh_grids(path, device):
        return (torch.tensor(path.high_grid, dtype=torch.float64, device=device),
                torch.tensor(path.low_grid, dtype=torch.float64, device=device))

    monkeypatch.setattr(length_fair, "_device_grids", fresh_grids)
    report = gpu_check.check_no_host_sync("cpu")
    assert report["host_syncs"] == 2
    assert all(error.startswith("length-fair/") and "lift_fresh" in error for error in report["errors"])


# -- wheels for the GPU machine -------------------------------------------------------------------------------------

#: What the GPU machine lacks, and what it has at other versions than CI tests (transformers, peft, fsspec).
NEEDED = {"trl", "datasets", "dill", "multiprocess", "hjson", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing-extensions", "transformers", "peft", "fsspec", "deepspeed", "bapo_trl"}
#: What it has and the check uses as they are there.
THERE = {"torch", "accelerate", "pandas", "pyarrow", "numpy", "xxhash", "msgpack", "ninja", "py-cpuinfo", "einops",
         "psutil", "matplotlib", "huggingface-hub", "tokenizers", "safetensors"}


def wheels(*args, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_wheel_list_is_exactly_what_the_gpu_machine_lacks_at_the_tested_versions():
    listed = dict(line.split(" ", 1) for line in wheels("--list").splitlines())
    pins = dict(spec.split("==") for spec in listed)
    assert set(pins) == NEEDED and not set(pins) & THERE
    import bapo_trl

    for name, pinned in pins.items():
        assert pinned == (bapo_trl.__version__ if name == "bapo_trl" else version(name)), name
    assert listed["deepspeed==" + pins["deepspeed"]] == "built-from-sdist"
    assert listed["bapo_trl==" + pins["bapo_trl"]] == "built-from-checkout"


@pytest.mark.slow
def test_wheel_download_gives_one_cp312_wheel_each_under_the_size_limit(tmp_path):
    """Real: PyPI downloads for CPython 3.12 / manylinux x86_64, DeepSpeed and bapo_trl built here (~15 s)."""
    out = wheels("--dest", str(tmp_path / "wheels"))
    files = sorted(p.name for p in (tmp_path / "wheels").glob("*.whl"))
    names = {re.sub(r"[-_.]+", "-", f.split("-")[0]).lower() for f in files}
    assert names == {n.replace("_", "-").lower() for n in NEEDED} and len(files) == len(NEEDED), files
    assert all(f.endswith("-none-any.whl") or "-cp312-cp312-manylinux" in f for f in files), files
    total = sum((tmp_path / "wheels" / f).stat().st_size for f in files)
    assert total < 40 * 2**20  # about 21 MiB today; the limit for everything that travels is 64 MiB
    match = re.search(r"with the tracked working tree \(([\d.]+) MiB\): ([\d.]+) of 64 MiB", out)
    assert match and float(match[2]) < 64, out


@pytest.mark.parametrize("value, read", [
    ("9.0a", "9.0"),  # the GPU machine's image: DeepSpeed failed with "invalid literal for int() ... '0a'"
    ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
    ("8.0 10.0f", "8.0;10.0"),
    ("8.0;9.0+PTX", None),  # DeepSpeed reads these as they are
    ("Ampere;9.0a", "Ampere;9.0"),  # a name is left as it is (DeepSpeed would refuse it either way)
    ("", None),
    (None, None),
])
def test_arch_list_is_made_readable_for_deepspeeds_op_builder(value, read):
    assert gpu_check.deepspeed_arch_list(value) == read


def test_deepspeeds_op_builder_reads_the_arch_list_it_is_given(monkeypatch):
    """DeepSpeed's own parsing (no nvcc needed): it fails on the image's value and reads the mended one."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, also on a CPU machine

    builder = FusedAdamBuilder()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", gpu_check.deepspeed_arch_list("9.0a"))
    assert builder.compute_capability_args() == ["-gencode=arch=compute_90,code=sm_90"]
