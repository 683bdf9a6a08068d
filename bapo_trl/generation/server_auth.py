"""A vLLM server started with an API key: the trainer's requests carry ``Authorization: Bearer $VLLM_API_KEY``, and a
refusal (HTTP 401) is one error saying what to set, whoever made the request (TRL's client or this package's)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

#: The variable the trainer reads its server's API key from (the name vLLM's server reads it from too).
API_KEY_ENV = "VLLM_API_KEY"


class VLLMServerAuthError(PermissionError):
    """The vLLM server refused a request for want of the right API key (HTTP 401)."""


def api_key_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}`` when ``$VLLM_API_KEY`` is set, else nothing."""
    key = environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _refuse_unauthorized(response, *args, **kwargs):
    """A ``requests`` response hook: a 401 answer becomes :class:`VLLMServerAuthError` saying what to set."""
    if response.status_code == 401:
        sent = "Authorization" in response.request.headers
        url = urlsplit(response.url)
        raise VLLMServerAuthError(
            f"the vLLM server at {url.scheme}://{url.netloc} refused {response.request.method} {url.path} "
            "(401 Unauthorized): "
            + (f"${API_KEY_ENV} is not the key the server was started with."
               if sent else f"it was started with an API key; set {API_KEY_ENV} to that key for the trainer.")
        )


def authorize_session(session) -> None:
    """Make a ``requests.Session`` send the API key (when ``$VLLM_API_KEY`` is set) and turn a 401 answer into
    :class:`VLLMServerAuthError`, whoever makes the request (TRL's client or ours). Idempotent."""
    session.headers.update(api_key_headers())
    if _refuse_unauthorized not in session.hooks["response"]:
        session.hooks["response"].append(_refuse_unauthorized)
