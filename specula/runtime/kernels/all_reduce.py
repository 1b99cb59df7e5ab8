"""One-shot all-reduce over peer-mapped (symmetric) memory, fused with the residual add
and RMSNorm that follow a row-parallel layer (Megatron-LM, arXiv 1909.08053).

Between a decoder's sublayers, tensor parallelism sums the ranks' partial outputs, adds
the residual stream and normalises: with NCCL that is a collective kernel and a norm
kernel, ~8.6 + 2.2 us at batch 32 on two H100s. Here one kernel does all three. Each
rank stores its partial rows into its slot of every peer's buffer in a symmetric
allocation (``torch.distributed._symmetric_memory``: every rank's buffer mapped into
every rank's address space over NVLink), raises a flag in each peer's flags, waits for
theirs, and sums its own rows and the peers' from local memory: one exchange of flags,
writes posted over NVLink, no remote read on the way. The sum runs in rank order in float32 on every rank, so the ranks agree bit for
bit. The design is vLLM's custom all-reduce (``csrc/custom_all_reduce.cuh``, vLLM
PR #2192) in Triton.

Flags, ``int32 [2, MAX_PROGRAMS, world_size]`` per rank, used by program ``p`` of a
launch and only by it (every rank launches the same grid on the same rows):

- ``ready[p][src]``: ``src`` has stored its rows of ``p`` into the owner's buffer. Raised by
  ``src`` (release), consumed by the owner (acquire, set back to 0).
- ``done[p][src]``: ``src`` has finished reading the owner's rows of ``p`` in its buffer.
  Raised by ``src`` at the end of a launch, consumed by the owner at the start of the next
  before it overwrites them; starts at 1. Waiting for it costs nothing in the common
  case, since the peer raised it a whole sublayer earlier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import pdl, wait_for_previous_kernel

MAX_PROGRAMS = 64
"""Programs of one launch (each holds flags of its own); rows beyond loop."""

TIMEOUT_S = 300
"""A program waiting longer for a peer's flag traps (NCCL's watchdog would abort the
collective after 600 s): a dead or diverged rank fails the launch instead of hanging."""


@triton.jit
def _rank_ptr(table_ptr, rank, dtype: tl.constexpr):
    """Rank ``rank``'s buffer, from the table of every rank's addresses (16-byte aligned:
    the hint lets row accesses be vectorised)."""
    return tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _load_acquire(ptr):
    """``*ptr`` (int32) loaded with acquire semantics at system scope, by every thread."""
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _nanoseconds(ptr):
    """The GPU's global timer (ns); ``ptr`` only gives the call a shape."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ptr],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap(ptr):
    """Abort the kernel (the launch fails with an error on the host)."""
    tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _store_release(ptr, value):
    """``*ptr = value`` (int32) with release semantics at system scope, by thread 0 of the
    program only (after a barrier its release covers the program's stores), not waited
    for."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 tid;\n\tmov.u32 tid, %tid.x;\n\t"
        "setp.eq.u32 first, tid, 0;\n\t@first st.release.sys.global.b32 [$1], $2;\n\t}"
        "\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_peers(flags, rank, WORLD: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    """Spin until every peer's flag ``flags[peer]`` is 1, then set them back to 0 (after
    a barrier: no thread may see the reset before it has seen the 1). A peer silent for
    ``TIMEOUT_NS`` (dead, or on another code path) traps: the launch fails instead of
    spinning for ever."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            start = _nanoseconds(flags)
            while _load_acquire(flags + peer) != 1:
                if _nanoseconds(flags) - start > TIMEOUT_NS:
                    _trap(flags)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            tl.store(flags + peer, 0)


