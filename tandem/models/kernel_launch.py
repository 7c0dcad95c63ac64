"""How tandem's Triton kernels launch: programmatic dependent launch (PDL) where the GPU has it.
More: docs/internals.md."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton without grid dependency control, or none: kernels take PDL=False
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: whether the kernel takes part in PDL, and Triton's launch
    option. Read at every launch (in graphs only at capture), so TANDEM_PDL=0 applies to graphs captured after it
    is set."""
    if (os.environ.get("TANDEM_PDL", "1") == "0" or device.type != "cuda" or gdc_wait is None
            or os.environ.get("TRITON_INTERPRET", "0") == "1"
            or not _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


if triton is not None:  # the helpers below call gdc_* only under a PDL that pdl_options gives where they exist

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """A kernel's first step before it reads what an earlier kernel wrote (a no-op without PDL)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def launch_dependents(PDL: tl.constexpr):
        """Let the next kernel launch: after the main loop, so its blocks, waiting, take no SM slot a block of this
        kernel still needs."""
        if PDL:
            gdc_launch_dependents()
