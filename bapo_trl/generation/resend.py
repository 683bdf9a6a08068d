"""A request lost before any byte of its answer came back is sent once more, on a fresh connection.

Why: a pooled keep-alive connection can be closed by the server just as the client reuses it (vLLM closes idle ones
after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); the request then fails with a reset or "closed without response" although the
server never saw it, and a healthy run would stop. Only requests that are safe to run twice are resent: reads, seeded
generation (the same seed samples the same completions, and vLLM keeps no state of a request), a weight reload (the
same directory loaded again) and a prefix-cache reset. A LoRA adapter's load or unload is not resent blindly: its
client asks the server what it holds first (:meth:`~.adapter_sync.AdapterSync`). A timeout, a refused connection or
an answer cut off mid-way are never resent: they say the server is stalled, gone or broken.
"""

from __future__ import annotations

import http.client

import requests
from requests.adapters import HTTPAdapter

#: POST paths that may run twice (see the module doc).
RESENDABLE = ("/v1/completions", "/collective_rpc", "/reset_prefix_cache")
#: What a connection closed or reset before the answer raises, somewhere in the chain requests wraps it in.
_LOST = (http.client.RemoteDisconnected, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _chain(exc: BaseException | None, seen: set[int] | None = None):
    """``exc`` and everything it wraps (causes, contexts, arguments, urllib3's ``reason``)."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen or not isinstance(exc, BaseException):
        return
    seen.add(id(exc))
    yield exc
    for inner in (exc.__cause__, exc.__context__, getattr(exc, "reason", None), *exc.args):
        if isinstance(inner, BaseException):
            yield from _chain(inner, seen)


def lost_before_answer(exc: BaseException) -> bool:
    """The request's connection was closed or reset before any answer came back (not a timeout, not a connection
    that could not be opened)."""
    found = list(_chain(exc))
    never_connected = any(isinstance(e, (requests.ConnectTimeout, requests.Timeout)) or
                          type(e).__name__ in ("NewConnectionError", "ConnectTimeoutError") for e in found)
    return not never_connected and any(isinstance(e, _LOST) for e in found)


def resendable(request) -> bool:
    path = request.path_url.split("?")[0]
    return request.method in ("GET", "HEAD") or path in RESENDABLE


class ResendOnLostConnection(HTTPAdapter):
    """An ``HTTPAdapter`` that sends a request once more, on a fresh connection, when :func:`lost_before_answer` and
    the request may run twice (:func:`resendable`); ``resent`` counts those (a test or a log reads it)."""

    resent = 0

    def send(self, request, *args, **kwargs):
        try:
            return super().send(request, *args, **kwargs)
        except requests.ConnectionError as exc:
            if not (lost_before_answer(exc) and resendable(request)):
                raise
            self.poolmanager.clear()  # the idle connections of the pool may be as stale as the one just lost
            self.resent += 1
            return super().send(request, *args, **kwargs)
