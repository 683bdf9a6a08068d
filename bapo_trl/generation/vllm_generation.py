"""TRL's vLLM backend, :class:`BAPOVLLMGeneration`, built by TRL in place of its own ``VLLMGeneration`` while
``BAPOTrainer`` is constructed (:mod:`bapo_trl.trainer.vllm_backend`, through :mod:`.trl_patches`, which holds every
swap of a TRL name): it defers to TRL's code wherever TRL's path works, and takes over where it does not.

* Server mode on a machine without CUDA: TRL's server mode opens vLLM's NCCL weight-transfer group, which refuses any
  non-CUDA device. Here the client is :class:`~.http_client.HTTPVLLMClient` and weights go through a directory the
  server reloads (:class:`~.weight_sync.DiskWeightSync`); generation, the importance-sampling correction and the
  sync schedule stay TRL's code.
* A LoRA (peft) run with ``vllm_lora_sync="adapter"``: only the adapter is pushed (:mod:`.adapter_sync`), in server
  mode (CUDA too) and in colocate mode (the in-process engine loads it), the base weights once.
* Colocate mode without CUDA: TRL's per-tensor ``load_weights`` fails where vLLM re-packs its linear layers (AMX);
  the in-process engine reloads a safetensors directory instead, as the server.
* A user ``seed`` in ``generation_kwargs``: every prompt row gets a seed of its own, per process group, step and call
  (:mod:`.seeding`).
* A merged LoRA push (TRL's, ``vllm_lora_sync="merged"``): the base weights are put back bit for bit after TRL's
  in-place unmerge (:func:`.gather.exact_unmerge`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import requests
from transformers.utils import logging
from trl.generation.vllm_generation import VLLMGeneration, is_peft_model

from .adapter_sync import LORA_RANKS, tied_embedding_refusal
from .fleet import one_client, server_urls
from .gather import adapter_shapes
from .http_client import (
    FailureSharingClient,
    HTTPVLLMClient,
    KeyedVLLMClient,
    VLLMLogprobsModeError,
    VLLMServerUnreachable,
    check_logprobs_mode,
)
from .lora_push import LoRAPushMixin
from .processes import broadcast_from_main, raise_everywhere, raise_if_any, raised_on_every_process
from .seeding import mixed_seed, seed_salt
from .trl_patches import building_engine, building_server_client, seeded_engine
from .trl_push import TRLPushMixin
from .weight_sync import SERVE_HINT, DiskWeightSync, WeightSyncError

logger = logging.get_logger(__name__)

class BAPOVLLMGeneration(TRLPushMixin, LoRAPushMixin, VLLMGeneration):
    """TRL's vLLM backend, built by TRL in place of its own (:func:`.trl_patches.building_generation`): TRL's code
    wherever TRL's path works; on a non-CUDA device in server mode, HTTP and weights through disk; see the module doc
    for the rest (LoRA, colocate, seeds)."""

    disk_sync: DiskWeightSync | None = None
    #: What training does with the sampler's log-probs (:func:`bapo_trl.rollout.settings.sampler_logprobs_use`); None:
    #: no check of the servers.
    sampler_logprobs_use: str | None = None

    def __init__(self, *args, lora_sync: str, sampler_logprobs_use: str | None = None,
                 seed_round: Callable[[], int] | None = None, **kwargs):
        self.sampler_logprobs_use = sampler_logprobs_use  # TRL's __init__ ends with _init_vllm, which checks it
        # ``"adapter"``: a peft model pushes its LoRA adapter only (:mod:`.adapter_sync`); ``"merged"``: TRL's merged
        # full push (BAPOConfig.vllm_lora_sync, its one default)
        self.lora_sync = lora_sync
        self.seed_round = seed_round  # the trainer's optimizer step: a user seed's calls differ from step to step
        self._round_calls = (None, 0)  # (the step, generate calls made in it)
        self._pushes: list[tuple[int, float]] = []  # colocate reloads: (bytes, seconds), until taken
        super().__init__(*args, **kwargs)

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's generation; with a ``seed`` in ``generation_kwargs``, every prompt row's seed is derived from it, the
        optimizer step, the call's index in that step and, in colocate mode, this process's engine group (TRL spreads
        a group's members over processes, which would otherwise hold the same prompts and seeds and sample copies;
        the ranks of one tensor-parallel engine share a group, and must share seeds)."""
        self._reload_restarted_servers(everywhere=True)
        seeded = contextlib.nullcontext()
        if (self.generation_kwargs or {}).get("seed") is not None:
            step = self.seed_round() if self.seed_round is not None else 0
            last, calls = self._round_calls
            calls = calls + 1 if step == last else 0
            self._round_calls = (step, calls)
            group = self.accelerator.process_index // self.tensor_parallel_size if self.mode == "colocate" else 0
            seeded = seed_salt(step, calls, group)
        with seeded, self._requests_failing_everywhere() as failed:
            try:
                return super().generate(prompts, images, num_generations, profiler)
            except RuntimeError:
                if failed:  # the main process: its own error, not the sentinel's
                    raise failed[0] from None
                raise

    def _place_features(self, features, prompt_ids):
        """TRL's, except that inside :meth:`_requests_failing_everywhere` its error (a prompt whose runs of image
        tokens do not match its images) goes to the failure-sharing client, whose generate call then answers the
        failure for TRL to broadcast: raised here, on the main process alone, it left the others in the broadcast."""
        try:
            return super()._place_features(features, prompt_ids)
        except Exception as exc:  # noqa: BLE001 - shared with every process by the generate call after it
            if not isinstance(self.vllm_client, FailureSharingClient):
                raise
            self.vllm_client.failed.append(exc)
            return None

    @contextlib.contextmanager
    def _requests_failing_everywhere(self):
        """Server mode with several processes: TRL's main process sends the request and broadcasts the answer, so a
        request that failed there (the server gone, stalled) left the others waiting in the broadcast. Inside TRL's
        generate the main process's client is a :class:`~.http_client.FailureSharingClient`; yields its failures."""
        if self.mode != "server" or self.accelerator.num_processes == 1 or not self.accelerator.is_main_process:
            yield []
            return
        client = self.vllm_client
        self.vllm_client = FailureSharingClient(client)
        try:
            yield self.vllm_client.failed
        finally:
            self.vllm_client = client

    @property
    def uses_adapter_sync(self) -> bool:
        """Server mode with a peft model and ``vllm_lora_sync="adapter"``: only the adapter is pushed (through the
        disk on CUDA too: an adapter is small enough for a shared directory)."""
        return self.mode == "server" and self.lora_sync == "adapter" and is_peft_model(self.model)

    @property
    def uses_colocate_adapter(self) -> bool:
        """Colocate mode with a peft model and ``vllm_lora_sync="adapter"``: the in-process engine loads each push's
        adapter (``add_lora``) and generates with it (a ``lora_request``), its base weights loaded once. Not with
        vLLM's sleep mode, whose wake-up belongs to TRL's own push (that case pushes merged weights, TRL's way)."""
        return (self.mode == "colocate" and self.lora_sync == "adapter" and is_peft_model(self.model)
                and not getattr(self, "enable_sleep_mode", False))

    @property
    def uses_disk_sync(self) -> bool:
        return self.mode == "server" and (self.accelerator.device.type != "cuda" or self.uses_adapter_sync)

    @property
    def uses_colocate_reload(self) -> bool:
        """Colocate mode without CUDA: TRL loads each tensor through the layers' ``weight_loader``, which vLLM's CPU
        backend drops from layers it re-packs for its GEMM kernels (seen on AMX CPUs: ``'Parameter' object has no
        attribute 'weight_loader'``). The in-process engine reloads a safetensors directory instead, as the server
        does."""
        return self.mode == "colocate" and self.accelerator.device.type != "cuda"

    @property
    def server_urls(self) -> list[str]:
        """Every server of ``vllm_server_base_url`` (or the one at ``vllm_server_host:vllm_server_port``)."""
        return server_urls(self.server_base_url) or [f"http://{self.server_host}:{self.server_port}"]

    def _init_vllm(self):
        model = getattr(self, "model", None)  # TRL's __init__ sets it before it calls this
        merged = model is not None and is_peft_model(model) and not (self.uses_adapter_sync or
                                                                     self.uses_colocate_adapter)
        refusal = tied_embedding_refusal(model) if merged else None
        if refusal:  # before any server or engine is reached; the same on every process
            raise ValueError(f"This peft model's weights are pushed merged (vllm_lora_sync='merged', a peft config "
                             f"the adapter push cannot serve, or colocate with vLLM's sleep mode), and {refusal}. "
                             "Push the adapter (vllm_lora_sync='adapter', LoRA on the embedding or lm_head), or leave "
                             "the tied embedding out of the adapter (target_modules, modules_to_save).")
        if self.mode == "server" and not self.uses_disk_sync:  # CUDA: TRL's code and NCCL, its client sends the key
            with building_server_client(self._cuda_client):
                super()._init_vllm()
            if self.sampler_logprobs_use is not None:  # the same on every process: all join the broadcast
                error = None
                if self.accelerator.is_main_process:  # TRL builds the client there only
                    try:
                        self._check_logprobs_mode()
                    except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                        error = exc
                self._raise_everywhere(error)
            return
        if not self.uses_disk_sync:  # colocate: TRL's code; its engine gives each prompt of a seeded call its own seed
            if self.uses_colocate_adapter:  # the engine serves LoRA adapters (one at a time)
                config = self._adapter_config()
                rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
                with building_engine(enable_lora=True, max_loras=1,
                                     max_lora_rank=next(r for r in LORA_RANKS if r >= rank)):
                    super()._init_vllm()
            else:
                super()._init_vllm()
            if self.mode == "colocate":
                seeded_engine(self)
            return
        error = None
        if self.accelerator.is_main_process:
            try:
                clients = [HTTPVLLMClient(base_url=url, group_port=self.group_port,
                                          connection_timeout=self.server_timeout, request_timeout=self.server_timeout)
                           for url in self.server_urls]
                self.vllm_client = one_client(clients)
                self._check_logprobs_mode()  # before anything is written or generated
            except requests.ConnectionError as exc:
                error = VLLMServerUnreachable(f"{exc} On a machine without CUDA, {SERVE_HINT}.")
                error.__cause__ = exc
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                error = exc
            else:
                config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
                urls = [client.base_url for client in clients]
                tied = bool(getattr(config, "tie_word_embeddings", False))
                try:
                    if self.uses_adapter_sync:
                        self.disk_sync = self._adapter_sync(urls, tied)
                    else:
                        self.disk_sync = DiskWeightSync(urls, timeout=self.server_timeout, refresh_output_layers=tied,
                                                        mark_weights=True)
                    self.disk_sync.on_restart = self._on_server_restart
                    # the server must read the directory the weights go to (another machine: a shared mount)
                    self.disk_sync.check_shared_directory()
                    if self.uses_adapter_sync:  # and take the run's adapters (--enable-lora, rank)
                        self.disk_sync.check_adapter_support(adapter_shapes(self.model))
                except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                    error = exc
        self._raise_everywhere(error)
        self.accelerator.wait_for_everyone()

    def _check_logprobs_mode(self) -> None:
        """Main process: every server must report ``processed_logprobs`` where training uses the sampler's
        log-probs (:func:`check_logprobs_mode`)."""
        if self.sampler_logprobs_use is not None:
            check_logprobs_mode(self.vllm_client, self.sampler_logprobs_use)

    def _cuda_client(self, base_url, group_port=51216, connection_timeout=0.0, **kwargs):
        """What TRL's server mode builds as its client on CUDA: TRL's own (sending the API key) for one server; for
        several, a :class:`~.fleet.ServerFleet` of them, each with a weight-transfer group on a port of its own
        (``vllm_group_port`` + its index). Never run here (no CUDA on the machines this was built on)."""
        urls = server_urls(base_url)
        clients = [KeyedVLLMClient(base_url=url, group_port=group_port + index, connection_timeout=connection_timeout,
                                   **kwargs) for index, url in enumerate(urls)]
        return one_client(clients)

    def sync_weights(self):
        if self.uses_colocate_adapter or self.uses_colocate_reload:  # each process's engine: raised on every process
            with raised_on_every_process(self.accelerator.num_processes, "pushing the weights"):
                self._load_colocated_adapter() if self.uses_colocate_adapter else self._reload_colocated()
            return
        if not self.uses_disk_sync:
            return self._sync_through_trl()
        state = self.gather_state()
        error = None
        if self.accelerator.is_main_process:
            try:
                self.disk_sync.push(state)
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                error = exc
        self._raise_everywhere(error)

    def gather_state(self) -> dict:
        """The current weights as CPU copies on the main process (empty elsewhere); every process must call it, the
        gather is collective under ZeRO-3. With :attr:`disk_sync` they can be pushed later, from another thread.
        With the adapter push, only the adapter (:meth:`gather_adapter`). A copy that fails on the main process is
        raised on every process after the walk (they gather each weight with it)."""
        processes = self.accelerator.num_processes
        if self.uses_adapter_sync:
            with raised_on_every_process(processes, "gathering the adapter"):
                state = self.gather_adapter()
            return state
        state, error = self._walk_copies(self.accelerator.is_main_process)
        raise_if_any(error, processes, "gathering the weights")
        return state

    # -- the generation contract (bapo_trl.generation.contract), for async generation ------------------------------

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int | None = None) -> dict[str, list]:
        """:meth:`GenerationBackend.sample <.contract.GenerationBackend.sample>` over the vLLM server(s), any thread,
        with the run's sampling settings. Requests go through a client that sends each request once and bounds it by
        ``vllm_server_timeout`` (:func:`~.http_client.request_client`; TRL's own client, used on CUDA, retries and
        sets no read timeout); with several servers each request goes to the least-loaded one. With ``seed``, or a
        ``seed`` in ``generation_kwargs`` (then mixed with ``seed``), the sampling is reproducible, and a call with
        several prompts is one request per prompt, each with a seed of its own (:mod:`.seeding`): vLLM gives every
        prompt of one request the same seed, so a group's members would be sampled identically."""
        self._reload_restarted_servers(everywhere=False)
        kwargs = dict(self.generation_kwargs or {})
        if seed is not None:
            user_seed = kwargs.get("seed")
            kwargs["seed"] = seed if user_seed is None else mixed_seed(user_seed, seed)
        output = self._requests().generate(
            prompts=prompts, n=n, repetition_penalty=self.repetition_penalty, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max_tokens, logprobs=0, structured_outputs_regex=self.structured_outputs_regex,
            generation_kwargs=kwargs,
        )
        logps = [[float("nan") if lp[0] is None else float(lp[0]) for lp in seq] for seq in output["logprobs"]]
        return {"completion_ids": output["completion_ids"], "logps": logps}

    def _reload_restarted_servers(self, everywhere: bool) -> None:
        """Before requests, full-weight disk pushes: a server that does not hold the last push (restarted, or a push
        failed there) loads it again (:meth:`.weight_sync.DiskWeightSync.reload_if_restarted`, main process).
        ``everywhere`` (TRL's generate, which every process calls): an error there is raised on every process (one
        broadcast). The adapter push finds such a server from its requests' answers; TRL's NCCL push (CUDA) is not
        checked."""
        if everywhere:
            if not self.uses_disk_sync or self.uses_adapter_sync:  # the same on every process
                return
        elif self.disk_sync is None or self.uses_adapter_sync:
            return
        error = None
        if self.disk_sync is not None:  # the main process's
            try:
                self.disk_sync.reload_if_restarted()
            except Exception as exc:  # noqa: BLE001 - raised below
                error = exc
        if everywhere:
            self._raise_everywhere(error)
        elif error is not None:
            raise error

    def _on_server_restart(self, url: str) -> None:
        """A server found restarted (or not holding the last push), before it loads weights again, wherever it was
        found (before a request, in a push, by the adapter push's requests): a warning, and its ``--logprobs-mode``
        checked again (restarted with vLLM's default, its log-probs would be taken before temperature). A check that
        fails leaves the server as found: it is checked again, and refused again, at the next push or request."""
        logger.warning(f"BAPO: the vLLM server at {url} did not hold the last pushed weights (it restarted, or a push "
                       "failed there): it loads them again before sampling.")
        if self.sampler_logprobs_use is not None:
            for client in getattr(self.vllm_client, "clients", [self.vllm_client]):
                if client.base_url.rstrip("/") == url:
                    check_logprobs_mode(client, self.sampler_logprobs_use)

    def _requests(self):
        """The requests client over ``vllm_client`` (made at the first request, kept for later runs)."""
        if getattr(self, "_request_client", None) is None:
            from .http_client import request_client

            self._request_client = request_client(self.vllm_client, self.server_timeout)
        return self._request_client

    def requests_answered(self) -> int:
        counter = getattr(getattr(self, "_request_client", None), "requests", None)  # bapo_trl's client counts them
        return 0 if counter is None else counter.answered

    def push_weights(self) -> None:
        """TRL's weight sync (NCCL on CUDA, the disk push without)."""
        self.sync_weights()

    def gather_weights(self):
        """Every process: the current weights for a push applied later (:meth:`send_weights`); on the main process
        the write to the weight directory starts at once, on the sync's writer thread, so the push applied later only
        has the servers load them. ``None`` where only TRL's synchronous push exists (NCCL on CUDA streams the
        gathered tensors straight to the server)."""
        if not self.uses_disk_sync:
            return None
        state = self.gather_state()
        return self.disk_sync.write_later(state) if self.disk_sync is not None else state  # main: its disk_sync

    def send_weights(self, state) -> None:
        self.disk_sync.load(state)

    def close(self) -> None:
        """The requests client stays (the next run's first request reuses its connections); the weight directories
        go with the trainer's end of run (:meth:`bapo_trl.trainer.vllm_backend.VLLMGenerationMixin`)."""

    def take_pushes(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` of every push since the last call (main process; logged by the trainer)."""
        pushes, self._pushes = self._pushes, []
        if self.disk_sync is not None:
            pushes += self.disk_sync.take_pushes()
        return pushes

    def _raise_everywhere(self, error: Exception | None) -> None:
        """An error on the main process is raised on every process, so no rank waits forever in a collective."""
        processes = self.accelerator.num_processes
        raise_everywhere(error, processes, partial(broadcast_from_main, num_processes=processes),
                         "on the main process",
                         kinds={"WeightSyncError": WeightSyncError, "VLLMLogprobsModeError": VLLMLogprobsModeError},
                         default=ConnectionError)


def trainer_vllm_backend(trainer) -> BAPOVLLMGeneration:
    """The ``"vllm"`` generation backend (:mod:`.contract`): the trainer's own vLLM backend, which TRL built as
    :class:`BAPOVLLMGeneration` (server mode)."""
    backend = getattr(trainer, "vllm_generation", None)
    if not isinstance(backend, BAPOVLLMGeneration):
        raise ValueError("generation_backend='vllm' generates in the vLLM server(s) the trainer was built with: set "
                         "use_vllm=True, vllm_mode='server' (or name a generation backend of your own).")
    return backend
