"""Which implementation a launcher runs: the Triton kernel on a CUDA device (or anywhere
in Triton's interpreter), the kernel's torch reference on any other device.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, so the
flag is read once here, at import, for the same reason: a process either interprets
every kernel (the kernels' own CPU tests) or none (the engine on a CPU, which then runs
each kernel's torch reference, the same code the kernels are tested against).
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter is on in this process: kernels run on CPU tensors too."""


def use_reference(t: torch.Tensor) -> bool:
    """True when a launcher given ``t`` should run its torch reference: ``t`` is not on a
    CUDA device and Triton's interpreter is off."""
    return t.device.type != "cuda" and not INTERPRET


FLOATS = (torch.float16, torch.bfloat16, torch.float32)
"""The activation dtypes the kernels take."""
