"""Push trainer weights to a vLLM server WITHOUT NCCL: through the disk and the server's dev-mode RPC.

Why: TRL syncs server weights with vLLM's NCCL engine, which needs CUDA. On a CPU-only machine the server can instead
reload its weights in place from a safetensors directory (``POST /collective_rpc`` ``reload_weights``, available when
the server runs with ``VLLM_SERVER_DEV_MODE=1``); the prefix cache is then reset so no stale KV is reused. The trainer
and the server must see the same filesystem (same machine, or a shared mount given as ``root``).

Every request has a timeout, and every failure raises :class:`WeightSyncError` naming the server and the cause,
so a dead server stops training with a clear message instead of a hang. On another machine the server must read
the directory at the same path (``$BAPO_VLLM_WEIGHTS_DIR`` on a shared mount):
:meth:`DiskWeightSync.check_shared_directory` checks that once at start, so a directory the server cannot see is
one error naming the variable, not a failed reload later. Requests carry ``Authorization: Bearer $VLLM_API_KEY``
when that variable is set (a server started with an API key). Each sync writes a fresh directory; older ones are
deleted once the server has loaded the new one, and the last one when the client is closed or garbage-collected.

A push has two halves that need not run together: writing the directory (the trainer's process) and the servers
loading it. :meth:`DiskWeightSync.write_later` starts the write on the client's writer thread and
:meth:`DiskWeightSync.load` finishes the push, so async generation writes the weights while the server is still busy
with the request in flight and only the reload itself waits between two requests.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .resend import ResendOnLostConnection
from .seeding import at_once
from .server_answers import (
    PATH_NOT_FOUND,
    WeightSyncError,
    lacks_method,
    reset_succeeded,
    reset_within,
    rpc_results,
)
from .server_auth import API_KEY_ENV, VLLMServerAuthError, api_key_headers, authorize_session  # noqa: F401
from .weight_files import _remove_all, directory_bytes, not_shared_message, writable, write_weights  # noqa: F401

SERVE_HINT = "start it with `bapo serve MODEL --port PORT` or `python -m bapo_trl.cli.serve MODEL --port PORT`"
#: The worker extension's method that reads the start-up probe file (bapo_vllm_worker.BAPOWorkerExtension).
PROBE_METHOD = "bapo_read_probe"
#: The worker extension's RPC that keeps (and tells) the name of the weight directory a server loaded last.
MARK_METHOD = "bapo_weights_mark"


class WrittenWeights:
    """A push whose directory the writer thread is writing (:meth:`DiskWeightSync.write_later`); :meth:`directory`
    waits for it (and raises the write's error)."""

    def __init__(self, future: Future):
        self._future = future

    def directory(self) -> str:
        return self._future.result()


class DiskWeightSync:
    """Client for the disk reload path of one vLLM server, or of several (each push is written once and every server
    loads it, at once; a failure names the server).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``, or a list of servers.
        timeout: seconds allowed for each request (the reload itself runs inside it).
        root: parent of the weight directories (default ``$BAPO_VLLM_WEIGHTS_DIR`` or the system temp dir); must be
            readable by the server at the same path.
        refresh_output_layers: also call the worker extension that re-packs a tied LM head (needed for models
            with tied embeddings on vLLM's CPU backend; the server must run our worker extension, as the serve
            command does).
        mark_weights: mark each push on the servers (:meth:`reload_if_restarted`); full weights only.
    """

    def __init__(self, base_url: str | Sequence[str], timeout: float = 240.0, root: str | None = None,
                 refresh_output_layers: bool = False, mark_weights: bool = False):
        import requests

        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_urls = [url.rstrip("/") for url in urls]
        self.base_url = self.base_urls[0]
        self.timeout = float(timeout)
        self.root = root or os.environ.get("BAPO_VLLM_WEIGHTS_DIR") or tempfile.gettempdir()
        self.refresh_output_layers = refresh_output_layers
        # One session per server (pushes reach the servers from threads at once); no automatic retries: a failure
        # is reported at once (a request lost before any answer on a reused connection goes once more: .resend).
        self.sessions = {url: requests.Session() for url in self.base_urls}
        for session in self.sessions.values():
            for prefix in ("http://", "https://"):
                session.mount(prefix, ResendOnLostConnection())
            authorize_session(session)
        self.session = self.sessions[self.base_url]
        self._dirs: list[str] = []  # directories written by this client and not yet removed, oldest first
        self._dirs_lock = threading.Lock()  # the writer thread adds, the loading thread removes
        self._loaded: str | None = None
        self._load_lock = threading.RLock()  # loads and restart checks one at a time (a check mid-load: older weights)
        self.mark_weights, self._marks = mark_weights, {}  # _marks: server -> whether it keeps a mark (extension)
        self.restarts: list[str] = []  # servers found restarted, which loaded the last push again (adapter: + base)
        #: ``on_restart(url)``: called when a server is found restarted (or not holding the last push), before it
        #: loads weights again; the backend checks the server's flags there. An error leaves the server as found.
        self.on_restart: Callable[[str], None] | None = None
        self._writer: ThreadPoolExecutor | None = None  # one thread: directories are written in push order
        self._finalizer = weakref.finalize(self, _remove_all, self._dirs)
        self.last_seconds: float | None = None
        self.last_bytes: int | None = None
        self.num_syncs = 0
        self._written: dict[str, tuple[int, float]] = {}  # directory -> (bytes written, seconds the write took)
        self.pushes: list[tuple[int, float]] = []  # (bytes, seconds) of each push loaded, until taken (take_pushes)

    # -- HTTP --------------------------------------------------------------------------------------------------

    def _post(self, path: str, what: str, json: dict | None = None, base_url: str | None = None):
        import requests

        base_url = base_url or self.base_url
        url = f"{base_url}{path}"
        try:
            response = self.sessions[base_url].post(url, json=json, timeout=self.timeout)
        except VLLMServerAuthError as exc:
            raise WeightSyncError(f"{what}: {exc}") from exc
        except requests.Timeout as exc:
            raise WeightSyncError(f"{what}: the vLLM server at {base_url} did not answer {path} within "
                                  f"{self.timeout:g} s.") from exc
        except requests.RequestException as exc:
            raise WeightSyncError(f"{what}: cannot reach the vLLM server at {base_url} ({type(exc).__name__}). "
                                  f"Is it running? If not, {SERVE_HINT}.") from exc
        if response.status_code == 404 and path == "/collective_rpc":
            raise WeightSyncError(f"{what}: the vLLM server at {base_url} has no /collective_rpc endpoint; it must "
                                  f"run with VLLM_SERVER_DEV_MODE=1 ({SERVE_HINT}).")
        if response.status_code != 200:
            try:
                detail = response.json().get("error", {}).get("message") or response.text
            except ValueError:
                detail = response.text
            raise WeightSyncError(f"{what}: the vLLM server at {base_url} answered {response.status_code}: "
                                  f"{detail[:500]}")
        return response

    def _rpc(self, method: str, what: str, base_url: str | None = None, **kwargs: str):
        body = {"method": method, "kwargs": kwargs, "timeout": self.timeout}
        return self._post("/collective_rpc", what, json=body, base_url=base_url)

    def _on_every_server(self, call) -> list:
        """``call(base_url)`` for every server, at once; the first failure (naming its server) is raised after all
        have answered."""
        return at_once(call, self.base_urls)

    # -- start-up check ----------------------------------------------------------------------------------------

    def check_shared_directory(self) -> bool:
        """Write a small file where the weights will go and have every server read it back (worker extension RPC
        ``bapo_read_probe``). Raises :class:`WeightSyncError` naming ``BAPO_VLLM_WEIGHTS_DIR`` when a server
        cannot read it or reads something else (another machine's directory of that name). Returns False when a
        server cannot tell (no worker extension; :meth:`push` then reports a reload that failed on the path)."""
        token = secrets.token_hex(16)
        directory = tempfile.mkdtemp(prefix="bapo-vllm-probe-", dir=self.root)
        path = os.path.join(directory, "bapo_probe.txt")
        try:
            with open(path, "w") as f:
                f.write(token)
            return all(self._on_every_server(lambda url: self._check_reads(url, path, token)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _check_reads(self, base_url: str, path: str, token: str) -> bool:
        try:
            response = self._rpc(PROBE_METHOD, "weight directory check failed", base_url=base_url, path=path)
        except WeightSyncError as exc:
            if lacks_method(exc, PROBE_METHOD):  # a server without our worker extension: it cannot tell
                return False
            raise
        results = rpc_results(response)
        if results is None:
            return False  # not vLLM's answer to a known method (a stand-in server): nothing to check
        for result in results:  # one per worker (tensor-parallel workers may run on several machines)
            if not isinstance(result, dict) or result.get("content") != token:
                detail = result.get("error") if isinstance(result, dict) else None
                if isinstance(result, dict) and result.get("content") is not None:
                    detail = "it holds another file of that name: not the same directory"
                host = result.get("host") if isinstance(result, dict) else None
                if host:
                    detail = f"{detail}; server host {host}" if detail else f"server host {host}"
                raise WeightSyncError(not_shared_message(base_url, path, detail))
        return True

    # -- sync --------------------------------------------------------------------------------------------------

    def push(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> float:
        """Write ``tensors`` (checkpoint names, as in the model's ``state_dict``) once and make every server load
        them (at once). Returns the seconds the sync took. On failure the new directory is removed and the error
        (naming the server) raised."""
        self.load(self._write(tensors))
        return self.last_seconds

    def write_later(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> WrittenWeights:
        """Start writing ``tensors`` on this client's writer thread and return at once; :meth:`load` finishes the
        push. The caller must not change the tensors until the write is done (gathered copies, as async generation
        passes, are safe). Writes happen in call order."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bapo-weight-writer")
        return WrittenWeights(self._writer.submit(self._write, tensors))

    def _write(self, tensors) -> str:
        start = time.perf_counter()
        directory = self._write_payload(tensors)
        with self._dirs_lock:
            self._written[directory] = (directory_bytes(directory), time.perf_counter() - start)
        return directory

    def _track(self, directory: str) -> None:
        with self._dirs_lock:
            self._dirs.append(directory)

    def _write_payload(self, tensors) -> str:
        """Write one push's files into a new directory (tracked from its creation); returns the directory."""
        return write_weights(tensors, self.root, "bapo-vllm-weights-", on_created=self._track, handed_over=True)

    def take_pushes(self) -> list[tuple[int, float]]:
        """``(bytes written, seconds)`` of every push loaded since the last call (the trainer logs them as
        ``weight_sync/pushed_bytes`` and ``weight_sync/seconds``)."""
        with self._dirs_lock:
            pushes, self.pushes = self.pushes, []
        return pushes

    def load(self, written: WrittenWeights | str) -> float:
        """Make every server load a directory written by this client (waiting for its write first); directories
        written before it are removed once every server has loaded it, newer ones are kept. Returns the seconds
        the load took (the wait for the write included). On failure the directory is removed and the error (naming
        the server) raised."""
        start = time.perf_counter()
        directory = written.directory() if isinstance(written, WrittenWeights) else written
        with self._load_lock:
            loading = time.perf_counter()  # the push's own time is its write's plus this load's (not the wait between)
            try:
                previous = self._loaded
                self._on_every_server(lambda url: self._load_after(url, directory, previous))
                self._after_load(directory)
            except BaseException:
                with self._dirs_lock:
                    if directory in self._dirs:
                        self._dirs.remove(directory)
                    self._written.pop(directory, None)
                shutil.rmtree(directory, ignore_errors=True)
                raise
            # The servers have read the new directory: older ones (loaded before, or replaced before they were loaded)
            # are no longer needed; newer ones are still to be loaded.
            with self._dirs_lock:
                index = self._dirs.index(directory)
                older, self._dirs[:index] = self._dirs[:index], []
                written_bytes, write_seconds = self._written.pop(directory, (0, 0.0))
                for old in older:
                    self._written.pop(old, None)
                end = time.perf_counter()
                self.last_bytes, self.last_seconds = written_bytes, write_seconds + end - loading
                self.pushes.append((self.last_bytes, self.last_seconds))
            for old in older:
                shutil.rmtree(old, ignore_errors=True)
            self._loaded = directory
            self.num_syncs += 1
            return end - start

    def _load_after(self, base_url: str, directory: str, previous: str | None) -> None:
        """One server's part of a push: a server that keeps a mark and no longer holds ``previous`` (the push before,
        now replaced: it restarted since) is reported first (:meth:`_found_restarted`), as before a request."""
        if previous is not None and self.mark_weights and self._marks.get(base_url):
            marks = self._mark(base_url)
            if marks is None or any(mark != os.path.basename(previous) for mark in marks):
                self._found_restarted(base_url)
        self._load(base_url, directory)

    def _found_restarted(self, base_url: str) -> None:
        self.restarts.append(base_url)
        if self.on_restart is not None:
            self.on_restart(base_url)

    def _after_load(self, directory: str) -> None:
        """Every server has loaded ``directory`` (a subclass's next step: the adapter push switches names here)."""

    def _load(self, base_url: str, directory: str) -> None:
        """One server: reload the weights from ``directory``, re-pack a tied head, reset the prefix cache."""
        try:
            self._rpc("reload_weights", "weight sync failed", base_url=base_url, weights_path=directory)
        except WeightSyncError as exc:
            if any(sign in str(exc) for sign in (os.path.basename(directory), *PATH_NOT_FOUND)):
                raise WeightSyncError(f"{exc}\n{not_shared_message(base_url, directory)}") from exc
            raise
        if self.refresh_output_layers:
            try:
                self._rpc("bapo_refresh_output_layers", "weight sync (tied LM head refresh) failed", base_url=base_url)
            except WeightSyncError as exc:
                if lacks_method(exc, "bapo_refresh_output_layers"):
                    raise WeightSyncError(
                        f"{exc}\nThis model ties its embeddings, and vLLM's CPU backend needs the worker extension "
                        f"that re-packs the LM head after a reload; {SERVE_HINT}."
                    ) from exc
                raise
        self._reset_prefix_cache(base_url)
        if self.mark_weights and self._marks.get(base_url, True):
            self._marks[base_url] = self._mark(base_url, os.path.basename(directory)) is not None

    def _mark(self, base_url: str, name: str | None = None) -> list | None:
        """One server's mark of its weights (``name``: set first), per worker; None: it keeps none (no extension)."""
        try:
            response = self._rpc(MARK_METHOD, "weight mark failed", base_url=base_url,
                                 **({} if name is None else {"name": name}))
        except WeightSyncError as exc:
            if lacks_method(exc, MARK_METHOD):  # a server without our worker extension
                return None
            raise
        return rpc_results(response)

    def reload_if_restarted(self) -> list[str]:
        """Before requests: a server that lost the weights it loaded last (restarted, its completions would be stamped
        with the pushed version) loads them again; returns those (also in :attr:`restarts`). Servers without a mark
        (no worker extension) cannot tell."""
        with self._load_lock:
            loaded = self._loaded
            if loaded is None:  # nothing pushed yet, or the run's files removed (close)
                return []

            def check(base_url: str) -> str | None:
                if not self._marks.get(base_url):  # it never kept a mark: it cannot tell
                    return None
                marks = self._mark(base_url)  # None: the extension is gone (restarted without it)
                if marks is not None and all(mark == os.path.basename(loaded) for mark in marks):
                    return None
                if not os.path.isdir(loaded):
                    raise WeightSyncError(f"the vLLM server at {base_url} lost the weights it loaded last (it "
                                          f"restarted) and the last push's directory {loaded} is gone (removed by "
                                          "something else, a temp-dir cleaner?): set BAPO_VLLM_WEIGHTS_DIR to a "
                                          "directory nothing else cleans.")
                self._found_restarted(base_url)
                self._load(base_url, loaded)  # and the mark again, where it can keep one
                return base_url

            return [url for url in self._on_every_server(check) if url is not None]

    def _reset_prefix_cache(self, base_url: str) -> None:
        reset_within(lambda: self._reset_once(base_url), base_url, self.timeout)

    def _reset_once(self, base_url: str) -> bool:
        return reset_succeeded(self._post("/reset_prefix_cache", "weight sync (prefix cache reset) failed",
                                          base_url=base_url))

    @property
    def current_dir(self) -> str | None:
        """The directory the server loaded last (kept until the next sync or :meth:`close`)."""
        return self._loaded

    def close(self) -> None:
        """Finish the writes under way, then remove every weight directory this client wrote."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        with self._dirs_lock:
            _remove_all(self._dirs)
        self._loaded = None
        for session in self.sessions.values():
            session.close()
