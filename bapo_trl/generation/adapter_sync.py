"""A LoRA run's weight push: only the adapter, as peft saves it, loaded by every vLLM server under a fresh name.

Why: TRL merges the adapter into the base weights and pushes the whole model at every sync (under ZeRO-3 every rank
first gathers every parameter). A LoRA run's base weights never change; its adapter is usually well under 1% of the
model. vLLM serves LoRA adapters natively (``--enable-lora``; ``POST /v1/load_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; a request names its adapter in ``model``), on CPU too.

How a push goes (:class:`AdapterSync`, the disk path's client with another payload):

* the first push of a client also writes the trainer's base weights and has every server reload them (vLLM's
  ``reload_weights``, under LoRA as without): a server started from another checkpoint (another revision, dtype or
  fine-tune) would otherwise apply the adapter to the wrong base, silently. That directory is kept until the client
  closes: a server found without the adapter it was given last has restarted (from its own checkpoint) and reloads
  it before the new adapter;
* every push writes ``adapter_config.json`` and ``adapter_model.safetensors`` to a fresh directory, every server loads
  it under a fresh name (the directory's), and only then the name it replaces is unloaded and generation requests
  name the new adapter. Pushes and requests are ordered by the rollout sources as for a full push, so a request names
  exactly the adapter of the weights it was queued after, and a stale name, once unloaded, would be refused by the
  server (404) rather than used;
* a server without runtime LoRA loading, without ``--enable-lora`` or with a smaller ``--max-lora-rank`` is found by
  :meth:`AdapterSync.check_adapter_support` at start-up (a zero adapter of the run's shapes is loaded and unloaded),
  with the flag to add.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from .resend import lost_before_answer
from .weight_files import write_weights
from .weight_sync import DiskWeightSync, WeightSyncError

#: The environment variable vLLM reads before it exposes ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: The ``bapo serve`` flag that starts a server ready for adapter pushes.
SERVE_LORA_HINT = "start it with `bapo serve MODEL --lora-rank R` (R >= the adapter's rank)"
#: The ranks vLLM accepts as ``max_lora_rank`` (vllm/config/lora.py, 0.32): an adapter's rank is rounded up to one.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's endpoints that load and unload an adapter at run time.
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
#: The ``vllm_lora_sync`` values: the adapter alone (peft models in server mode), or TRL's merged full push.
LORA_SYNC_MODES = ("adapter", "merged")


def adapter_refusal(peft_config) -> str | None:
    """Why vLLM cannot serve this peft adapter as it trains (so the merged push must be used), or None."""
    peft_type = str(getattr(peft_config, "peft_type", "")).rsplit(".", 1)[-1].upper()
    if peft_type != "LORA":
        return f"it is a {peft_type or type(peft_config).__name__} adapter (vLLM serves LoRA adapters only)"
    checks = [
        (getattr(peft_config, "use_dora", False), "it uses DoRA (`use_dora=True`), which vLLM does not serve"),
        (getattr(peft_config, "modules_to_save", None), "it trains whole modules beside the adapter "
         f"(`modules_to_save={getattr(peft_config, 'modules_to_save', None)}`), which vLLM's LoRA does not load"),
        (getattr(peft_config, "bias", "none") != "none",
         f"it trains biases (`bias={getattr(peft_config, 'bias', '')!r}`)"),
        (getattr(peft_config, "lora_bias", False), "it trains a LoRA bias (`lora_bias=True`)"),
        (getattr(peft_config, "trainable_token_indices", None), "it trains token embeddings "
         "(`trainable_token_indices`)"),
        (getattr(peft_config, "target_parameters", None), "it targets parameters (`target_parameters`)"),
        (getattr(peft_config, "layer_replication", None), "it replicates layers (`layer_replication`)"),
        (getattr(peft_config, "alora_invocation_tokens", None), "it is an activated LoRA (aLoRA)"),
    ]
    for failed, why in checks:
        if failed:
            return why
    return None


def tied_embedding_refusal(model) -> str | None:
    """Why the merged full push cannot give the sampler this peft model, or None: its base ties the output embedding
    (``lm_head``) to the input one, and the adapter wraps one of the two (LoRA on it, or ``modules_to_save``). TRL's
    walk then sends the tied pair as one tensor (the input embedding's name), with the adapter merged into it or not
    at all, and vLLM ties its head to that tensor (it skips a separate ``lm_head.weight``): the sampler's embedding and
    head are not the trainer's. The adapter push keeps them apart."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if not getattr(config, "tie_word_embeddings", False):
        return None
    names = {id(module): name for name, module in base.named_modules()}
    wrapped = [names.get(id(module), "?") for module in (base.get_input_embeddings(), base.get_output_embeddings())
               if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))]
    if not wrapped:
        return None
    return (f"the model ties its output embedding to its input embedding (`tie_word_embeddings=True`) and the adapter "
            f"wraps {' and '.join(f'`{n}`' for n in wrapped)} (LoRA on it, or `modules_to_save`): a merged push sends "
            "the tied pair as one tensor and the sampler would not run the trainer's model")


