"""An ASGI middleware for the vLLM server (``--middleware bapo_vllm_auth.BearerTokenEverywhere``): the API key on
every endpoint.

Why: vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (its
``GUARDED_PREFIX``). The development-mode endpoints the weight sync needs (``/collective_rpc``, which makes the
server load weights from any path it can read or call any worker method, ``/reset_prefix_cache``, ``/sleep``,
``/server_info``, and TRL's weight-transfer endpoints) stay open to anyone who reaches the port. This middleware
requires ``Authorization: Bearer $VLLM_API_KEY`` on every path except ``/health`` (probed before any request
carries a key). Imported by the server only: standard library and Starlette (a vLLM dependency).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = ("/health",)


class BearerTokenEverywhere:
    """Refuses (401) every HTTP/WebSocket request without the key, except ``OPTIONS`` and :data:`OPEN_PATHS`."""

    def __init__(self, app):
        key = os.environ.get("VLLM_API_KEY")
        if not key:
            raise RuntimeError("bapo_vllm_auth.BearerTokenEverywhere needs VLLM_API_KEY in the server's environment")
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
