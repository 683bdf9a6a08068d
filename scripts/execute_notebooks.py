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
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


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
    notebook.metadata["bapo_trl"] = {"executed_source_sha256": source_digest(notebook)}
    return compact(notebook)


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, default=NOTEBOOKS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernels inherit this environment
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for path in args.notebooks:
        with tempfile.TemporaryDirectory() as workdir:
            notebook = execute(path, Path(workdir))
        nbformat.write(notebook, path)
        print(f"{path}: executed, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
