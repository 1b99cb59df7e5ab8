"""SiLU-and-multiply, the gated activation of Llama's MLP (SwiGLU, Shazeer, arXiv
2002.05202), in one pass: ``out = silu(gate) * up`` over ``gate_up = [gate | up]`` as
the fused ``gate_up_proj`` produces it (vLLM's ``silu_and_mul``).

Rounding follows the unfused torch code ``F.silu(gate) * up``: ``silu`` computed in
float32 and rounded to the activation dtype, then the product rounded once more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import FLOATS, use_reference

_BLOCK = 1024
"""Columns per program."""


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, d]
    gate_up_ptr,  # [num_tokens, 2 * d]
    d, stride_out, stride_in, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_in + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = silu * up.to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of each row.

    Args:
        gate_up: [num_tokens, 2 * d] float16/bfloat16/float32, gate columns first; last
            dim contiguous.
        out: optional [num_tokens, d] output buffer in ``gate_up.dtype``.

    Returns:
        [num_tokens, d] in ``gate_up.dtype``.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert gate_up.ndim == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    assert gate_up.dtype in FLOATS
    num_tokens, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, d) if out is None else out
    assert out.shape == (num_tokens, d) and out.dtype == gate_up.dtype and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    if use_reference(gate_up):
        return out.copy_(silu_and_mul_reference(gate_up))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, _BLOCK))](
        out, gate_up, d, out.stride(0), gate_up.stride(0), BLOCK=_BLOCK, enable_fp_fusion=True)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_and_mul` (what ``LlamaMLP`` computes)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
