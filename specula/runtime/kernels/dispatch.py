"""Which implementation a launcher runs: the Triton kernel on a CUDA device (or anywhere
in Triton's interpreter), the kernel's torch reference on any other device; and the
launchers' argument check.

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


def check(
    t: torch.Tensor | None,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | tuple[torch.dtype, ...],
    *,
    dense: bool = False,
) -> None:
    """Assert (AssertionError) that ``t`` is a tensor of ``shape`` (``None`` matches any
    size) and ``dtype`` (or one of a tuple), its last dim contiguous (``dense``: all of it)."""
    assert t is not None, "tensor missing"
    size = t.shape
    assert len(size) == len(shape), f"shape {tuple(size)}, expected {shape}"
    for i, n in enumerate(shape):  # indexing beats zip(), and this runs before each launch
        assert n is None or n == size[i], f"shape {tuple(size)}, expected {shape}"
    assert t.dtype in dtype if type(dtype) is tuple else t.dtype == dtype, f"dtype {t.dtype}"
    assert t.is_contiguous() if dense else t.stride(-1) == 1, "layout: not contiguous"
