"""The pushes of :class:`~.vllm_generation.BAPOVLLMGeneration` that are not TRL's: a LoRA run's adapter alone
(``vllm_lora_sync="adapter"``: to the servers through :class:`~.adapter_sync.AdapterSync`, or into the colocated
engine, the base weights once), and the colocated engine's reload from a directory on a machine without CUDA. A
mixin of the backend, apart from its generation and its TRL plumbing: it reads the backend's model, accelerator,
engine and clients, and appends each push's ``(bytes, seconds)`` to ``_pushes``.
"""

from __future__ import annotations

import os
import shutil
import time
from functools import partial

from .adapter_sync import AdapterPush, AdapterSync, adapter_refusal, write_adapter
from .fleet import ServerFleet
from .gather import gathered_adapter, gathered_base
from .processes import broadcast_from_main
from .weight_files import directory_bytes, write_weights


class LoRAPushMixin:
    """The adapter push and the colocated reloads of the vLLM backend (module doc)."""

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

    def gather_adapter(self) -> AdapterPush | dict:
        """The adapter as peft saves it, CPU copies on the main process (empty elsewhere); on the pushes before the
        servers have loaded this trainer's base weights once, those too. Every process calls it (the gathers are
        collective under ZeRO-3, over the adapter's parameters only)."""
        main = self.accelerator.is_main_process
        need_base = broadcast_from_main(bool(main and not self.disk_sync.base_pushed),
                                        self.accelerator.num_processes)
        state, base = self._gathered_adapter_and_base(need_base)
        return AdapterPush(state, base) if main else {}

    def _gathered_adapter_and_base(self, need_base: bool, every_process: bool = False) -> tuple[dict, dict | None]:
        """:meth:`_gathered_adapter`, then :meth:`_gather_base` where ``need_base``, both made whole on this process
        whatever fails in the first (the other processes gather with it): a failed copy is raised after both."""
        error, state, base = None, {}, None
        try:
            state = self._gathered_adapter(every_process)
        except Exception as exc:  # noqa: BLE001 - raised below, once the base was gathered too
            error = exc
        if need_base:
            try:
                base = self._gather_base(every_process)
            except Exception as exc:  # noqa: BLE001 - raised below
                error = error or exc
        if error is not None:
            raise error
        return state, base

    def _gathered_adapter(self, every_process: bool = False) -> dict:
        """The active adapter under peft's saved names, CPU copies on the main process (``every_process``: on each;
        empty elsewhere). Every process calls it (:func:`.gather.gathered_adapter`)."""
        return gathered_adapter(self.model, self._dist, self.accelerator.is_main_process or every_process)

    def _load_colocated_adapter(self) -> None:
        """Every process (each has its own engine): gather the adapter (collective under ZeRO-3), write it, have the
        engine load it under a fresh id and generate with it from now on, then drop the one it replaces. The first
        time, the engine's base weights are reloaded from the trainer's (the engine was built from the checkpoint's
        path, the trainer's model may have been changed in memory)."""
        from vllm.lora.request import LoRARequest

        start, llm = time.perf_counter(), self.llm
        first = getattr(llm, "lora_request", None) is None  # the base weights too, once
        state, base_state = self._gathered_adapter_and_base(first, every_process=True)
        rank = self.accelerator.process_index
        written = 0
        if first:
            base = write_weights(base_state, None, f"bapo-vllm-colocate-base-rank{rank}-", handed_over=True)
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
        """The base model's weights under vLLM's names, CPU copies on the main process (``every_process``: on each).
        Every process calls it (:func:`.gather.gathered_base`)."""
        return gathered_base(self.model, self._dist, partial(self._fix_param_name_to_vllm,
                                                             extra_prefixes=["modules_to_save.default."]),
                             self.accelerator.is_main_process or every_process)

    def _reload_colocated(self) -> None:
        """Every process: gather the weights (collective under ZeRO-3), write them, and have this process's engine
        reload them (``reload_weights``, which re-packs the layers), refresh a tied head, reset the prefix cache. A
        failure on one process is raised on every process (:meth:`sync_weights`)."""
        start = time.perf_counter()
        state, error = self._walk_copies(keep=True)  # the walk made whole on every process, whatever fails here
        if error is not None:
            raise error
        directory = write_weights(state, None, f"bapo-vllm-colocate-rank{self.accelerator.process_index}-",
                                  handed_over=True)
        written = directory_bytes(directory)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
            self.llm.collective_rpc(refresh_output_layers)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._pushes.append((written, time.perf_counter() - start))



def refresh_output_layers(worker) -> int:
    """Run inside a vLLM worker (``LLM.collective_rpc``): the worker extension's refresh of tied vocabulary layers."""
    from .vllm_worker.bapo_vllm_worker import BAPOWorkerExtension

    return BAPOWorkerExtension.bapo_refresh_output_layers(worker)

