"""The directories a disk weight push writes for vLLM's ``reload_weights``: one ``model.safetensors`` each, written
without a second CPU copy of tensors handed over (:func:`writable`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping

import torch


def write_weights(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root: str | None,
                  prefix: str, on_created=None, handed_over: bool = False) -> str:
    """Write ``tensors`` (checkpoint names) as ``model.safetensors`` in a new directory under ``root`` (default
    ``$BAPO_VLLM_WEIGHTS_DIR`` or the temp dir), for vLLM's ``reload_weights``; returns the directory.
    ``on_created(directory)`` is called as soon as the directory exists (so its owner can remove it whatever happens).
    With ``handed_over`` the caller gives the tensors up (a push's gathered copies), and those safetensors can write
    as they are are not copied again (:func:`writable`); otherwise (live parameters) every one is copied first."""
    from safetensors.torch import save_file

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    if handed_over:
        state, _ = writable(items)
    else:  # own, contiguous CPU copies: safetensors refuses views and shared storage
        state = {name: t.detach().to("cpu").contiguous().clone() for name, t in items}
    directory = tempfile.mkdtemp(prefix=prefix, dir=root or os.environ.get("BAPO_VLLM_WEIGHTS_DIR") or None)
    if on_created is not None:
        on_created(directory)
    try:
        save_file(state, os.path.join(directory, "model.safetensors"))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def writable(items: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors handed over for writing, as safetensors writes them, and the names that had to be copied: a CPU tensor
    that owns its whole storage (as the gathered copies of a push do) is written as it is; a GPU tensor, a view or a
    tensor sharing its storage with an earlier one (tied weights) is copied. So a push of gathered weights holds one
    CPU copy of the model while it is written, not two."""
    state, copied, seen = {}, [], set()
    for name, tensor in items:
        tensor = tensor.detach()
        storage = tensor.untyped_storage() if tensor.device.type == "cpu" else None
        owns = (storage is not None and tensor.is_contiguous() and tensor.storage_offset() == 0
                and storage.nbytes() == tensor.numel() * tensor.element_size() and storage.data_ptr() not in seen)
        if owns:
            seen.add(storage.data_ptr())
        else:
            tensor = tensor.to("cpu").contiguous().clone()
            copied.append(name)
        state[name] = tensor
    return state, copied


def directory_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` (what a push wrote for the servers to read)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


def _remove_all(paths: list[str]) -> None:
    while paths:
        shutil.rmtree(paths.pop(), ignore_errors=True)


def not_shared_message(base_url: str, path: str, detail: str | None = None) -> str:
    """The error for a weight directory that the trainer wrote and the server cannot read."""
    root = os.environ.get("BAPO_VLLM_WEIGHTS_DIR")
    where = f"BAPO_VLLM_WEIGHTS_DIR={root}" if root else f"BAPO_VLLM_WEIGHTS_DIR is unset: {tempfile.gettempdir()}"
    return (f"the vLLM server at {base_url} cannot read {path}, which this trainer wrote"
            + (f" ({detail})" if detail else "") + f". The weight sync without CUDA passes weights through a "
            f"directory ({where}); when the server runs on another machine, set BAPO_VLLM_WEIGHTS_DIR to a directory "
            "both machines see at the same path (a shared mount such as NFS), for the trainer's processes.")
