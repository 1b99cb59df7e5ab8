"""Which implementation a launcher runs: the Triton kernel on a CUDA device (or anywhere
in Triton's interpreter), the kernel's torch reference on any other device.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, so the
flag is read once here, at import, for the same reason: a process either interprets
every kernel (the kernels' own CPU tests) or none (the engine on a CPU, which then runs
each kernel's torch reference, the same code the kernels are tested against).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter is on in this process: kernels run on CPU tensors too."""


def use_reference(t: torch.Tensor) -> bool:
    """True when a launcher given ``t`` should run its torch reference: ``t`` is not on a
    CUDA device and Triton's interpreter is off."""
    return t.device.type != "cuda" and not INTERPRET


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor) -> bool:
    """Whether a kernel given ``t`` launches with programmatic dependent launch (CUDA's
    PDL, compute capability 9.0 and later, compiled kernels only): it may start while the
    kernel before it in the stream finishes, and waits for that kernel's results
    (:func:`wait_for_previous_kernel`) before it touches global memory. Between the small
    kernels of a decode step this hides part of each launch's latency."""
    return t.device.type == "cuda" and not INTERPRET and _hopper_or_later(t.device.index or 0)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With ``PDL`` (a kernel launched with ``launch_pdl``), block until the previous
    kernel of the stream has completed and its memory is visible (``griddepcontrol.wait``).
    Call it before the kernel's first global load or store."""
    if PDL:
        gdc_wait()


FLOATS = (torch.float16, torch.bfloat16, torch.float32)
"""The activation dtypes the kernels take."""
