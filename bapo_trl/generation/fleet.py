"""Several vLLM servers behind one client: ``vllm_server_base_url`` may name a list of servers.

Why: vLLM 0.14 and later refuse data parallelism for dense models, so generation scales by running several servers
(each possibly tensor-parallel). TRL's backend talks to one ``VLLMClient``; :class:`ServerFleet` is that client for
several servers. Each generate call is split into contiguous shares of its prompts, one request per server, sized so
that every server ends up with about as many prompts in flight (calls arrive from several threads at once: a seeded
batch goes one prompt per request); the answers are put back in prompt order. Maintenance calls (prefix-cache reset,
and on CUDA the NCCL weight transfer) reach every server. The disk weight sync reaches every server through
:class:`~.weight_sync.DiskWeightSync`, which takes the same list.

The fleet only needs what each client offers (``generate``, ``reset_prefix_cache``, ...), so it serves TRL's own
client on CUDA and the HTTP client without CUDA alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

from .seeding import RequestCounter, at_once, generate_seeded, merge_outputs

__all__ = ["ServerFleet", "at_once", "merge_outputs", "naming", "one_client", "server_urls", "shares"]

FIELD = "vllm_server_base_url"


def server_urls(value: str | Sequence[str] | None) -> list[str]:
    """The server URLs in ``vllm_server_base_url``: one URL, a comma-separated string of them (what a command line
    gives), or a list. Raises ``ValueError`` naming the field for a malformed or repeated URL."""
    if value is None:
        return []
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, Sequence) and all(isinstance(part, str) for part in value):
        items = [part.strip() for part in value]
    else:
        raise ValueError(f"`{FIELD}` must be a URL, a comma-separated string of URLs or a list of URLs; got "
                         f"{type(value).__name__} {value!r}.")
    urls = []
    for item in items:
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"`{FIELD}`: {item!r} is not a server URL such as http://10.0.0.2:8000 "
                             f"(from {value!r}).")
        try:
            parts.port  # noqa: B018 - raises for a port outside 0-65535
        except ValueError as exc:
            raise ValueError(f"`{FIELD}`: {item!r} has an invalid port ({exc}).") from None
        url = item.rstrip("/")
        if url in urls:
            raise ValueError(f"`{FIELD}` names {url} twice: each server is listed once (from {value!r}).")
        urls.append(url)
    if not urls:
        raise ValueError(f"`{FIELD}` is empty: name at least one server URL.")
    return urls


def normalized_server_urls(value):
    """What ``BAPOConfig`` stores: one URL as a string (exactly TRL's field), several as a list of strings."""
    urls = server_urls(value)
    if not urls:
        return None
    return urls[0] if len(urls) == 1 else urls


@contextlib.contextmanager
def naming(base_url: str):
    """Errors raised inside name the server: one whose message does not (TRL's client raises a bare ``Exception`` for
    an HTTP error answer) becomes a ``RuntimeError`` that does; bapo_trl's timeouts and lost connections name it
    already and pass as they are."""
    try:
        yield
    except Exception as exc:
        if base_url in str(exc):
            raise
        raise RuntimeError(f"the vLLM server at {base_url} failed: {type(exc).__name__}: {exc}") from exc


def one_client(clients: Sequence):
    """The client of one server itself, or a :class:`ServerFleet` of several."""
    return clients[0] if len(clients) == 1 else ServerFleet(clients)


def shares(count: int, loads: Sequence[int]) -> list[int]:
    """How many of ``count`` new prompts each server takes, given the prompts it has in flight (``loads``): each
    prompt goes to the least-loaded server (ties to the first), so loads end as even as they can."""
    taken = [0] * len(loads)
    for _ in range(count):
        index = min(range(len(loads)), key=lambda i: loads[i] + taken[i])
        taken[index] += 1
    return taken


class ServerFleet:
    """One client for several vLLM servers (``clients``: a ``VLLMClient`` per server, in the order listed)."""

    def __init__(self, clients: Sequence):
        if len(clients) < 2:
            raise ValueError("a ServerFleet joins two or more servers; use the client itself for one")
        self.clients = list(clients)
        models = {client.base_url: getattr(client, "model", None) for client in self.clients}
        if len(set(models.values())) > 1:  # TRL's client reads the served model's name from /v1/models
            raise ValueError("the servers of `vllm_server_base_url` must serve the same model; they serve "
                             + ", ".join(f"{model!r} at {url}" for url, model in models.items()) + ".")
        self._in_flight = [0] * len(self.clients)  # prompts sent to each server and not yet answered
        self._lock = threading.Lock()
        self.prompts_sent = [0] * len(self.clients)  # per server, since the start (a metric and a test probe)
        self.requests = RequestCounter()  # generate requests answered (the producer's progress)

    @property
    def base_urls(self) -> list[str]:
        return [client.base_url for client in self.clients]

    @property
    def base_url(self) -> str:
        """The first server (what code written for one server reads; errors name the server that failed)."""
        return self.clients[0].base_url

    def __repr__(self) -> str:
        return f"ServerFleet({', '.join(self.base_urls)})"

    # -- generation -------------------------------------------------------------------------------------------------

    def generate(self, prompts: list, features: list | None = None, **sampling) -> dict[str, list]:
        """``VLLMClient.generate`` over the fleet: contiguous shares of ``prompts`` to the least-loaded servers, at
        once; the outputs (prompt-major, ``n`` per prompt) concatenated in prompt order. A seeded call with several
        prompts goes one prompt per request (:mod:`.seeding`), each to the least-loaded server."""
        return generate_seeded(self._spread, self.requests, prompts, features, **sampling)

    def _spread(self, prompts: list, features: list | None = None, **sampling) -> dict[str, list]:
        with self._lock:
            taken = shares(len(prompts), self._in_flight)
            for index, share in enumerate(taken):
                self._in_flight[index] += share
                self.prompts_sent[index] += share
        jobs, start = [], 0
        for index, share in enumerate(taken):
            if share:
                jobs.append((index, start, start + share))
                start += share

        def run(job):
            index, begin, end = job
            client = self.clients[index]
            try:
                part = None if features is None else features[begin:end]
                with naming(client.base_url):
                    return client.generate(prompts=prompts[begin:end], features=part, **sampling)
            finally:
                with self._lock:
                    self._in_flight[index] -= end - begin

        return merge_outputs(at_once(run, jobs))

    # -- calls every server must receive -----------------------------------------------------------------------------

    def _each(self, method: str, *args, **kwargs) -> list:
        """``method`` on every client, at once; the first failure is raised (it names its server)."""
        def call(client):
            with naming(client.base_url):
                return getattr(client, method)(*args, **kwargs)

        return at_once(call, self.clients)

    def reset_prefix_cache(self):
        return self._each("reset_prefix_cache")

    def init_communicator(self, device=0):
        """CUDA: one NCCL weight-transfer group per server (each client was given a port of its own)."""
        for client in self.clients:
            client.init_communicator(device=device)

    def update_named_params(self, metadata, named_params):
        """CUDA: every tensor to every server. ``named_params`` is walked once (under ZeRO-3 each item is a collective
        gather on every rank, so it cannot be walked once per server): inside each server's ``weight_update`` (one
        prepare and one finalize per server), each tensor is streamed to the servers in turn."""
        by_name = {entry[0]: entry for entry in metadata}
        with contextlib.ExitStack() as updating:
            for client in self.clients:
                updating.enter_context(client.weight_update())
            for name, tensor in named_params:
                for client in self.clients:
                    client.update_named_params([by_name[name]], iter([(name, tensor)]))

    def update_named_param(self, name, tensor):
        for client in self.clients:
            client.update_named_param(name, tensor)

    def close_communicator(self):
        for client in self.clients:
            client.close_communicator()

    def image_features(self, images):
        """Image preprocessing (multimodal prompts) on the first server; the features then travel with their prompts
        to whichever server generates them."""
        return self.clients[0].image_features(images)

    def get_server_info(self) -> dict:
        """The first server's (what TRL reads). Settings may differ between servers: the trainer checks the log-prob
        mode of every server itself (:func:`~.http_client.check_logprobs_mode`)."""
        return self.clients[0].get_server_info()