def write_adapter(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], config: dict,
                  root: str | None, prefix: str, on_created: Callable[[str], None] | None = None) -> str:
    """Write an adapter as peft saves it (``adapter_config.json``, ``adapter_model.safetensors``; ``tensors`` under
    peft's saved names) in a new directory under ``root``; returns the directory."""
    from safetensors.torch import save_file

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    state = {name: t.detach().to("cpu").contiguous() for name, t in items}
    directory = tempfile.mkdtemp(prefix=prefix, dir=root or os.environ.get("BAPO_VLLM_WEIGHTS_DIR") or None)
    if on_created is not None:
        on_created(directory)
    try:
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:  # sets as lists, as peft writes them
            json.dump({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}, f, indent=2,
                      sort_keys=True, default=str)
        save_file(state, os.path.join(directory, "adapter_model.safetensors"))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


class AdapterPush(dict):
    """The gathered tensors of an adapter push (peft's saved names), with the base weights on a client's first push
    (``base``: vLLM checkpoint names, or None)."""

    def __init__(self, adapter: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None = None):
        super().__init__(adapter)
        self.base = base


class AdapterSync(DiskWeightSync):
    """:class:`~.weight_sync.DiskWeightSync` for a LoRA run: pushes the adapter (see the module doc).

    Args:
        base_url, timeout, root, refresh_output_layers: as for :class:`~.weight_sync.DiskWeightSync` (the base weights
            of the first push go through its reload).
        adapter_config: the adapter's ``adapter_config.json`` (peft's ``LoraConfig.to_dict()``).
        on_switch: called with the new adapter name once every server has loaded it and before the old name is
            unloaded: the generation clients name it in their requests from then on.
    """

    def __init__(self, base_url: str | Sequence[str], adapter_config: dict, on_switch: Callable[[str], None],
                 timeout: float = 240.0, root: str | None = None, refresh_output_layers: bool = False):
        super().__init__(base_url, timeout=timeout, root=root, refresh_output_layers=refresh_output_layers)
        self.adapter_config = dict(adapter_config)
        self.on_switch = on_switch
        self.active_name: str | None = None  # the adapter every request names now
        self.loaded_names: list[str] = []  # every adapter loaded, in push order (what a test or a log reads)
        self.base_pushed = False
        self._base_dir: str | None = None  # the base weights as first pushed (they never change): a restarted server's
        # After close(): the servers hold no adapter of ours, so a restart between two runs cannot be seen from it;
        # the next run's first push reloads the base weights first pushed, whatever happened to the servers meanwhile.
        self.base_unknown = False
        self.base_loads = 0  # pushes that had every server reload the base weights (a restart's reload aside)
        self._restore_lock = threading.Lock()

    @staticmethod
    def adapter_name(directory: str) -> str:
        """The name an adapter directory is loaded under (unique per push: the directory is)."""
        return os.path.basename(directory.rstrip(os.sep))

    # -- writing --------------------------------------------------------------------------------------------------

    def _write_payload(self, tensors) -> str:
        """The adapter as peft saves it; on the first push also the base weights, in a ``base-*`` folder inside."""
        directory = write_adapter(tensors, self.adapter_config, self.root, "bapo-lora-", on_created=self._track)
        base = getattr(tensors, "base", None)
        if base is not None:
            try:
                write_weights(base, directory, "base-", handed_over=True)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
        return directory

    # -- loading --------------------------------------------------------------------------------------------------

    def _load(self, base_url: str, directory: str) -> None:
        """One server: reload the base weights when the push carries them, on the first push of a later run (the
        server may have restarted between the runs), or when the server no longer holds the adapter it was given last
        (it restarted, from its own checkpoint: the base pushed first is loaded again), then load the adapter."""
        bases = [os.path.join(directory, d) for d in sorted(os.listdir(directory)) if d.startswith("base-")]
        if bases:
            super()._load(base_url, bases[0])
        elif self.base_unknown:
            super()._load(base_url, self._base_dir)
        elif self.active_name is not None and self.active_name not in self.served_adapters(base_url):
            self._found_restarted(base_url)
            super()._load(base_url, self._base_dir)
        self._lora_call(LOAD, "LoRA adapter push failed", base_url, self.adapter_name(directory),
                        {"lora_path": directory})

    def _after_load(self, directory: str) -> None:
        """Every server holds the new adapter: requests name it from now on, then the one it replaces is unloaded
        everywhere (a request naming it would now be refused, 404)."""
        old, self.active_name = self.active_name, self.adapter_name(directory)
        self.loaded_names.append(self.active_name)
        bases = [d for d in os.listdir(directory) if d.startswith("base-")]
        self.base_loads += self.base_unknown or bool(bases)
        self.base_unknown = False
        for base in bases:  # kept aside until close()
            kept = tempfile.mkdtemp(prefix="bapo-lora-base-", dir=self.root)
            os.replace(os.path.join(directory, base), kept)
            self._base_dir, self.base_pushed = kept, True
            weakref.finalize(self, shutil.rmtree, kept, ignore_errors=True)  # with the client, or at exit
        self.on_switch(self.active_name)
        if old is not None:
            self._on_every_server(lambda url: self._unload(url, old))

    def restore(self, base_url: str, name: str) -> bool:
        """A request named adapter ``name`` and the server answered that no such model exists. If ``name`` is the
        adapter in use and the server holds none of ours (it restarted), have it reload the base weights first pushed
        and load the adapter under the same name again; returns whether the request can go again. Any thread; one
        restore at a time (a seeded batch's requests all find the adapter gone at once)."""
        with self._restore_lock:
            if name != self.active_name or self._loaded is None or self._base_dir is None:
                return False
            if name in self.served_adapters(base_url):
                return True  # another request's restore did it
            self._found_restarted(base_url)
            DiskWeightSync._load(self, base_url, self._base_dir)
            self._lora_call(LOAD, "LoRA adapter restore failed", base_url, name, {"lora_path": self._loaded})
            return True

    def _unload(self, base_url: str, name: str) -> None:
        self._lora_call(UNLOAD, "LoRA adapter unload failed", base_url, name, {})

    def _lora_call(self, path: str, what: str, base_url: str, name: str, body: dict) -> None:
        """Load or unload adapter ``name`` on one server. A request lost before its answer (:mod:`.resend`) may have
        run: it is sent again only if the server's adapters (``/v1/models``) show that it did not."""
        try:
            self._post(path, what, base_url=base_url, json={"lora_name": name, **body})
        except WeightSyncError as exc:
            if path == UNLOAD and "cannot be found" in str(exc):
                return  # gone already (a restarted server holds none of this run's adapters)
            if not lost_before_answer(exc):
                raise
            if (name in self.served_adapters(base_url)) == (path == LOAD):
                return  # the lost request had run
            self._post(path, what, base_url=base_url, json={"lora_name": name, **body})

    def served_adapters(self, base_url: str) -> set[str]:
        """The names a server serves (``/v1/models``: the base model and every adapter loaded)."""
        response = self.sessions[base_url].get(f"{base_url}/v1/models", timeout=self.timeout)
        return {model["id"] for model in response.json().get("data", [])}

    def _post(self, path: str, what: str, json: dict | None = None, base_url: str | None = None):
        try:
            return super()._post(path, what, json=json, base_url=base_url)
        except WeightSyncError as exc:
            raise WeightSyncError(f"{exc}{adapter_hint(str(exc), path)}") from exc

    # -- start-up check ----------------------------------------------------------------------------------------

    def check_adapter_support(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Load a zero adapter of the run's shapes (peft's saved names) on every server and unload it: a server that
        cannot take the run's adapters fails here, before training, naming the flag to add. A server running several
        data-parallel engines is refused: a run-time adapter load reaches one of its engines only."""
        for url in self.base_urls:
            size = data_parallel_size(self.sessions[url], url, self.timeout)
            if size > 1:
                raise WeightSyncError(
                    f"the vLLM server at {url} runs {size} data-parallel engines (--data-parallel-size {size}): a "
                    "LoRA adapter loaded at run time reaches one of them only, and the others would go on sampling "
                    "with an older adapter or none. Set `vllm_lora_sync=\"merged\"` (a full push reaches every "
                    "engine), or start one server per engine and list them all in `vllm_server_base_url`.")
        zeros = {name: torch.zeros(tuple(shape)) for name, shape in shapes.items()}
        directory = write_adapter(zeros, self.adapter_config, self.root, "bapo-lora-probe-")
        name = self.adapter_name(directory)
        try:
            self._on_every_server(lambda url: self._lora_call(LOAD, "LoRA adapter check failed", url, name,
                                                              {"lora_path": directory}))
            self._on_every_server(lambda url: self._unload(url, name))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        """Unload the adapter this client loaded last from every server (best effort: a server already gone is not an
        error here), then remove every directory it wrote but the base weights' (kept while the client lives: a later
        run's first push reloads them)."""
        self.base_unknown = self._base_dir is not None
        if self.active_name is not None:
            name, self.active_name = self.active_name, None
            for url in self.base_urls:
                try:
                    self._unload(url, name)
                except WeightSyncError:
                    pass
        super().close()  # the base weights' directory stays for a later run's first push (removed at exit)


