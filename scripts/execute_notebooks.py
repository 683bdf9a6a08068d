"""Run the notebooks top to bottom and store them with their outputs (what a reader sees on GitHub or in the docs).

    python scripts/execute_notebooks.py                      # every notebook in notebooks/
    python scripts/execute_notebooks.py notebooks/bapo_quickstart.ipynb

Each one runs in a scratch directory (its ``outputs/`` are not written under notebooks/), offline, on the tiny model
(under a minute each on 2 CPU cores: 44 s and 38 s). Stored: every output, except the library warnings of this
machine's packages (``FutureWarning``s, tqdm's "IProgress not found", DeepSpeed's "Setting accelerator to CPU"), with
the PNG figures re-encoded with a 256-colour palette (same size in pixels, a third of the bytes). The stored notebook
records a digest of the code cells it ran (``metadata.bapo_trl.executed_source_sha256``): tests/test_notebooks.py
fails when a code cell was edited and the notebook not run again, so the outputs shown are always those of the code
shown. CI runs every notebook again (slow tier) and checks that it prints the stored numbers (within
tests/test_notebooks.py's ``TOLERANCE``): after running this script, reread the text cells that quote them.

The numbers depend on the CPU's kernels (an Intel Xeon with AVX-512 and an AMD EPYC print others after the 800
warm-start steps), so the stored notebook records the kind of CPU it ran on (``metadata.bapo_trl.cpu``, see
:func:`cpu_kind`), and what an earlier run of the same code printed on another kind is kept in
``notebooks/printed_on_other_cpus.json``: the test compares a fresh run with the run of its own kind.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: what runs of the current code printed on other kinds of CPU: {notebook name: {cpu kind: {cell index: stdout}}}
OTHER_CPUS = ROOT / "notebooks" / "printed_on_other_cpus.json"
#: the kind recorded for the runs stored before the kind was (AMD EPYC, Firecracker VM; its vector extensions unknown)
UNRECORDED_CPU = "AuthenticAMD"


def cpu_kind() -> str:
    """The CPU's vendor and the kernels torch picks on it (``GenuineIntel AVX512``): what the printed numbers depend on
    besides the package versions."""
    import torch

    vendor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def same_cpu(recorded: str, here: str) -> bool:
    """A run recorded with a vendor only (:data:`UNRECORDED_CPU`) stands for every CPU of that vendor."""
    return recorded == here or (" " not in recorded and here.split(" ", 1)[0] == recorded)


def printed(notebook) -> dict[str, str]:
    """What each code cell printed on stdout, by cell index (warnings and progress bars are other outputs)."""
    return {str(index): "".join(o.get("text", "") for o in cell.get("outputs", [])
                                if o.get("output_type") == "stream" and o.get("name") == "stdout")
            for index, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code"}


def recorded_cpu(notebook) -> str:
    return notebook["metadata"].get("bapo_trl", {}).get("cpu", UNRECORDED_CPU)


def printed_on(name: str, stored, here: str) -> dict[str, str] | None:
    """What the stored run of ``name`` printed on a CPU of kind ``here``: the notebook's own outputs, a run kept in
    :data:`OTHER_CPUS`, or None where no run of the current code was recorded on that kind."""
    if same_cpu(recorded_cpu(stored), here):
        return printed(stored)
    others = json.loads(OTHER_CPUS.read_text()).get(name, {}) if OTHER_CPUS.exists() else {}
    return next((cells for kind, cells in others.items() if same_cpu(kind, here)), None)


def keep_other_cpus(name: str, previous, fresh) -> None:
    """Before ``fresh`` replaces ``previous`` (the stored notebook): keep what ``previous`` printed when it ran the
    same code on another kind of CPU; forget the runs of code that changed."""
    others = json.loads(OTHER_CPUS.read_text()) if OTHER_CPUS.exists() else {}
    digest = fresh.metadata["bapo_trl"]["executed_source_sha256"]
    if previous is None or previous.metadata.get("bapo_trl", {}).get("executed_source_sha256") != digest:
        others.pop(name, None)  # the code changed: what other CPUs printed is another program's output
    else:
        runs = {k: v for k, v in others.get(name, {}).items() if not same_cpu(k, recorded_cpu(fresh))}
        if not same_cpu(recorded_cpu(previous), recorded_cpu(fresh)):
            runs[recorded_cpu(previous)] = printed(previous)
        others[name] = runs
    OTHER_CPUS.write_text(json.dumps({k: v for k, v in others.items() if v}, indent=1, sort_keys=True) + "\n")


def source_digest(notebook) -> str:
    """SHA-256 of the code cells' sources, in order (the text cells, outputs and metadata left out)."""
    digest = hashlib.sha256()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            digest.update(f"{cell.source}\0".encode())
    return digest.hexdigest()


#: a Python warning as ``warnings`` prints it (``path:line: SomeWarning: text``), and DeepSpeed's log line on stdout
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")
LOG_WARNING_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[WARNING\] ")


def _is_warnings_only(text: str) -> bool:
    """Every line a Python warning or its indented continuation (the source line ``warnings`` prints under it)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and WARNING_LINE.match(lines[0]) is not None and all(
        WARNING_LINE.match(line) or line.startswith(" ") for line in lines)


def _palette_png(data: str) -> str:
    """A base64 PNG re-encoded with a 256-colour palette (kept as it was where that is not smaller)."""
    from PIL import Image

    raw = base64.b64decode(data)
    buffer = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("RGB").quantize(colors=256).save(buffer, "PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode() if buffer.tell() < len(raw) else data


def compact(notebook):
    """Drop the library warnings of this machine from the outputs and shrink the PNG figures (see the docstring)."""
    for cell in notebook.cells:
        outputs = []
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                if output.name == "stderr" and _is_warnings_only(output.text):
                    continue
                output.text = "".join(line for line in output.text.splitlines(keepends=True)
                                      if not LOG_WARNING_LINE.match(line))
                if not output.text:
                    continue
            elif "image/png" in output.get("data", {}):
                output.data["image/png"] = _palette_png(output.data["image/png"])
            outputs.append(output)
        if "outputs" in cell:
            cell.outputs = outputs
    return notebook


def execute(path: Path, workdir: Path, timeout: int = 900):
    """The notebook at ``path``, run in ``workdir`` with its outputs (nothing written to ``path``)."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(workdir)}}).execute()  # raises on a failing cell
    notebook.metadata["bapo_trl"] = {"executed_source_sha256": source_digest(notebook), "cpu": cpu_kind()}
    return compact(notebook)


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, default=NOTEBOOKS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernels inherit this environment
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for path in args.notebooks:
        previous = nbformat.read(path, as_version=4) if path.exists() else None
        with tempfile.TemporaryDirectory() as workdir:
            notebook = execute(path, Path(workdir))
        keep_other_cpus(path.name, previous, notebook)
        nbformat.write(notebook, path)
        print(f"{path}: executed, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
