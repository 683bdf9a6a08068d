"""DeepSpeed's accelerator on a CPU-only machine, told before TRL's trainer imports DeepSpeed (``BAPOTrainer`` calls
it first, so ``bapo train`` and the Python API both have it)."""

from __future__ import annotations

import os


def quiet_deepspeed_on_cpu(torch, environ=os.environ) -> None:
    """Tell DeepSpeed the accelerator is the CPU where it is (no CUDA, XPU or MPS device, and ``DS_ACCELERATOR``
    unset): it then says nothing, instead of warning at its import, which TRL's trainer triggers, "Setting
    accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on every CPU run. A
    process that imported DeepSpeed already (an ``accelerate launch`` with a DeepSpeed config) is unaffected."""
    others = (torch.cuda.is_available(), hasattr(torch, "xpu") and torch.xpu.is_available(),
              hasattr(torch.backends, "mps") and torch.backends.mps.is_available())
    if not any(others):
        environ.setdefault("DS_ACCELERATOR", "cpu")
