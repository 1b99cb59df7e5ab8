"""``y = x @ W^T`` for the few rows of ``x`` of decode and verification at small batch,
where the product is a stream over the weight: every byte of ``W`` is read once and the
arithmetic is small, so the kernel is built for memory bandwidth. Each program owns
``BLOCK_N`` output columns and all rows (one ``BLOCK_M`` tile, at least 16 for
``tl.dot``), and walks the reduction dimension with pipelined weight loads, or its
``1/SPLIT_K`` of it (CUTLASS's serial split-K): the last of a tile's programs to arrive
(an atomic counter) sums their float32 partials in split order, whatever the arrival order,
and runs the epilogue. Configurations per weight shape and row tile: ``bench/gemv.py``.

Four epilogues each save a decode step a launch and a round trip through memory:

- SwiGLU (:func:`linear_silu_and_mul`): a program accumulates ``BLOCK_N`` gate columns and
  the matching up columns (weight rows ``n`` and ``n + N``) and stores ``silu(gate) *
  up``, rounded as the unfused GEMM then :func:`~.activation.silu_and_mul` round it.
- argmax (:func:`linear_argmax`, a greedy LM head): each program also writes its rows'
  maxima and their first columns; one program per row merges them into ``torch.argmax``'s
  answer on the rounded logits. :func:`argmax` does the same after the library GEMM.
- residual add (``residual``, a decoder's ``o_proj`` and ``down_proj``): the output is the
  new residual stream, and each program also writes its columns' sums of squares (alone:
  ``sums_of_squares``, MTP's ``eh_proj``);
- RMSNorm scale (``rms``, the ``qkv_proj`` and ``gate_up_proj`` after them, with the norm
  weight folded into theirs by :func:`fold_norm_weight`): the accumulators are scaled by
  the rows' ``1 / rms`` from those sums, so the norm needs no kernel of its own. ``x``
  goes to the dot untouched: any other use of the tile in the loop (even summing its
  squares) kept the loads from being pipelined on an H100, 1.6-3x slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specula.runtime.kernels.activation import silu_and_mul
from specula.runtime.kernels.dispatch import pdl, use_reference, wait_for_previous_kernel

DEFAULT_CONFIG = (32, 256, 4, 4)
"""``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` when none is given or tuned; a tuned
entry may add a fifth, ``SPLIT_K`` (1 when absent)."""

CONFIGS: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {
    (6144, 4096): {16: (64, 128, 4, 5), 32: (64, 128, 8, 5)},  # Llama-3.1-8B qkv_proj
    (4096, 4096): {16: (32, 256, 4, 5), 32: (32, 256, 4, 4)},  # o_proj
    (28672, 4096): {16: (128, 256, 8, 3), 32: (128, 256, 4, 3), 64: (128, 128, 8, 3)},
    (4096, 14336): {16: (32, 256, 4, 5), 32: (32, 256, 4, 5)},  # down_proj
    (128256, 4096): {1: (32, 512, 4, 5), 16: (64, 512, 4, 3), 32: (128, 128, 4, 3),
                     64: (128, 128, 8, 3), 128: (128, 128, 8, 3)},  # lm_head
    (6144, 8192): {16: (64, 128, 4, 5), 32: (32, 128, 4, 5), 64: (64, 128, 8, 5)},  # EAGLE-3 qkv
    (4096, 12288): {16: (32, 256, 4, 5), 32: (32, 256, 4, 5)},  # EAGLE-3 fc
    (4096, 8192): {16: (32, 512, 4, 5)},  # MTP eh_proj (2H in)
    (32000, 4096): {16: (128, 128, 4, 5), 32: (128, 128, 4, 3), 64: (128, 128, 8, 3),
                    128: (128, 128, 8, 3)},  # EAGLE-3 draft-vocabulary lm_head
    (3072, 2048): {16: (32, 128, 4, 5)},  # Llama-3.2-1B qkv_proj
    (16384, 2048): {16: (64, 128, 4, 3), 32: (128, 128, 4, 3), 64: (64, 128, 4, 3)},  # gate_up
    (2048, 2048): {1: (32, 128, 4, 5, 2), 16: (16, 128, 4, 5), 32: (16, 512, 4, 5),
                   64: (16, 128, 4, 5)},  # o_proj
    (2048, 8192): {16: (32, 256, 4, 5, 2), 32: (16, 512, 4, 5)},  # down_proj, split-K
    (128256, 2048): {1: (32, 512, 4, 5), 16: (32, 256, 4, 5), 32: (128, 128, 4, 3),
                     64: (128, 128, 8, 3), 128: (128, 128, 8, 3)},  # lm_head
    (3072, 4096): {16: (32, 256, 4, 5), 32: (32, 128, 4, 5)},  # 8B at TP=2: qkv_proj
    (4096, 2048): {16: (32, 128, 4, 5), 32: (32, 256, 4, 4)},  # o_proj
    (14336, 4096): {32: (128, 128, 4, 3)},  # gate_up_proj
    (4096, 7168): {16: (32, 256, 4, 5), 32: (32, 256, 4, 5)},  # down_proj
    (64128, 4096): {16: (128, 128, 4, 5), 32: (128, 256, 4, 3)},  # lm_head (vocab shard)
}
"""Tuned ``(N, K) -> {BLOCK_M: config}``: the weight shapes and row tiles where the kernel
beat the library GEMM on an H100 (``bench/gemv.py``, ``bench/results/gemv.json``);
:func:`use_gemv` sends only these here. Key 1, where present, is one row's (a draft step's,
a decode step's at batch 1), faster there than the 16-row tile's, which is tuned over 1-16 rows
(``bench/results/engine.json``, ``gemv_one_row_configs``)."""


PREFETCH_MAX_BYTES, PREFETCH_SHARE = 6 << 20, 3
""":func:`gemv`'s ``prefetch``: at most 6 MiB of the next weight per launch, and at most a
third of the launch's own weight bytes (the best mean over Llama-3.2-1B and 3.1-8B layers
at 1, 5 and 32 rows on an H100: ``bench/results/engine.json``, ``gemv_prefetch_next``)."""


def prefetch_lines(weight: torch.Tensor, prefetch: torch.Tensor | None) -> int:
    """The 128-byte lines of ``prefetch`` that :func:`gemv` of ``weight`` fetches ahead (0: none)."""
    return 0 if prefetch is None else min(
        PREFETCH_MAX_BYTES, weight.nbytes // PREFETCH_SHARE, prefetch.nbytes) // 128


def block_m(rows: int) -> int:
    """The row tile for ``rows`` rows: a power of two, at least 16 (``tl.dot``'s least)."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _load_weight(ptrs, mask, EVEN: tl.constexpr):
    """A weight tile; unmasked when the shape is a multiple of the tile (``EVEN``)."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _prefetch(next_ptr, next_lines, prog, num_progs):
    """Program ``prog`` of ``num_progs`` asks L2 for its share of the first ``next_lines``
    128-byte lines at ``next_ptr`` (``prefetch.global.L2``; nothing is written)."""
    per = tl.cdiv(next_lines, num_progs)
    for i in range(0, per, 128):
        offs = i + tl.arange(0, 128)
        line = tl.where((prog * per + offs < next_lines) & (offs < per), prog * per + offs, 0)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [next_ptr.to(tl.pointer_type(tl.int8)) + line.to(tl.int64) * 128],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]; SILU_MUL: [2N, K], gate rows then up rows
    part_max_ptr,  # ARGMAX: [M, num_programs] float32, each program's row maxima
    part_idx_ptr,  # ARGMAX: [M, num_programs] int32, their columns; SCREEN: float32, their bounds
    res_ptr,  # RESIDUAL: [M, N] added to the product
    rms_ptr,  # RMS: [M, num_parts] float32, sums of squares of parts of each row of x
    split_ptr,  # SPLIT_K > 1: [num_programs, SPLIT_K, (2,) BLOCK_M, BLOCK_N] float32 partials
    count_ptr,  # SPLIT_K > 1: [>= num_programs] int32 zeros, arrivals per column tile
    next_ptr, next_lines,  # PREFETCH: the next weight, how many of its first 128-byte lines
    aux_ptr,  # SCREEN: [2, N] float32, the int8 rows' scales and error bounds
    M, N, K, stride_ym, stride_xm, stride_wn,
    up_offset,  # SILU_MUL: N * stride_wn, the up rows' offset
    stride_res, num_parts, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    SILU_MUL: tl.constexpr, ARGMAX: tl.constexpr, RESIDUAL: tl.constexpr, SQUARES: tl.constexpr,
    RMS: tl.constexpr, BLOCK_P: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, SCREEN: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)  # this program's 1/SPLIT_K of the reduction
    k_len = K // SPLIT_K
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] + split * k_len
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] + split * k_len
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        w_mask = (offs_n[None, :] < N) & (k0 + offs_k[:, None] < K)
        w = _load_weight(w_ptrs, w_mask, EVEN)
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (k0 + offs_k[None, :] < K), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]; w int8: SCREEN
        if SILU_MUL:
            acc_up = tl.dot(x, _load_weight(w_ptrs + up_offset, w_mask, EVEN), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PREFETCH:  # this program's weights are read: start the next kernel's into L2
        _prefetch(next_ptr, next_lines, pid * SPLIT_K + split, tl.num_programs(0) * SPLIT_K)
    last = True
    if SPLIT_K > 1:  # the last program of the column tile to arrive sums the partials
        tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = split_ptr + (pid * SPLIT_K + split) * 2 * BLOCK_M * BLOCK_N + tile
        tl.store(part, acc)
        if SILU_MUL:
            tl.store(part + BLOCK_M * BLOCK_N, acc_up)
        tl.debug_barrier()  # every thread's partial stored before the release below
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        tl.debug_barrier()
        if last:  # in split order, whichever program arrives last: deterministic
            tl.store(count_ptr + pid, 0)  # ready for the next launch
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = split_ptr + (pid * SPLIT_K + s) * 2 * BLOCK_M * BLOCK_N + tile
                acc += tl.load(part, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(part + BLOCK_M * BLOCK_N, cache_modifier=".cg")
    if SCREEN:  # int8 rows: the scaled products, the bounds' centres (the argmax epilogue's input)
        acc *= tl.load(aux_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if last:
        _gemv_epilogue(acc, acc_up, y_ptr, part_max_ptr, part_idx_ptr, res_ptr, rms_ptr, aux_ptr, pid,
                       offs_m, offs_n, M, N, K, stride_ym, stride_res, num_parts, eps, BLOCK_M,
                       BLOCK_N, SILU_MUL, ARGMAX, RESIDUAL, SQUARES, RMS, BLOCK_P, SCREEN)


@triton.jit
def _gemv_epilogue(acc, acc_up, y_ptr, part_max_ptr, part_idx_ptr, res_ptr, rms_ptr, aux_ptr, pid,
                   offs_m, offs_n, M, N, K, stride_ym, stride_res, num_parts, eps, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr, ARGMAX: tl.constexpr, RESIDUAL: tl.constexpr,
                   SQUARES: tl.constexpr, RMS: tl.constexpr, BLOCK_P: tl.constexpr, SCREEN: tl.constexpr):
    """:func:`_gemv_kernel`'s epilogues on a column tile's accumulators (``SCREEN`` with ``ARGMAX``:
    the best column's bound in place of its index)."""
    if RMS:  # the rows' 1 / rms from their sums of squares (outside the loop: x goes to
        # the dot untouched, which keeps the loads pipelined)
        offs_p = tl.arange(0, BLOCK_P)
        sum_sq = tl.load(rms_ptr + offs_m[:, None] * num_parts + offs_p[None, :],
                         mask=(offs_m[:, None] < M) & (offs_p[None, :] < num_parts), other=0.0)
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
        acc *= rstd
        acc_up *= rstd
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype)
    if SILU_MUL:  # the rounding of gate_up_proj, then of silu_and_mul
        g = y.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        y = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if RESIDUAL:  # rounded as fused_add_rms_norm's add
        res = tl.load(res_ptr + offs_m[:, None] * stride_res + offs_n[None, :], mask=y_mask,
                      other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
    if SQUARES:  # this program's sums of squares of its columns
        yf = tl.where(y_mask, y.to(tl.float32), 0.0)
        parts = offs_m * tl.num_programs(0) + pid
        tl.store(part_max_ptr + parts, tl.sum(yf * yf, axis=1), mask=offs_m < M)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y, mask=y_mask)
    if ARGMAX:
        v = tl.where((offs_n[None, :] < N) & (y == y), y.to(tl.float32), float("-inf"))  # NaN: -inf
        best = tl.argmax(v, axis=1, tie_break_left=True)  # [BLOCK_M]; a NaN row: its first column
        parts = offs_m * tl.num_programs(0) + pid
        tl.store(part_max_ptr + parts, tl.max(v, axis=1), mask=offs_m < M)
        if SCREEN:  # selected from the tile's bounds, loaded apart from the argmax (no dependent load)
            bounds = tl.load(aux_ptr + N + offs_n, mask=offs_n < N, other=0.0)[None, :]
            tl.store(part_idx_ptr + parts, tl.sum(tl.where(best[:, None] == tl.arange(0, BLOCK_N)[None, :],
                                                           bounds, 0.0), axis=1), mask=offs_m < M)
        else:
            tl.store(part_idx_ptr + parts, pid * BLOCK_N + best, mask=offs_m < M)


@triton.jit
def _argmax_kernel(
    max_ptr,  # [M, num_chunks] float32: each chunk's maximum
    idx_ptr,  # [M, num_chunks] int32/int64/float32: its first column, plus offset
    x_ptr,  # [M, N] values (logits, or the partial maxima of a first pass)
    x_idx_ptr,  # HAS_IDX: [M, N] int32 columns of x's values, increasing along a row
    N, stride_x, offset,
    BLOCK: tl.constexpr, HAS_IDX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=float("-inf"))
    v = tl.where(v == v, v.to(tl.float32), float("-inf"))  # NaN as -inf: a NaN row gets its first column
    if HAS_IDX:
        i = tl.load(x_idx_ptr + row * stride_x + offs, mask=offs < N, other=2147483647)
    else:
        i = offs
    # The first column holding the maximum: the least index among the values equal to it.
    best = tl.min(tl.where(v == tl.max(v, axis=0), i, 2147483647), axis=0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, tl.max(v, axis=0))
    tl.store(idx_ptr + out, (best + offset).to(idx_ptr.dtype.element_ty))


_ARGMAX_BLOCK = 4096
"""Columns per program of :func:`argmax`'s first pass."""


def _merge_argmax(part_max: torch.Tensor, part_idx: torch.Tensor, into=None) -> torch.Tensor:
    """[M, P] partial maxima and their columns -> [M] int64, in one program per row (into
    ``into`` where it is a tensor); or ``pairs`` of ``into=(pairs [2, M] float32, offset)``
    (:func:`argmax`'s)."""
    m, p = part_max.shape
    pairs = None if into is None or isinstance(into, torch.Tensor) else into
    if pairs is None:
        idx = torch.empty(m, dtype=torch.int64, device=part_max.device) if into is None else into
        assert idx.dtype == torch.int64 and idx.shape == (m,) and idx.stride(0) == 1
        best, offset = torch.empty(m, dtype=torch.float32, device=part_max.device), 0
    else:
        (best, idx), offset = pairs
    _argmax_kernel[(m, 1)](  # not into part_max: row r's program would overwrite row 0's partial r
        best, idx, part_max, part_idx, p, p, offset, BLOCK=triton.next_power_of_2(p), HAS_IDX=True
    )
    return idx if pairs is None else pairs[0]


def argmax(x: torch.Tensor, into: tuple[torch.Tensor, int] | torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` (the first index of each row's maximum) in two passes: programs
    of :data:`_ARGMAX_BLOCK` columns, then one per row over their partials, instead of
    ``torch.argmax``'s one block per row. NaN counts as -inf (``torch.argmax``, as on the
    torch reference, takes the first NaN), so a row of NaN gets column 0.

    Args:
        x: [M, N] floating point, last dim contiguous.
        into: ``(pairs [2, M] float32, offset)``: write each row's maximum into
            ``pairs[0]`` and ``offset`` + its index into ``pairs[1]`` instead (a vocabulary
            shard's offer to :func:`~specula.runtime.worker.parallel.gather_argmax`); or a
            contiguous [M] int64 tensor (a column of a draft's tokens) to write the indices to.

    Returns:
        [M] int64 (with a tensor ``into``, that tensor); with ``into`` pairs, ``pairs``.

    Raises:
        AssertionError: ``x`` or a tensor ``into`` unlike the above.
    """
    assert x.ndim == 2 and x.stride(1) == 1 and x.is_floating_point()
    m, n = x.shape
    if isinstance(into, torch.Tensor):  # on every path, so that a CPU run checks it too
        assert into.dtype == torch.int64 and into.shape == (m,) and into.stride(0) == 1
    if m == 0 or n == 0 or use_reference(x):
        idx = x.argmax(dim=-1)
        if isinstance(into, torch.Tensor):
            return into.copy_(idx)
        if into is not None:
            into[0][0], into[0][1] = x.gather(1, idx[:, None])[:, 0], idx + into[1]
        return idx if into is None else into[0]
    chunks = triton.cdiv(n, _ARGMAX_BLOCK)
    part_max = torch.empty(m, chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(m, chunks, dtype=torch.int32, device=x.device)
    _argmax_kernel[(m, chunks)](
        part_max, part_idx, x, x, n, x.stride(0), 0, BLOCK=_ARGMAX_BLOCK, HAS_IDX=False
    )
    return _merge_argmax(part_max, part_idx, into)


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
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...] | None = None,
    *, silu_mul: bool = False, with_argmax: bool = False, residual: torch.Tensor | None = None,
    rms: tuple[torch.Tensor, float] | None = None, argmax_into: tuple[torch.Tensor, int] | torch.Tensor | None = None,
    sums_of_squares: bool = False, prefetch: torch.Tensor | None = None,
    screen: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T`` with the kernel, optionally with the module's epilogues.

    Args:
        x: [M, K] bfloat16/float16, last dim contiguous.
        weight: [N, K] of ``x.dtype``, last dim contiguous (an ``nn.Linear`` weight);
            with ``silu_mul`` [2N, K], the gate rows then the up rows.
        config: ``(BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K])``; default the
            tuned entry of the weight's shape and row tile (or of one row), else
            :data:`DEFAULT_CONFIG`.
            With ``silu_mul`` a program covers ``BLOCK_N / 2`` columns of each half.
            ``SPLIT_K`` > 1 applies when ``SPLIT_K * BLOCK_K`` divides ``K``.
        silu_mul: return ``silu(x @ gate.T) * (x @ up.T)`` [M, N] (SwiGLU, Shazeer,
            arXiv 2002.05202).
        with_argmax: also return the first index of each row's maximum, [M] int64, or
            with ``argmax_into`` what :func:`argmax`'s ``into`` gets (pairs, or the [M]
            int64 tensor it writes the indices to).
        residual: [M, N] like the output: return ``x @ weight.T + residual`` (a residual
            add, rounded as :func:`~.layernorm.fused_add_rms_norm` rounds it) and its sums
            of squares, [M, P] float32 over P parts of each row (what ``rms`` takes);
            ``sums_of_squares``: those of ``x @ weight.T``, without a residual.
        rms: ``(sum_sq [M, P] float32, eps)``, sums of squares of parts of each row of
            ``x``: return ``(x @ weight.T) / sqrt(mean(x^2) + eps)`` per row, the product
            of ``rms_norm(x)`` when the norm weight is folded into ``weight``
            (:func:`fold_norm_weight`; RMSNorm, arXiv 1910.07467).
        prefetch: the weight of the projection that runs next (contiguous): each program,
            its own weights read, asks L2 for its share of the first
            min(:data:`PREFETCH_MAX_BYTES`, ``weight`` bytes / :data:`PREFETCH_SHARE`)
            bytes of it, which stream while this launch's tail and the next launch's
            start leave the memory idle (CUDA devices of compute capability 9.0 and later).
        screen: ``weight`` is int8, :func:`screen_weight`'s, and this its [2, N] float32 scales
            and error bounds: return ([M, N] float32 scaled products, the logits within ``||x||``
            times their rows' bounds; [M, P] float32 each program's greatest per row (NaN as
            -inf), [M, P] float32 its row's bound) (:func:`screened_argmax`'s first pass).

    Returns:
        [M, N] in ``x.dtype`` (float32 accumulation); with ``with_argmax`` also the
        argmax, with ``residual`` or ``sums_of_squares`` also the sums of squares; with ``screen``
        the three tensors above.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above, or more than
            one of ``with_argmax``, ``silu_mul``, ``residual`` and ``screen`` asked for.
    """
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1]
    assert x.dtype == weight.dtype or screen is not None and weight.dtype == torch.int8
    assert x.dtype in (torch.bfloat16, torch.float16)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    squares = sums_of_squares or residual is not None
    assert silu_mul + with_argmax + squares + (screen is not None) <= 1, "one epilogue at a time"
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert not silu_mul or weight.shape[0] == 2 * n
    assert residual is None or (residual.shape == (m, n) and residual.dtype == x.dtype
                                and residual.stride(1) == 1)
    if m == 0 or use_reference(x):  # the torch reference: the library GEMM
        if rms is None:
            y = F.linear(x, weight)
        else:
            rstd = torch.rsqrt(rms[0].sum(-1, keepdim=True) / k + rms[1])
            y = (F.linear(x.float(), weight.float()) * rstd).to(x.dtype)
        y = silu_and_mul(y) if silu_mul else y
        if with_argmax:
            return y, argmax(y, argmax_into)
        if squares:
            y = y if residual is None else y + residual
            return y, y.float().pow(2).sum(-1, keepdim=True)
        return y
    y = torch.empty(m, n, dtype=x.dtype if screen is None else torch.float32, device=x.device)
    bm = block_m(m)
    tuned = CONFIGS.get(tuple(weight.shape), {})
    cfg = config or tuned.get(1 if m == 1 else bm) or tuned.get(bm, DEFAULT_CONFIG)
    block_n, block_k, warps, stages, split_k = (*cfg, 1)[:5]
    block_n //= 2 if silu_mul else 1
    grid = triton.cdiv(n, block_n)
    counts = _split_counts(x.device, grid) if split_k > 1 and k % (split_k * block_k) == 0 else None
    split_k = 1 if counts is None else split_k
    partials = y if counts is None else torch.empty(
        grid * split_k * 2 * bm * block_n, dtype=torch.float32, device=x.device)
    second = torch.int32 if screen is None else torch.float32  # columns, or (SCREEN) bounds
    parts = (torch.empty(m, grid, dtype=torch.float32, device=x.device),
             torch.empty(m, grid, dtype=second, device=x.device)) if with_argmax or screen is not None else (y, y)
    if squares:
        parts = (torch.empty(m, grid, dtype=torch.float32, device=x.device), y)
    sum_sq, eps = (y, 0.0) if rms is None else rms
    assert rms is None or (sum_sq.shape[0] == m and sum_sq.dtype == torch.float32
                           and sum_sq.is_contiguous())
    with_pdl = pdl(x)
    lines = prefetch_lines(weight, prefetch) if with_pdl else 0
    _gemv_kernel[(grid, split_k)](
        y, x, weight, *parts, y if residual is None else residual, sum_sq, partials,
        partials if counts is None else counts, weight if prefetch is None else prefetch, lines,
        y if screen is None else screen, m, n, k, y.stride(0), x.stride(0), weight.stride(0),
        n * weight.stride(0),
        y.stride(0) if residual is None else residual.stride(0), sum_sq.shape[1], eps,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=(k % block_k == 0 and n % block_n == 0), SILU_MUL=silu_mul, ARGMAX=with_argmax or screen is not None,
        RESIDUAL=residual is not None, SQUARES=squares, RMS=rms is not None,
        BLOCK_P=1 if rms is None else triton.next_power_of_2(sum_sq.shape[1]), SPLIT_K=split_k,
        PDL=with_pdl, PREFETCH=lines > 0, SCREEN=screen is not None, num_warps=warps,
        num_stages=stages, launch_pdl=with_pdl,
    )
    if with_argmax:
        return y, _merge_argmax(*parts, argmax_into)
    return (y, *parts) if screen is not None else (y, parts[0]) if squares else y


_SPLIT_COUNTS: dict[torch.device, torch.Tensor] = {}  # split-K arrivals per tile, 0 between


def _split_counts(device: torch.device, grid: int) -> torch.Tensor | None:
    """The counters for ``grid`` tiles; ``None`` (no split) if too few, or if not yet
    allocated inside a CUDA graph capture."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if device not in _SPLIT_COUNTS and not capturing:
        _SPLIT_COUNTS[device] = torch.zeros(1 << 14, dtype=torch.int32, device=device)
    counts = _SPLIT_COUNTS.get(device)
    return counts if counts is not None and grid <= counts.numel() else None


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """``weight [N, K] *= norm_weight [K]`` in place (float32 product, rounded once): a Llama
    RMSNorm's weight moved into the projection after it, so that
    ``rms_norm(x, norm_weight) @ weight.T == (x / rms(x)) @ folded.T`` up to rounding
    (``gemv``'s ``rms``)."""
    weight.copy_(weight.float() * norm_weight.float())


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gemv` (the library GEMM)."""
    return F.linear(x, weight)


LT_ROWS: dict[tuple[int, int], tuple[int, int]] = {
    (4096, 14336): (64, 192),  # Llama-3.1-8B down_proj: 128 rows 54.0 -> 45.2 us
    (2048, 8192): (64, 160),  # Llama-3.2-1B down_proj: 128 rows 18.3 -> 16.6 us
    (4096, 7168): (64, 192),  # its TP=2 shard: 160 rows 33.5 -> 25.4 us (128 rows 2 % slower)
}
"""Weight shapes ``(N, K)`` and row counts (inclusive: the first to the last measured past
:data:`CONFIGS`' row tiles where the library GEMM through cuBLASLt beat cuBLAS by more than 3 %)
on an H100 (``bench/gemv.py --libraries``; ``bench/results/gemv.json``, ``blas_library``).
:func:`linear` asks torch for cuBLASLt there; elsewhere the two were within 3 % or cuBLAS was
faster."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through :func:`gemv` where :func:`use_gemv` says so
    (no bias), through cuBLASLt where :data:`LT_ROWS` says so (bfloat16; torch's preference is
    process-wide: set and restored here, so only one thread may run products at a time, as the
    engine's does). ``x``: [M, K] (any leading shape goes to ``F.linear``); returns [M, N]."""
    if bias is None and use_gemv(x, weight):
        return gemv(x, weight)
    low, high = LT_ROWS.get(tuple(weight.shape), (1, 0))
    if x.ndim == 2 and low <= x.shape[0] <= high and x.is_cuda and x.dtype == torch.bfloat16:
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return F.linear(x, weight, bias)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight, bias))`` (a fused ``gate_up_proj`` and its
    activation): ``x`` [M, K], ``weight`` [2N, K] gate rows then up rows; returns
    [M, N]. One :func:`gemv` with the SwiGLU epilogue where :func:`use_gemv` says so,
    else the library GEMM and the activation kernel."""
    if bias is None and use_gemv(x, weight):
        return gemv(x, weight, silu_mul=True)
    return silu_and_mul(linear(x, weight, bias))


SCREEN_CONFIG, RESCORE_COLUMNS, SCREEN_MAX_ROWS = (128, 256, 4, 3), 1024, 32
""":func:`screened_argmax`'s int8 pass ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` (Llama-3.2-1B's
head at one and two rows on an H100, ``bench/screened_argmax.py``), its rescoring's columns a
program, and its most rows (the GPU test's most; an earlier pass spilled registers past 32)."""


@triton.jit
def _rescore_kernel(
    best_ptr, idx_ptr,  # [M, num_programs(0)] float32, int32: each program's best logit, its column
    x_ptr, w_ptr,  # [M, K], [N, K]
    centre_ptr,  # [M, N] float32, the bounds' centres (the int8 pass's scaled products)
    top_ptr, top_bound_ptr,  # [M, P] float32: each int8 program's best centre, its row's bound
    aux_ptr,  # [2, N] float32, the int8 rows' scales and error bounds
    N, K, P, stride_xm, stride_wn,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    """:func:`screened_argmax`'s second pass over ``BLOCK_C`` columns of one row of ``x``: the bounds
    (centres plus and minus ``||x||`` times the rows' bounds), then each candidate's logit from its
    bf16 row, best first by upper bound, rounded to ``x``'s dtype."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(1).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0)
    norm = tl.sqrt(tl.sum(x.to(tl.float64) * x.to(tl.float64), axis=0)).to(tl.float32)  # no overflow
    x = x.to(tl.float32)
    offs_p = tl.arange(0, BLOCK_P)
    top = tl.load(top_ptr + row * P + offs_p, mask=offs_p < P, other=float("-inf"))
    # Each best centre less ||x|| times its bound is below a logit: the greatest bounds the maximum.
    low = top - norm * tl.load(top_bound_ptr + row * P + offs_p, mask=offs_p < P, other=0.0)
    low = tl.max(tl.where(low == low, low, float("-inf")), axis=0)  # NaN (an inf in x): none
    offs_c = tl.arange(0, BLOCK_C)
    cols = tl.program_id(0) * BLOCK_C + offs_c
    up = (tl.load(centre_ptr + row * N + cols, mask=cols < N, other=float("-inf"))
          + norm * tl.load(aux_ptr + N + cols, mask=cols < N, other=0.0))
    cand = (cols < N) & (up.to(dtype) >= low.to(dtype))
    key = tl.maximum(up, -3.0e38)  # finite for every candidate: the loop takes one each time
    best, best_col = tl.full([], float("-inf"), tl.float32), tl.program_id(0) * BLOCK_C  # in range
    while tl.max(cand.to(tl.int32), axis=0) > 0:
        c = tl.argmax(tl.where(cand, key, float("-inf")), axis=0, tie_break_left=True)
        col = tl.program_id(0) * BLOCK_C + c
        w = tl.load(w_ptr + col.to(tl.int64) * stride_wn + offs_k, mask=offs_k < K, other=0.0)
        v = tl.sum(w.to(tl.float32) * x, axis=0).to(dtype).to(tl.float32)
        better = (v > best) | ((v == best) & (col < best_col))
        best, best_col = tl.where(better, v, best), tl.where(better, col, best_col)
        cand &= offs_c != c
    tl.store(best_ptr + row * tl.num_programs(0) + tl.program_id(0), best)
    tl.store(idx_ptr + row * tl.num_programs(0) + tl.program_id(0), best_col)


def screen_weight(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """An LM head's 8-bit copy for :func:`screened_argmax`: ``(q [V, K] int8, aux [2, V] float32)``,
    each row of ``weight [V, K]`` rounded to multiples of ``aux[0]`` (its absolute maximum / 127),
    and ``aux[1]`` a bound on ``|x . (w - aux[0] q)| / ||x||`` (Cauchy-Schwarz) with slack for
    both passes' float32 sums: ``||w - aux[0] q|| (1 + 2^-10) + K 2^-21 ||w||``, four times their
    round-to-nearest worst case ``2 K 2^-24 ||x|| ||w||`` (Higham, "Accuracy and Stability of
    Numerical Algorithms", 2nd ed., section 3.1), twice it where tensor cores truncate (Fasi et
    al., "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021). Half the head's bytes more
    (262 MB for Llama-3.2-1B's); built ``rows`` rows at a time, the cache's temporaries freed."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    aux = torch.empty(2, weight.shape[0], dtype=torch.float32, device=weight.device)
    slack = weight.shape[1] * 2.0**-21
    for i in range(0, weight.shape[0], rows):
        w = weight[i : i + rows].float()
        scale = w.abs().amax(1).clamp_min(1e-30) / 127
        q[i : i + rows] = (w / scale[:, None]).round_().clamp_(-127, 127)
        err = (w - q[i : i + rows].float() * scale[:, None]).norm(dim=1)
        aux[:, i : i + rows] = torch.stack([scale, err * (1 + 2**-10) + w.norm(dim=1) * slack])
    if weight.is_cuda:
        torch.cuda.empty_cache()  # before the KV cache is sized from the free memory
    return q, aux


def screened_argmax(x: torch.Tensor, weight: torch.Tensor, screen: tuple[torch.Tensor, torch.Tensor],
                    into: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_argmax(x, weight, into)[1]``, greedy tokens of an LM head (the first index of
    each row's largest logit rounded to ``x.dtype``), mostly from its 8-bit copy ``screen``
    (:func:`screen_weight`): a GEMV over ``q`` gives every logit within ``||x||`` times its row's
    bound (and each program's best); a second (:data:`RESCORE_COLUMNS` columns a program) reads
    only the ``weight`` rows whose upper bound, rounded, reaches the greatest lower bound of the
    first pass's programs' best columns, rounded, one at a time, and takes their argmax. Every row
    that can hold the rounded maximum passes (rounding is monotone), so the tokens are the
    unscreened ones (up to float32 summation order, as between any two GEMV configurations); a
    non-finite ``x`` row gets a token of the vocabulary.
    Up to :data:`SCREEN_MAX_ROWS` rows (the GPU test's most) and ``K`` 8192, else, as on the
    torch reference, :func:`linear_argmax`.
    Maximum inner product search's quantize-then-rerank (ScaNN's reordering, Guo et al., arXiv
    1908.10396), exact by the bound. ``x``: [M, K]; ``into``: a contiguous [M] int64 tensor to
    write to; returns [M] int64."""
    if not 0 < x.shape[0] <= SCREEN_MAX_ROWS or x.shape[1] > 8192 or use_reference(x):
        return linear_argmax(x, weight, into)[1]
    assert weight.stride(1) == 1 and x.stride(1) == 1
    centre, top, top_bound = gemv(x, screen[0], SCREEN_CONFIG, screen=screen[1])
    (m, n), p = centre.shape, top.shape[1]
    grid = (triton.cdiv(n, RESCORE_COLUMNS), m)
    best = torch.empty(m, grid[0], dtype=torch.float32, device=x.device)
    cols = torch.empty(m, grid[0], dtype=torch.int32, device=x.device)
    with_pdl = pdl(x)
    _rescore_kernel[grid](best, cols, x, weight, centre, top, top_bound, screen[1], n, x.shape[1], p,
                          x.stride(0), weight.stride(0), BLOCK_C=RESCORE_COLUMNS, BLOCK_P=triton.next_power_of_2(p),
                          BLOCK_K=triton.next_power_of_2(x.shape[1]), PDL=with_pdl, launch_pdl=with_pdl)
    return _merge_argmax(best, cols, into)


def linear_argmax(
    x: torch.Tensor, weight: torch.Tensor, into: tuple[torch.Tensor, int] | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, logits.argmax(-1))`` of ``logits = F.linear(x, weight)`` (an LM head
    and its greedy tokens): ``x`` [M, K], ``weight`` [V, K]; returns ``([M, V] in
    ``x.dtype``, [M] int64)``, the argmax the first index of each row's maximum (with
    ``into``, as :func:`argmax` takes and returns it). One :func:`gemv` with the argmax epilogue where
    :func:`use_gemv` says so, else the library GEMM and :func:`argmax`."""
    if use_gemv(x, weight):
        return gemv(x, weight, with_argmax=True, argmax_into=into)
    logits = linear(x, weight)
    return logits, argmax(logits, into)
