"""One-shot all-reduce over peer-mapped memory, fused with the residual add and RMSNorm after a
row-parallel layer or a vocabulary-parallel embedding (Megatron-LM, arXiv 1909.08053). A program
first stores all its partial rows into this rank's slot of every peer's buffer
(``torch.distributed._symmetric_memory``, NVLink), so that its waits overlap, then sums each row's
parts from its own buffer with its own, in rank order in float32: the ranks agree bit for bit.

The data are their own flags (the Lamport-style one-shot all-reduce of TensorRT-LLM's
``customAllReduceKernels``, after vLLM's custom all-reduce, PR #2192): a free slot holds
``-0.0`` in every element and a sender writes ``-0.0`` as ``+0.0``, so a reader spins on
its slot with volatile loads until no element is ``-0.0``, then frees it. Each row
alternates between two halves of the buffer (a per-row parity flipped at each launch of the
row, the same on every rank): a peer writes a half again two launches of the row later,
after it has read this rank's rows of the launch between, stored after the reset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import INTERPRET, pdl, wait_for_previous_kernel

MAX_PROGRAMS = 64
"""Programs of one launch; rows beyond loop."""

TIMEOUT_S = 300
"""A program waiting longer for a peer's rows traps (NCCL's watchdog would abort the
collective after 600 s): a dead or diverged rank fails the launch instead of hanging."""


@triton.jit
def _rank_ptr(table_ptr, rank, dtype: tl.constexpr):
    """Rank ``rank``'s buffer, from the table of every rank's addresses (16-byte aligned:
    the hint lets row accesses be vectorised)."""
    return tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _nanoseconds(ptr, ON: tl.constexpr):
    """The GPU's global timer (ns), 0 if not ``ON`` (the interpreter has none); ``ptr``
    only gives the call a shape."""
    t = tl.full((), 0, tl.int64)
    if ON:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ptr],
                                      dtype=tl.int64, is_pure=False, pack=1)
    return t


@triton.jit
def _is_free(v):
    """Elements of ``v`` that are ``-0.0`` (a slot's free mark)."""
    return (v == 0.0) & (v.to(tl.float32).to(tl.int32, bitcast=True) < 0)  # the sign bit


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    out_ptr,  # [num_rows, HIDDEN]
    residual_out_ptr,  # [num_rows, HIDDEN], out's strides
    x_ptr,  # [num_rows, HIDDEN], this rank's partial sums
    residual_ptr,  # HAS_RESIDUAL: [num_rows, HIDDEN]
    weight_ptr,  # [HIDDEN]
    buffers_ptr,  # [WORLD] int64: every rank's buffer, [2, WORLD, max_rows, HIDDEN] x's dtype
    launches_ptr,  # [max_rows] int32, each row's half: the parity of its launches so far
    rank, max_rows, num_rows, eps, stride_x, stride_res, stride_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr,
    TIMEOUT_NS: tl.constexpr, PDL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    wait_for_previous_kernel(PDL)
    my_buffer = _rank_ptr(buffers_ptr, rank, dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # -0.0 from its bits: a float constant equal to 0 may be built as +0.0 (triton 3.6)
    free = tl.full((BLOCK,), -2147483648, tl.int32).to(tl.float32, bitcast=True).to(dtype)
    for phase in tl.static_range(2):  # my rows out first, then wait: the waits overlap
        for row in range(pid, num_rows, tl.num_programs(0)):
            launch = tl.load(launches_ptr + row)  # 0 or 1 (a count would overflow int32)
            half = launch.to(tl.int64) * WORLD * max_rows * HIDDEN
            mine = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            mine = tl.where(mine == 0.0, 0.0, mine).to(dtype)  # -0.0 -> +0.0: never "free"
            if phase == 0:
                for peer in tl.static_range(WORLD):  # my row into my slot of each peer's buffer
                    if peer != rank:
                        slot = _rank_ptr(buffers_ptr, peer, dtype) + half + (rank * max_rows + row) * HIDDEN
                        tl.store(slot + cols, mine, mask=mask)
            else:
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for r in tl.static_range(WORLD):  # rank order on every rank: equal sums
                    if r == rank:
                        part = mine
                    else:  # the peer's row, once every element has landed
                        ptrs = my_buffer + half + (r * max_rows + row) * HIDDEN + cols
                        part = tl.load(ptrs, mask=mask, other=1.0, volatile=True)
                        start = _nanoseconds(launches_ptr, TIMEOUT_NS > 0)
                        while tl.sum(_is_free(part).to(tl.int32), axis=0) > 0:  # (TIMEOUT_NS 0: none)
                            if _nanoseconds(launches_ptr, TIMEOUT_NS > 0) - start > TIMEOUT_NS:
                                tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r,l", [launches_ptr],  # abort:
                                                          dtype=tl.int32, is_pure=False, pack=1)  # fails on the host
                            part = tl.load(ptrs, mask=mask, other=1.0, volatile=True)
                        tl.store(ptrs, free, mask=mask)  # free again
                    acc += tl.where(mask, part.to(tl.float32), 0.0)  # columns past HIDDEN read 1.0
                # The sum rounded once (as NCCL's for two ranks), the add as fused_add_rms_norm's.
                x = acc.to(dtype)
                if HAS_RESIDUAL:
                    res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
                    x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
                tl.store(residual_out_ptr + row * stride_out + cols, x, mask=mask)
                xf = x.to(tl.float32)
                y = w * (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)).to(dtype).to(tl.float32)
                tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)
                tl.store(launches_ptr + row, 1 - launch)
        tl.debug_barrier()  # every thread read the parities before any is flipped


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, buffers: torch.Tensor, launches: torch.Tensor,
                            rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``stream = sum over ranks(x) + residual``; ``(rms_norm(stream) * weight, stream)``
    in one kernel (as :func:`~specula.runtime.kernels.layernorm.fused_add_rms_norm`).
    Collective: every rank calls it with ``x`` of the same shape, in the same order.

    Args:
        x: [num_rows, hidden] bfloat16/float16/float32 on CUDA, this rank's partial sums (a
            row-parallel layer's output), rows dense; residual: like ``x``, or ``None`` (a
            vocabulary-parallel embedding's rows: ``stream`` is their sum); weight: [hidden].
        buffers: [world_size] int64, every rank's buffer's address, ``[2, world_size,
            max_rows, hidden]`` of ``x.dtype`` in one symmetric allocation, all ``-0.0``
            at first: slot ``[h, r]`` takes rank ``r``'s rows at launches of parity ``h``.
        launches: [max_rows] int32 on this rank's device, zeros at first: each row's
            parity of launches (``num_rows <= max_rows``).

    Returns:
        ``(out, stream)``, both [num_rows, hidden] in ``x.dtype``.

    Raises:
        AssertionError: shapes, dtypes or layouts unlike the above.
    """
    n, hidden = x.shape
    max_rows = launches.shape[0]
    assert hidden * x.element_size() % 16 == 0 and hidden >= 32, "rows of 16-byte multiples, >= 32"
    has_residual, residual = residual is not None, x if residual is None else residual
    assert n <= max_rows and x.stride(1) == 1 and residual.shape == x.shape and residual.stride(1) == 1
    assert weight.shape == (hidden,) and weight.dtype == x.dtype == residual.dtype
    assert launches.dtype == torch.int32 and launches.device == x.device
    out, stream = torch.empty_like(x), torch.empty_like(x)
    if n == 0:
        return out, stream
    block = triton.next_power_of_2(hidden)
    with_pdl = pdl(x)
    _all_reduce_add_rms_norm_kernel[(min(n, MAX_PROGRAMS),)](
        out, stream, x, residual, weight, buffers, launches, rank, max_rows, n, eps,
        x.stride(0), residual.stride(0), out.stride(0), HIDDEN=hidden, BLOCK=block,
        WORLD=buffers.shape[0], TIMEOUT_NS=0 if INTERPRET else TIMEOUT_S * 10**9, PDL=with_pdl,
        HAS_RESIDUAL=has_residual,
        # At least one column per thread: no copies of a column polled in other warps.
        num_warps=min(16, max(4, block // 512), block // 32), launch_pdl=with_pdl)
    return out, stream
