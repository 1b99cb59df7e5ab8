"""``y = x @ W^T`` for the few rows of ``x`` of decode and verification at small batch,
where the product is a stream over the weight: every byte of ``W`` is read once and the
arithmetic is small, so the kernel is built for memory bandwidth. Each program owns
``BLOCK_N`` output columns and all rows (one ``BLOCK_M`` tile, at least 16 for
``tl.dot``), and walks the whole reduction dimension with pipelined weight loads; no split
of the reduction, so no second pass and a deterministic result. The launch configuration
per weight shape and row tile comes from ``bench/gemv.py`` on an H100.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference

DEFAULT_CONFIG = (32, 256, 4, 4)
"""``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` when none is given or tuned."""

CONFIGS: dict[tuple[int, int], dict[int, tuple[int, int, int, int]]] = {
    (6144, 4096): {16: (64, 128, 4, 5), 32: (64, 128, 8, 5)},  # Llama-3.1-8B qkv_proj
    (4096, 4096): {16: (32, 256, 4, 5)},  # o_proj
    (28672, 4096): {16: (128, 256, 8, 3), 32: (128, 256, 4, 3), 64: (128, 128, 8, 3)},
    (4096, 14336): {16: (32, 256, 4, 5), 32: (32, 256, 4, 5)},  # down_proj
    (128256, 4096): {16: (64, 512, 4, 3), 32: (128, 128, 4, 3), 64: (128, 128, 8, 3),
                     128: (128, 128, 8, 3)},  # lm_head
    (6144, 8192): {16: (64, 128, 4, 5), 32: (32, 128, 4, 5), 64: (64, 128, 8, 5)},  # EAGLE-3 qkv
    (4096, 12288): {16: (32, 256, 4, 5), 32: (32, 256, 4, 5)},  # EAGLE-3 fc
    (32000, 4096): {16: (128, 128, 4, 5), 32: (128, 128, 4, 3), 64: (128, 128, 8, 3),
                    128: (128, 128, 8, 3)},  # EAGLE-3 draft-vocabulary lm_head
    (16384, 2048): {16: (128, 128, 4, 3), 32: (128, 128, 4, 3), 64: (128, 128, 8, 3)},  # 1B
}
"""Tuned ``(N, K) -> {BLOCK_M: config}``: the weight shapes and row tiles where the kernel
beat the library GEMM on an H100 (``bench/gemv.py``, ``bench/results/gemv.json``);
:func:`use_gemv` sends only these here."""


def block_m(rows: int) -> int:
    """The row tile for ``rows`` rows: a power of two, at least 16 (``tl.dot``'s least)."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _gemv_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    M,
    N,
    K,
    stride_ym,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (k0 + offs_k[:, None] < K), other=0.0)
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (k0 + offs_k[None, :] < K), other=0.0)
        acc = tl.dot(x, w, acc)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs the kernel for these operands: a CUDA (or interpreted)
    bfloat16/float16 product whose weight shape and row tile are tuned."""
    return (
        x.ndim == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and block_m(x.shape[0]) in CONFIGS.get(tuple(weight.shape), ())
        and not use_reference(x)
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """``x @ weight.T`` with the kernel.

    Args:
        x: [M, K] bfloat16/float16, last dim contiguous.
        weight: [N, K] of ``x.dtype``, last dim contiguous (an ``nn.Linear`` weight).
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; default the tuned entry of
            the weight's shape and row tile, else :data:`DEFAULT_CONFIG`.

    Returns:
        [M, N] in ``x.dtype`` (float32 accumulation).

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1]
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if use_reference(x):
        return y.copy_(gemv_reference(x, weight))
    bm = block_m(m)
    block_n, block_k, warps, stages = config or CONFIGS.get((n, k), {}).get(bm, DEFAULT_CONFIG)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        y, x, weight, m, n, k, y.stride(0), x.stride(0), weight.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=(k % block_k == 0 and n % block_n == 0), num_warps=warps, num_stages=stages,
    )
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gemv` (the library GEMM)."""
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through :func:`gemv` where :func:`use_gemv` says so
    (no bias). ``x``: [M, K] (any leading shape goes to ``F.linear``); returns [M, N]."""
    if bias is None and use_gemv(x, weight):
        return gemv(x, weight)
    return F.linear(x, weight, bias)
