"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467), plain and fused with the residual add.

Two weight conventions, both with float32 statistics:

- Llama (``gemma=False``, as :class:`specula.runtime.models.layers.RMSNorm` and Hugging
  Face ``LlamaRMSNorm``): ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, the
  normalised value rounded to the activation dtype before the weight multiplies it;
- Gemma (``gemma=True``, as Hugging Face ``GemmaRMSNorm``): ``(x * rsqrt(mean(x^2) + eps)
  * (1 + weight)).to(dtype)``, all in float32.

The fused form does what a decoder layer does between sublayers, in one pass over the
row: ``residual_out = x + residual`` (rounded to the activation dtype, as the unfused
add would be) and ``out = rmsnorm(residual_out)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import FLOATS, pdl, use_reference, wait_for_previous_kernel

_MAX_HIDDEN = 65536
"""One program holds a whole row in registers."""


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden_size]
    residual_out_ptr,  # [num_tokens, hidden_size], written when HAS_RESIDUAL
    x_ptr,  # [num_tokens, hidden_size]
    residual_ptr,  # [num_tokens, hidden_size], read when HAS_RESIDUAL
    weight_ptr,  # [hidden_size]
    ids_ptr,  # GATHER: [num_tokens] int64 rows of x, stride_ids apart
    x2_ptr, weight2_ptr,  # PAIR: [num_tokens, hidden_size] rows, their [hidden_size] weight
    eps, eps2, stride_out, stride_res_out, stride_x, stride_res, stride_ids, stride_x2,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
    GATHER: tl.constexpr, PAIR: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    wait_for_previous_kernel(PDL)
    if PAIR and tl.program_id(1) == 1:  # the second norm, into the columns after the first's
        x = tl.load(x2_ptr + row * stride_x2 + cols, mask=mask, other=0.0)
        weight_ptr, out_ptr, eps = weight2_ptr, out_ptr + HIDDEN, eps2
    else:
        src = tl.load(ids_ptr + row * stride_ids) if GATHER else row
        x = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = xf * tl.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed * (1.0 + w) if GEMMA else w * normed.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             gemma: bool = False) -> torch.Tensor:
    """RMSNorm of each row.

    Args:
        x: [num_tokens, hidden_size] float16/bfloat16/float32, rows dense.
        weight: [hidden_size] in ``x.dtype``.
        eps: added to the mean square.
        gemma: scale by ``1 + weight`` in float32 (Gemma) instead of Llama's convention.

    Returns:
        [num_tokens, hidden_size] in ``x.dtype``.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    return fused_add_rms_norm(x, None, weight, eps, gemma=gemma)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    gemma: bool = False, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
    ids: torch.Tensor | None = None, pair: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``residual_out = x + residual``; ``out = rms_norm(residual_out)``, in one pass.

    Args:
        x, residual: [num_tokens, hidden_size] of one dtype, rows dense; ``residual=None``
            is :func:`rms_norm` (``residual_out`` is then ``None``).
        weight, eps, gemma: as :func:`rms_norm`.
        out, residual_out: optional buffers like ``x``; passing ``out=x, residual_out=residual``
            updates in place (each program reads its row before writing it).
        ids: [num_tokens] int64 (any stride): ``x`` is a table (an embedding's weight) and the rows are
            ``x[ids]``, gathered in the kernel (an embedding lookup and its norm in one launch).
        pair: ``(x2, weight2, eps2)``, with ``residual=None``: also norm ``x2 [num_tokens,
            hidden_size]`` with ``weight2`` into ``out``'s next ``hidden_size`` columns, in the
            same launch (``out`` [num_tokens, 2 * hidden_size]; EAGLE-3's and MTP's input pair).

    Returns:
        ``(out, residual_out)``, both [num_tokens, hidden_size] in ``x.dtype`` (with ``pair``:
        ``out`` [num_tokens, 2 * hidden_size], both halves normed under ``gemma``, and ``None``).

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert x.ndim == 2 and x.stride(-1) == 1, "x must be [num_tokens, hidden_size], rows dense"
    assert x.dtype in FLOATS and (ids is None or (ids.ndim == 1 and ids.dtype == torch.int64))
    assert ids is None or ids.device == x.device
    if ids is not None and use_reference(x):
        x, ids = x[ids], None
    num_tokens, hidden = x.shape if ids is None else (ids.shape[0], x.shape[1])
    if pair is not None:
        assert residual is None and out is not None and out.shape == (num_tokens, 2 * hidden)
        x2, w2, eps2 = pair
        assert x2.shape == (num_tokens, hidden) and x2.dtype == x.dtype and x2.stride(1) == 1
        assert w2.shape == weight.shape and w2.dtype == x.dtype and w2.is_contiguous()
        if use_reference(x):
            fused_add_rms_norm(x, None, weight, eps, gemma=gemma, out=out[:, :hidden])
            fused_add_rms_norm(x2, None, w2, eps2, gemma=gemma, out=out[:, hidden:])
            return out, None
    assert weight.shape == (hidden,) and weight.is_contiguous() and hidden <= _MAX_HIDDEN
    assert weight.dtype == x.dtype, "weight must be in the activation dtype"
    out = x.new_empty(num_tokens, hidden) if out is None else out
    if residual is not None:
        residual_out = x.new_empty(num_tokens, hidden) if residual_out is None else residual_out
    for t in (out[:, :hidden],) if residual is None else (out, residual, residual_out):
        assert t.shape == (num_tokens, hidden) and t.dtype == x.dtype, "shape/dtype unlike x's"
        assert t.stride(-1) == 1, "last dim must be contiguous"
    if num_tokens == 0:
        return out, residual_out
    if use_reference(x):
        normed, summed = rms_norm_reference(x, weight, eps, gemma=gemma, residual=residual)
        if summed is not None:
            residual_out.copy_(summed)
        return out.copy_(normed), residual_out
    block = triton.next_power_of_2(hidden)
    # Without a residual the kernel neither reads nor writes the residual pointers.
    res_in, res_out = (x, out) if residual is None else (residual, residual_out)
    with_pdl = pdl(x)
    x2, w2, eps2 = pair or (x, weight, eps)
    _rms_norm_kernel[(num_tokens, 1 if pair is None else 2)](
        out, res_out, x, res_in, weight, x if ids is None else ids, x2, w2, eps, eps2,
        out.stride(0), res_out.stride(0), x.stride(0), res_in.stride(0),
        0 if ids is None else ids.stride(0), x2.stride(0), HIDDEN=hidden, BLOCK=block,
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, GATHER=ids is not None,
        PAIR=pair is not None, PDL=with_pdl, num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=True, launch_pdl=with_pdl)
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`rms_norm` (``residual=None``) and
    :func:`fused_add_rms_norm`; returns ``(out, residual_out or None)``."""
    residual_out = None
    if residual is not None:
        x = residual_out = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype), residual_out
    return weight * normed.to(x.dtype), residual_out
