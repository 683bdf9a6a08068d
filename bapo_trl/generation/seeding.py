"""Seeded generation calls: one request per prompt, each with a seed of its own.

vLLM gives every prompt of a seeded request the request's seed (child ``j`` of a prompt: ``seed + j``). A call that
holds the same prompt twice then samples it twice identically: partial rollout, in-flight updates and TRL's colocated
engine send a group's members as prompts of their own (``n=1``), so one seed per call (the user's ``seed`` in
``generation_kwargs``, or a request seed) would make every group a set of copies, every advantage zero, and nothing
would train. Every seeded call with several prompts is therefore sent as one request per prompt, all at once (vLLM
batches concurrent requests itself), each seeded from the call's seed and the call's prompts: reproducible (the same
call samples the same completions), and no two prompts, nor two calls with other prompts, share a random stream.

The derivation happens once, in the outermost client (one server, or a fleet that spreads the per-prompt requests);
a call with one prompt keeps its seed as given. Inside :func:`seed_salt` (the trainer's generation: its step, the
call's index in that step, and in colocate mode the process's engine group) the salt joins every derivation, a call
of one prompt included: two processes holding the same prompts (TRL spreads a group over processes), or the same
prompts in a later step, draw other numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

#: What makes a call's seeds unique beyond its own prompts (set by :func:`seed_salt`; per thread: a producer thread
#: generating in the background never sees the trainer thread's).
_SALT: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("bapo_seed_salt", default=None)


@contextlib.contextmanager
def seed_salt(*parts):
    """Seeded calls made inside (this thread) derive their seeds from ``parts`` too (see the module doc)."""
    token = _SALT.set(parts)
    try:
        yield
    finally:
        _SALT.reset(token)


@contextlib.contextmanager
def seed_salt_spent():
    """No salt inside: a call whose seeds were derived already goes on with them as they are."""
    token = _SALT.set(None)
    try:
        yield
    finally:
        _SALT.reset(token)


def prompt_seeds(seed: int, count: int, n: int) -> list[int]:
    """A sampling seed for each of ``count`` prompts of a seeded request, reproducible from ``seed``: drawn apart, so
    no two prompts (nor their ``n`` children, seeded ``s .. s + n - 1`` by vLLM) share a random stream."""
    rng = random.Random(seed)
    return [rng.randrange(2**31 - n) for _ in range(count)]


def mixed_seed(*parts) -> int:
    """One seed from several parts (seeds, prompt lists): the same parts give the same seed, any change another."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def per_prompt_seeds(seed: int, prompts: Sequence, n: int) -> list[int]:
    """The seed of each prompt of a seeded call: from the call's ``seed``, its prompts and the salt in force (see the
    module doc)."""
    salt = _SALT.get()
    base = mixed_seed(int(seed), list(prompts)) if salt is None else mixed_seed(int(seed), salt, list(prompts))
    return prompt_seeds(base, len(prompts), n)


def derives(prompts: Sequence, seed) -> bool:
    """Whether a call's prompts get seeds of their own: seeded, and several prompts or a salt in force."""
    return seed is not None and (len(prompts) > 1 or _SALT.get() is not None)


class RequestCounter:
    """Generate requests answered so far (any thread): the progress the producer's bounded waits restart on, so a large
    batch that a healthy server answers request by request is never taken for a stall."""

    def __init__(self):
        self._lock = threading.Lock()
        self.answered = 0

    def add(self, count: int = 1) -> None:
        with self._lock:
            self.answered += count


def seeded_calls(prompts: Sequence, n: int, generation_kwargs: dict | None) -> list[dict] | None:
    """The ``generation_kwargs`` of each per-prompt request of a call, or None where the call goes as one request
    (unseeded, or a single prompt)."""
    kwargs = generation_kwargs or {}
    if not derives(prompts, kwargs.get("seed")):
        return None
    return [{**kwargs, "seed": s} for s in per_prompt_seeds(kwargs["seed"], prompts, n)]


def at_once(call: Callable, items: Sequence) -> list:
    """``call(item)`` for every item, in threads of their own (one item: in this thread); the results in order. The
    pool is as wide as the items: a seeded batch of 768 prompts is 768 requests in flight, never waves of a few."""
    if len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        futures = [pool.submit(call, item) for item in items]
        return [future.result() for future in futures]


def merge_outputs(outputs: list[dict]) -> dict[str, list]:
    """``generate`` answers of consecutive prompt shares as one answer (each key concatenated; None stays None)."""
    if not outputs:
        return {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}
    merged = {}
    for key in outputs[0]:
        values = [output.get(key) for output in outputs]
        merged[key] = None if any(v is None for v in values) else [item for value in values for item in value]
    return merged


def generate_seeded(send: Callable[..., dict], counter: RequestCounter, prompts: Sequence, features=None,
                    **sampling) -> dict:
    """A ``VLLMClient.generate`` call through ``send`` (the same signature, one request): a seeded call with several
    prompts as one request per prompt (see the module doc), every answered request counted."""
    calls = seeded_calls(prompts, sampling.get("n", 1), sampling.get("generation_kwargs"))
    with seed_salt_spent():  # derived here, once: the clients below send the seeds as given
        if calls is None:
            output = send(prompts=prompts, features=features, **sampling)
            counter.add()
            return output

        def one(index: int) -> dict:
            part = None if features is None else features[index : index + 1]
            output = send(prompts=prompts[index : index + 1], features=part,
                          **{**sampling, "generation_kwargs": calls[index]})
            counter.add()
            return output

        return merge_outputs(at_once(one, range(len(prompts))))


class PerPromptSeeds:
    """Mixed into a ``VLLMClient`` (put first in the bases): its ``generate`` sends a seeded call with several prompts
    as one request per prompt, and counts answered requests (:attr:`requests`)."""

    @property
    def requests(self) -> RequestCounter:
        counter = self.__dict__.get("_bapo_requests")
        if counter is None:
            counter = self.__dict__.setdefault("_bapo_requests", RequestCounter())
        return counter

    def generate(self, prompts, features=None, **sampling) -> dict:
        return generate_seeded(super().generate, self.requests, prompts, features, **sampling)


class SeededEngine:
    """TRL's colocated ``vllm.LLM`` (in the trainer's process), whose ``generate`` gives each prompt of a seeded call
    a seed of its own (vLLM's ``generate`` takes a list of sampling params, one per prompt); everything else is the
    engine's own."""

    def __init__(self, llm):
        self.__dict__["_llm"] = llm
        self.__dict__["lora_request"] = None  # the LoRA adapter every call generates with (the adapter push), or None

    def __getattr__(self, name):
        return getattr(self.__dict__["_llm"], name)

    def __setattr__(self, name, value):
        if name == "lora_request":
            self.__dict__[name] = value
        else:
            setattr(self.__dict__["_llm"], name, value)

    def generate(self, prompts, sampling_params=None, *args, **kwargs):
        params = sampling_params
        seed = getattr(params, "seed", None)
        if isinstance(prompts, (list, tuple)) and derives(prompts, seed):
            keys = [p.get("prompt_token_ids", p) if isinstance(p, dict) else p for p in prompts]
            seeds = per_prompt_seeds(seed, keys, getattr(params, "n", 1))
            params = [params.clone() for _ in prompts]
            for one, s in zip(params, seeds):
                one.seed = s
        if self.__dict__["lora_request"] is not None:
            kwargs.setdefault("lora_request", self.__dict__["lora_request"])
        return self.__dict__["_llm"].generate(prompts, params, *args, **kwargs)
