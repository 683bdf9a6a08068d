"""The ``"vllm"`` generation backend (:mod:`.contract`): one or several vLLM servers, reached with the client and the
weight pushes of TRL's vLLM backend (:class:`~.vllm_generation.BAPOVLLMGeneration`, the one TRL's synchronous
generation uses), so a run talks to its servers one way.

Requests go through a client that sends each request once and bounds it by ``vllm_server_timeout``
(:func:`~.http_client.request_client`; TRL's own client, used on CUDA, retries and sets no read timeout); with several
servers each request goes to the least-loaded one (:class:`~.fleet.ServerFleet`). A seeded call with several prompts
is one request per prompt, each with a seed of its own (:mod:`.seeding`): vLLM gives every prompt of one request the
same seed, so a group's members, or continued prefixes that agree, would be sampled identically.
"""

from __future__ import annotations

from typing import Any

from .seeding import mixed_seed


class VLLMServerBackend:
    """:class:`~.contract.GenerationBackend` over the vLLM server(s) of ``trainer.vllm_generation``."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._client = None  # the requests client (made at the first request)

    @property
    def _vllm(self):
        return self._trainer.vllm_generation

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None
                 ) -> dict[str, list]:
        """With ``seed``, or a ``seed`` in ``generation_kwargs`` (then mixed with ``seed``), the sampling is
        reproducible and every sequence draws its own random numbers (see the module doc)."""
        vllm = self._vllm
        kwargs = dict(vllm.generation_kwargs or {})
        if seed is not None:
            user_seed = kwargs.get("seed")
            kwargs["seed"] = seed if user_seed is None else mixed_seed(user_seed, seed)
        output = self._requests().generate(
            prompts=prompts, n=n, repetition_penalty=vllm.repetition_penalty, temperature=vllm.temperature,
            top_p=vllm.top_p, top_k=vllm.top_k, min_p=0.0 if vllm.min_p is None else vllm.min_p,
            max_tokens=max_tokens, logprobs=0, structured_outputs_regex=vllm.structured_outputs_regex,
            generation_kwargs=kwargs,
        )
        logps = [[float("nan") if lp[0] is None else float(lp[0]) for lp in seq] for seq in output["logprobs"]]
        return {"completion_ids": output["completion_ids"], "logps": logps}

    def _requests(self):
        if self._client is None:
            from .http_client import request_client

            self._client = request_client(self._vllm.vllm_client, self._vllm.server_timeout)
        return self._client

    def requests_answered(self) -> int:
        counter = getattr(self._client, "requests", None)  # a client of bapo_trl's counts them
        return 0 if counter is None else counter.answered

    def push_weights(self) -> None:
        """TRL's weight sync (NCCL on CUDA, the disk push without)."""
        self._vllm.sync_weights()

    def gather_weights(self) -> Any:
        """On the main process the write to the weight directory starts at once, on the sync's writer thread, so the
        push applied later only has the servers load them. ``None`` where only TRL's synchronous push exists (NCCL on
        CUDA streams the gathered tensors straight to the server)."""
        vllm = self._vllm
        if not getattr(vllm, "uses_disk_sync", False):
            return None
        state = vllm.gather_state()
        sync = vllm.disk_sync  # the main process's
        return sync.write_later(state) if sync is not None else state

    def send_weights(self, state: Any) -> None:
        self._vllm.disk_sync.load(state)

    def close(self) -> None:
        """The requests client stays (the next run's first request reuses its connections)."""
