"""Push trainer weights to a vLLM server WITHOUT NCCL: through the disk and the server's dev-mode RPC.

Why: TRL syncs server weights with vLLM's NCCL engine, which needs CUDA. On a CPU-only machine the server can instead
reload its weights in place from a safetensors directory (``POST /collective_rpc`` ``reload_weights``, available when
the server runs with ``VLLM_SERVER_DEV_MODE=1``); the prefix cache is then reset so no stale KV is reused. The trainer
and the server must see the same filesystem (same machine, or a shared mount given as ``root``).

Every request has a timeout, and every failure raises :class:`WeightSyncError` naming the server and the cause, so a
dead server stops training with a clear message instead of a hang. Each sync writes a fresh directory; older ones are
deleted once the server has loaded the new one, and the last one when the client is closed or garbage-collected.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping

import torch

SERVE_HINT = "start it with `bapo serve MODEL --port PORT` or `python -m bapo_trl.generation.serve MODEL --port PORT`"


class WeightSyncError(RuntimeError):
    """The vLLM server could not be reached, or did not load the new weights."""


def write_weights(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root: str | None,
                  prefix: str) -> str:
    """Write ``tensors`` (checkpoint names) as ``model.safetensors`` in a new directory under ``root`` (default
    ``$BAPO_VLLM_WEIGHTS_DIR`` or the temp dir), for vLLM's ``reload_weights``; returns the directory."""
    from safetensors.torch import save_file

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    # Own, contiguous CPU copies: safetensors refuses views and shared storage.
    state = {name: t.detach().to("cpu").contiguous().clone() for name, t in items}
    directory = tempfile.mkdtemp(prefix=prefix, dir=root or os.environ.get("BAPO_VLLM_WEIGHTS_DIR") or None)
    try:
        save_file(state, os.path.join(directory, "model.safetensors"))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def _remove_all(paths: list[str]) -> None:
    while paths:
        shutil.rmtree(paths.pop(), ignore_errors=True)


class DiskWeightSync:
    """Client for the disk reload path of one vLLM server.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        timeout: seconds allowed for each request (the reload itself runs inside it).
        root: parent of the weight directories (default ``$BAPO_VLLM_WEIGHTS_DIR`` or the system temp dir); must be
            readable by the server at the same path.
        refresh_output_layers: also call the worker extension that re-packs a tied LM head (needed for models with
            tied embeddings on vLLM's CPU backend; the server must run our worker extension, as the serve command does).
    """

    def __init__(self, base_url: str, timeout: float = 240.0, root: str | None = None,
                 refresh_output_layers: bool = False):
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.root = root or os.environ.get("BAPO_VLLM_WEIGHTS_DIR") or tempfile.gettempdir()
        self.refresh_output_layers = refresh_output_layers
        self.session = requests.Session()  # no automatic retries: a failure is reported at once
        self._dirs: list[str] = []  # directories written by this client and not yet removed
        self._finalizer = weakref.finalize(self, _remove_all, self._dirs)
        self.last_seconds: float | None = None
        self.num_syncs = 0

    # -- HTTP --------------------------------------------------------------------------------------------------

    def _post(self, path: str, what: str, json: dict | None = None):
        import requests

        url = f"{self.base_url}{path}"
        try:
            response = self.session.post(url, json=json, timeout=self.timeout)
        except requests.Timeout as exc:
            raise WeightSyncError(f"{what}: the vLLM server at {self.base_url} did not answer {path} within "
                                  f"{self.timeout:g} s.") from exc
        except requests.RequestException as exc:
            raise WeightSyncError(f"{what}: cannot reach the vLLM server at {self.base_url} ({type(exc).__name__}). "
                                  f"Is it running? If not, {SERVE_HINT}.") from exc
        if response.status_code == 404 and path == "/collective_rpc":
            raise WeightSyncError(f"{what}: the vLLM server at {self.base_url} has no /collective_rpc endpoint; it must "
                                  f"run with VLLM_SERVER_DEV_MODE=1 ({SERVE_HINT}).")
        if response.status_code != 200:
            try:
                detail = response.json().get("error", {}).get("message") or response.text
            except ValueError:
                detail = response.text
            raise WeightSyncError(f"{what}: the vLLM server at {self.base_url} answered {response.status_code}: "
                                  f"{detail[:500]}")
        return response

    def _rpc(self, method: str, what: str, **kwargs: str):
        body = {"method": method, "kwargs": kwargs, "timeout": self.timeout}
        return self._post("/collective_rpc", what, json=body)

    # -- sync --------------------------------------------------------------------------------------------------

    def push(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> float:
        """Write ``tensors`` (checkpoint names, as in the model's ``state_dict``) and make the server load them.

        Returns the seconds the sync took. On failure the new directory is removed and the error raised.
        """
        start = time.perf_counter()
        directory = write_weights(tensors, self.root, "bapo-vllm-weights-")
        self._dirs.append(directory)
        try:
            self._rpc("reload_weights", "weight sync failed", weights_path=directory)
            if self.refresh_output_layers:
                try:
                    self._rpc("bapo_refresh_output_layers", "weight sync (tied LM head refresh) failed")
                except WeightSyncError as exc:
                    if "bapo_refresh_output_layers" in str(exc):
                        raise WeightSyncError(
                            f"{exc}\nThis model ties its embeddings, and vLLM's CPU backend needs the worker extension "
                            f"that re-packs the LM head after a reload; {SERVE_HINT}."
                        ) from exc
                    raise
            self._post("/reset_prefix_cache", "weight sync (prefix cache reset) failed")
        except BaseException:
            shutil.rmtree(self._dirs.pop(), ignore_errors=True)
            raise
        # The server has read the new directory: older ones are no longer needed.
        for old in self._dirs[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        del self._dirs[:-1]
        self.num_syncs += 1
        self.last_seconds = time.perf_counter() - start
        return self.last_seconds

    @property
    def current_dir(self) -> str | None:
        """The directory the server loaded last (kept until the next sync or :meth:`close`)."""
        return self._dirs[-1] if self._dirs else None

    def close(self) -> None:
        """Remove every weight directory this client wrote."""
        _remove_all(self._dirs)
        self.session.close()