@triton.jit
def _signal_peers(flags_ptr, offset, rank, WORLD: tl.constexpr):
    """Raise flag ``offset + rank`` in every peer's flags (release: this program's stores
    before it, ordered by the barrier, are visible to a peer that sees it)."""
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            _store_release(tl.load(flags_ptr + peer).to(tl.pointer_type(tl.int32)) + offset + rank, 1)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    out_ptr,  # [num_rows, HIDDEN]
    residual_out_ptr,  # [num_rows, HIDDEN], out's strides
    x_ptr,  # [num_rows, HIDDEN], this rank's partial sums
    residual_ptr,  # [num_rows, HIDDEN]
    weight_ptr,  # [HIDDEN]
    buffers_ptr,  # [WORLD] int64: every rank's buffer, [WORLD, max_rows, HIDDEN] x's dtype
    flags_ptr,  # [WORLD] int64: every rank's flags, [2, MAX_PROGRAMS, WORLD] int32
    rank, max_rows, num_rows, eps, stride_x, stride_res, stride_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr,
    NUM_FLAGS: tl.constexpr,  # MAX_PROGRAMS * WORLD
    TIMEOUT_NS: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    wait_for_previous_kernel(PDL)
    my_buffer = _rank_ptr(buffers_ptr, rank, dtype)
    my_flags = _rank_ptr(flags_ptr, rank, tl.int32) + pid * WORLD
    _wait_peers(my_flags + NUM_FLAGS, rank, WORLD, TIMEOUT_NS)  # the peers are done with my rows
    for row in range(pid, num_rows, step):  # my rows into my slot of each peer's buffer
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                slot = _rank_ptr(buffers_ptr, peer, dtype) + (rank * max_rows + row) * HIDDEN
                tl.store(slot + cols, x, mask=mask)
    _signal_peers(flags_ptr, pid * WORLD, rank, WORLD)  # my rows are in
    _wait_peers(my_flags, rank, WORLD, TIMEOUT_NS)  # and theirs
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, step):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order on every rank: equal sums
            if r == rank:
                part = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            else:  # local memory: the acquire above ordered the peer's stores before it
                part = tl.load(my_buffer + (r * max_rows + row) * HIDDEN + cols, mask=mask,
                               other=0.0)
            acc += part.to(tl.float32)
        res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # The sum rounded once (as NCCL's for two ranks), then the add as
        # fused_add_rms_norm rounds it.
        x = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_out + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
        y = w * (xf * rstd).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)
    _signal_peers(flags_ptr, NUM_FLAGS + pid * WORLD, rank, WORLD)  # done reading


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    buffers: torch.Tensor, flags: torch.Tensor, rank: int, max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stream = sum over ranks(x) + residual``; ``(rms_norm(stream) * weight, stream)``
    in one kernel (Llama's RMSNorm convention, as
    :func:`~specula.runtime.kernels.layernorm.fused_add_rms_norm`). Collective: every
    rank of the group calls it with ``x`` of the same shape, in the same order.

    Args:
        x: [num_rows, hidden] bfloat16/float16/float32 on CUDA, this rank's partial
            sums (a row-parallel layer's output); rows dense.
        residual: [num_rows, hidden] like ``x``, the residual stream; weight: [hidden].
        buffers: [world_size] int64, the address of every rank's buffer, ``[world_size,
            max_rows, hidden]`` of ``x.dtype`` in one symmetric allocation: slot ``r``
            takes rank ``r``'s rows (``num_rows <= max_rows``).
        flags: [world_size] int64, the address of every rank's flags, int32
            ``[2, MAX_PROGRAMS, world_size]``, the ``done`` half set to 1 before first use.
        rank: this process's rank.

    Returns:
        ``(out, stream)``, both [num_rows, hidden] in ``x.dtype``.

    Raises:
        AssertionError: shapes, dtypes or layouts unlike the above.
    """
    n, hidden = x.shape
    assert hidden * x.element_size() % 16 == 0, "rows must be 16-byte multiples"
    assert n <= max_rows and x.stride(1) == 1 and residual.shape == x.shape and residual.stride(1) == 1
    assert weight.shape == (hidden,) and weight.dtype == x.dtype == residual.dtype
    out, stream = torch.empty_like(x), torch.empty_like(x)
    if n == 0:
        return out, stream
    world = buffers.shape[0]
    block = triton.next_power_of_2(hidden)
    with_pdl = pdl(x)
    _all_reduce_add_rms_norm_kernel[(min(n, MAX_PROGRAMS),)](
        out, stream, x, residual, weight, buffers, flags, rank, max_rows, n, eps,
        x.stride(0), residual.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK=block, WORLD=world, NUM_FLAGS=MAX_PROGRAMS * world,
        TIMEOUT_NS=TIMEOUT_S * 10**9, PDL=with_pdl, num_warps=min(16, max(4, block // 512)), launch_pdl=with_pdl,
    )
    return out, stream
