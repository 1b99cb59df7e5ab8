"""``y = x @ W^T`` for a few rows of ``x`` (decode and verification at small batch), where
the product is a stream over the weight: every byte of ``W`` is read once and the
arithmetic is negligible, so the kernel is built for memory bandwidth. Each program owns
``BLOCK_N`` output columns and walks the whole reduction dimension with pipelined weight
loads feeding ``tl.dot`` (rows padded to 16); no split of the reduction, so no second
pass and a deterministic result. The launch configuration per weight shape comes from
``bench/gemv.py`` on an H100.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference

MAX_ROWS = 16
"""Most rows of ``x`` the kernel takes (one ``tl.dot`` tile); more go to the library GEMM."""

DEFAULT_CONFIG = (32, 256, 4, 4)
"""``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for shapes without a tuned entry."""

CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (64, 128, 4, 5),  # Llama-3.1-8B qkv_proj
    (4096, 4096): (32, 256, 4, 5),  # o_proj
    (28672, 4096): (32, 128, 4, 3),  # gate_up_proj
    (4096, 14336): (32, 256, 4, 5),  # down_proj
    (128256, 4096): (64, 512, 8, 3),  # lm_head
    (6144, 8192): (64, 128, 4, 5),  # EAGLE-3 head: qkv over [embedding, state]
    (4096, 12288): (32, 256, 4, 5),  # EAGLE-3 fc over three auxiliary states
    (32000, 4096): (64, 128, 4, 3),  # EAGLE-3 draft-vocabulary lm_head
    (16384, 2048): (64, 128, 4, 3),  # Llama-3.2-1B gate_up_proj
}
"""Tuned ``(N, K) -> config`` for the weights where the kernel beat the library GEMM at 5
rows on an H100 (``bench/gemv.py``, ``bench/results/gemv.json``: 2-13% less time; the
smaller 1B projections lost and are absent); :func:`use_gemv` sends only these shapes
here."""


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
    bfloat16/float16 product of at most :data:`MAX_ROWS` rows with a tuned weight shape."""
    return (
        x.ndim == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and tuple(weight.shape) in CONFIGS
        and not use_reference(x)
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """``x @ weight.T`` with the kernel.

    Args:
        x: [M, K] bfloat16/float16, ``M <= MAX_ROWS``, last dim contiguous.
        weight: [N, K] of ``x.dtype``, last dim contiguous (an ``nn.Linear`` weight).
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; default the tuned entry of
            the weight's shape, else :data:`DEFAULT_CONFIG`.

    Returns:
        [M, N] in ``x.dtype`` (float32 accumulation).

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1]
    assert x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
    assert x.dtype in (torch.bfloat16, torch.float16)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if use_reference(x):
        return y.copy_(gemv_reference(x, weight))
    block_n, block_k, warps, stages = config or CONFIGS.get((n, k), DEFAULT_CONFIG)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        y, x, weight, m, n, k, y.stride(0), x.stride(0), weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
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
