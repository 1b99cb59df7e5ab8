"""Counter-based random numbers for sampling, one kernel per draw (the idea of Philox, Salmon et
al., SC 2011, with a 32-bit integer hash, ``lowbias32`` by C. Wellons, 2018, as the round function).

Every draw is a pure function of a request's seed, a *key* unique per request and step, a *stream*
id separating uses, and a column index, so a request's draws do not depend on the batch it runs in.
The torch reference chains ~50 elementwise operations; the Triton kernel does the same integer
arithmetic in registers, in one launch, and writes the draws once (bits, uniforms or exponentials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B

MODE_BITS, MODE_UNIFORM, MODE_EXPONENTIAL = 0, 1, 2
"""What :func:`random_draws` returns: the 32-bit hashes (int64), uniforms in ``[0, 1)``
with 24-bit resolution (float32), or ``Exp(1)`` draws (float32, all positive)."""


@triton.jit
def _mix32(x):
    # x: uint32; multiplications wrap modulo 2**32.
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def draw_bits(seed, key, stream_hash, cols):
    """The uint32 hashes of columns ``cols`` for one request (``seed``, ``key``: int64
    scalars; ``stream_hash``: ``mix32(stream)``), for kernels that draw inline."""
    seed = seed.to(tl.uint64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row = _mix32(lo ^ stream_hash.to(tl.uint32))
    row = _mix32(row ^ hi)
    row = _mix32(row ^ (key.to(tl.uint64) & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(row ^ (cols.to(tl.uint32) * tl.full((), 0x9E3779B1, tl.uint32)))


@triton.jit
def _random_kernel(
    out_ptr,  # [num_reqs, num_cols] int64 or float32
    seeds_ptr,  # [num_reqs] int64
    keys_ptr,  # [num_reqs] int64
    stream_hash,  # mix32(stream), a host constant in [0, 2**32)
    num_cols, stride_out, MODE: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    h = draw_bits(tl.load(seeds_ptr + req), tl.load(keys_ptr + req), stream_hash, cols)
    if MODE == 0:
        tl.store(out_ptr + req * stride_out + cols, h.to(tl.int64), mask=mask)
    else:
        u = (h >> 8).to(tl.float32)
        if MODE == 1:
            tl.store(out_ptr + req * stride_out + cols, u * (1.0 / 16777216.0), mask=mask)
        else:
            e = -tl.log((u + 0.5) * (1.0 / 16777216.0))
            tl.store(out_ptr + req * stride_out + cols, e, mask=mask)


def random_draws(seeds: torch.Tensor, keys: torch.Tensor, stream: int, num_cols: int,
                 mode: int) -> torch.Tensor:
    """``[num_reqs, num_cols]`` draws, a pure function of ``(seeds[i], keys[i], stream, column)``.

    Args:
        seeds: [num_reqs] int64 (any value; both 32-bit halves are mixed in).
        keys: [num_reqs] int64 in ``[0, 2**32)`` (higher bits are ignored).
        stream: a small non-negative int separating independent uses.
        num_cols: draws per request.
        mode: :data:`MODE_BITS` (int64 in ``[0, 2**32)``), :data:`MODE_UNIFORM` or
            :data:`MODE_EXPONENTIAL` (float32).

    Returns:
        [num_reqs, num_cols] int64 or float32, contiguous.

    Raises:
        AssertionError: shapes or dtypes do not match the above, or an unknown ``mode``.
    """
    assert seeds.ndim == 1 and seeds.dtype == torch.int64 and seeds.is_contiguous()
    assert keys.shape == seeds.shape and keys.dtype == torch.int64 and keys.is_contiguous()
    assert mode in (MODE_BITS, MODE_UNIFORM, MODE_EXPONENTIAL)
    num_reqs = seeds.shape[0]
    dtype = torch.int64 if mode == MODE_BITS else torch.float32
    if use_reference(seeds):
        return random_draws_reference(seeds, keys, stream, num_cols, mode)
    out = torch.empty(num_reqs, num_cols, dtype=dtype, device=seeds.device)
    if num_reqs == 0 or num_cols == 0:
        return out
    block = min(1024, max(16, triton.next_power_of_2(num_cols)))
    _random_kernel[(num_reqs, triton.cdiv(num_cols, block))](
        out, seeds, keys, mix32(stream & _M32), num_cols, out.stride(0), MODE=mode, BLOCK=block)
    return out


def _mul32(x, c: int):
    # (x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow: 16-bit halves.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def mix32(x):
    """``lowbias32`` of a host integer, or of an int64 tensor, in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def random_draws_reference(seeds: torch.Tensor, keys: torch.Tensor, stream: int, num_cols: int,
                           mode: int) -> torch.Tensor:
    """Torch reference of :func:`random_draws` (same arguments and results; the
    exponentials agree to float32 rounding of the logarithm)."""
    row = mix32((seeds & _M32) ^ mix32(stream & _M32))
    row = mix32(row ^ ((seeds >> 32) & _M32))
    row = mix32(row ^ (keys & _M32))  # [num_reqs]
    cols = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)
    bits = mix32(row[:, None] ^ _mul32(cols, _GOLDEN)[None, :])
    if mode == MODE_BITS:
        return bits
    u = (bits >> 8).float()
    if mode == MODE_UNIFORM:
        return u * (1.0 / (1 << 24))
    return -torch.log((u + 0.5) * (1.0 / (1 << 24)))