def data_parallel_size(session, base_url: str, timeout: float) -> int:
    """The data-parallel engines a vLLM server runs, from its ``/server_info`` (1 where it does not say)."""
    try:
        response = session.get(f"{base_url}/server_info", params={"config_format": "json"}, timeout=timeout)
        info = response.json() if response.status_code == 200 else {}
    except ValueError:
        return 1
    config = info.get("vllm_config", info) if isinstance(info, dict) else {}
    parallel = config.get("parallel_config") if isinstance(config, dict) else None
    return int(parallel.get("data_parallel_size") or 1) if isinstance(parallel, dict) else 1


def adapter_hint(message: str, path: str) -> str:
    """What to do about a failed adapter request, from vLLM's answer (empty when nothing specific applies)."""
    if "No adapter found" in message:  # the server cannot read the directory the trainer wrote
        return ("\nThe server cannot read the adapter directory: on another machine, set BAPO_VLLM_WEIGHTS_DIR to a "
                "directory both machines see at the same path (a shared mount), or set `vllm_lora_sync=\"merged\"` "
                "(TRL's merged push: NCCL on CUDA).")
    if "lora_adapter" in path and ("answered 404" in message and "Not Found" in message):
        return (f"\nThe server does not load LoRA adapters at run time: it needs {RUNTIME_LORA_ENV}=1 in its "
                f"environment and --enable-lora ({SERVE_LORA_HINT}), or set `vllm_lora_sync=\"merged\"` to push "
                "merged full weights.")
    if "expected target modules" in message or "expected target_modules" in message:
        return ("\nThis vLLM cannot serve a LoRA adapter on some of the adapter's modules for this model class (its "
                "answer lists them: embedding and output layers are served for some architectures only). Set "
                "`vllm_lora_sync=\"merged\"` to push merged full weights, or leave those modules out of "
                "`target_modules`.")
    if "LoRA is not enabled" in message:
        return f"\nThe server runs without --enable-lora: {SERVE_LORA_HINT}, or set `vllm_lora_sync=\"merged\"`."
    if "max_lora_rank" in message:
        return f"\nRestart the server with a larger --max-lora-rank: {SERVE_LORA_HINT}."
    return ""
