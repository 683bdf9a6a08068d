"""Gathering what a weight push sends, on every process (collective under DeepSpeed ZeRO-3 and FSDP2), as CPU copies
on the process that writes it: a LoRA adapter's tensors under peft's saved names, and the base model's weights under
vLLM's names.

Why here, apart from the backend: an adapter push gathers only the adapter's parameters, and a sharded parameter must
be whole before it is written (ZeRO-3 gathers around the copy; an FSDP2 shard is a DTensor, gathered by
:func:`full`), so every gather of the package goes through these few functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


def full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: an FSDP2 shard (a DTensor) gathered from every process (collective: every process
    calls it, in the same order), anything else as it is (ZeRO-3's are gathered around it)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor().detach() if isinstance(param, DTensor) else param.detach()


def adapter_parameters(model, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters of peft adapter ``adapter``: a name part is the adapter's name and another a LoRA
    tensor's (``lora_A``, ``lora_embedding_B``, ...): a linear layer's ``lora_A.<adapter>.weight``, an embedding's
    ``lora_embedding_A.<adapter>`` (no trailing part), whatever ``target_modules`` names."""
    found = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        if adapter in parts and any(part.startswith("lora_") for part in parts):
            found.append((name, param))
    return found


def adapter_shapes(model) -> dict[str, tuple[int, ...]]:
    """The active adapter's tensors as peft saves them: name -> full shape (ZeRO-3 keeps it in ``ds_shape``)."""
    from peft import get_peft_model_state_dict

    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in adapter_parameters(model,
                                                                                            model.active_adapter)}
    saved = get_peft_model_state_dict(model, state_dict={n: torch.empty(0) for n in shapes},
                                      adapter_name=model.active_adapter, save_embedding_layers=False)
    if len(saved) != len(shapes):
        raise ValueError("vllm_lora_sync='adapter': peft's saved names of this adapter do not match its parameters "
                         "one to one; set vllm_lora_sync='merged'.")
    return dict(zip(saved, shapes.values()))


class CpuCopies:
    """CPU copies of gathered tensors where ``keep``. A copy that fails (host memory) stops the copies, not the
    gathers: the other processes gather each parameter with this one (collective under ZeRO-3 and FSDP2), so the error
    is raised once every gather is done (:meth:`raise_failure`), for the caller to raise on every process."""

    def __init__(self, keep: bool):
        self.keep, self.error = keep, None

    def __call__(self, into: dict, name: str, tensor) -> None:
        if self.keep and self.error is None:
            try:
                into[name] = tensor.detach().to("cpu", copy=True)
            except Exception as exc:  # noqa: BLE001 - raised by raise_failure, after the gathers
                into.clear()
                self.error = exc

    def raise_failure(self) -> None:
        if self.error is not None:
            raise self.error


def gathered_adapter(model, dist, keep: bool) -> dict:
    """The active adapter under peft's saved names, CPU copies where ``keep`` (empty elsewhere); peft's copy of the
    base embeddings left out (the base goes with the base push). Every process calls it (``dist``: TRL's
    ``DistributedBackend``; the gather, over the adapter's parameters only, is collective)."""
    from peft import get_peft_model_state_dict

    named = adapter_parameters(model, model.active_adapter)
    state, copy = {}, CpuCopies(keep)
    with dist.gather_params([p for _, p in named]):
        for name, param in named:
            copy(state, name, full(param))  # gathered on every process
    copy.raise_failure()
    if not keep:
        return {}
    return get_peft_model_state_dict(model, state_dict=state, adapter_name=model.active_adapter,
                                     save_embedding_layers=False)


def gathered_base(model, dist, vllm_name: Callable[[str], str], keep: bool) -> dict:
    """A peft model's base weights under vLLM's names (``vllm_name`` of the peft name without its wrapping; adapter
    layers skipped, nothing merged), one parameter gathered at a time; CPU copies where ``keep``. Every process calls
    it."""
    base, copy = {}, CpuCopies(keep)
    for name, param in model.named_parameters():
        if model.prefix in name or "original_module" in name:
            continue
        with dist.gather_params([param]):
            copy(base, vllm_name(name.removeprefix("base_model.model.").replace(".base_layer", "")), full(param))
    copy.raise_failure()
    return base


@contextlib.contextmanager
def exact_unmerge(model) -> Iterator[None]:
    """While it is open, a peft ``model``'s ``unmerge_adapter`` puts back, bit for bit, the base weights its
    ``merge_adapter`` merged into. Why: TRL's merged push merges the adapter in place and unmerges it after; in
    bfloat16 ``W + BA - BA`` is not ``W``, so every push moved the frozen base (huggingface/trl#6688). The weights are
    copied to the CPU at the merge (the push reads the whole model then anyway; the cost is one host copy of the
    targeted base tensors on each process during a push), inside TRL's gather. Under ZeRO-3 that gather
    (``modifier_rank=None``) discards what changed inside it anyway, except in the small parameters DeepSpeed keeps
    whole on every process: the copy restores those.

    A walk closed between the merge and the unmerge (an exception or Ctrl-C while pushing, then training goes on with
    the same object) leaves nothing merged: the context's exit puts the saved base back and clears peft's merged
    flags. Without that the adapter stayed merged AND active (counted twice), and the next push saved the merged
    weights as the base. A model found already merged at a merge (merged by other code) is unmerged first, as peft
    unmerges."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    merge, unmerge = model.merge_adapter, model.unmerge_adapter
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]

    def merge_keeping_the_base(*args, **kwargs):
        if any(layer.merged for layer in layers):
            unmerge()  # merged elsewhere: peft's own unmerge first, so the saved base holds no adapter
        saved.clear()
        for layer in layers:
            saved.extend((p, p.data.to("cpu", copy=True)) for p in layer.get_base_layer().parameters(recurse=False))
        result = merge(*args, **kwargs)
        synchronize()
        return result

    def synchronize() -> None:
        """On CUDA, every stream waits for what is queued: vLLM's packed transfer reads the walk's tensors on streams
        of its own, which nothing orders after the merge's kernels, nor the unmerge after their reads."""
        if any(param.is_cuda for param, _ in saved):
            torch.cuda.synchronize()

    def restore_the_base() -> None:
        for param, value in saved:
            if param.data.shape == value.shape:  # a ZeRO-3 shard outside its gather kept its unmerged values
                param.data.copy_(value)
        saved.clear()

    def unmerge_restoring_the_base(*args, **kwargs):
        synchronize()
        result = unmerge(*args, **kwargs)
        restore_the_base()
        return result

    model.merge_adapter, model.unmerge_adapter = merge_keeping_the_base, unmerge_restoring_the_base
    try:
        yield
    finally:
        del model.merge_adapter, model.unmerge_adapter  # the class's methods again
        if saved:  # closed between the merge and the unmerge: the base as it was, nothing merged
            restore_the_base()
            for layer in layers:
                layer.merged_adapters = []
