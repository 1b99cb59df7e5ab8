"""Rotary position embedding (RoFormer, arXiv 2104.09864) applied in place, "rotate half"
(GPT-NeoX) layout, as :func:`specula.runtime.models.layers.apply_rotary`.

The first ``rotary_dim`` channels of each head are split into halves ``x1, x2`` and
become ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``; channels past ``rotary_dim``
(partial rotary) pass through. ``cos`` and ``sin`` come from a table indexed by position,
laid out as vLLM's ``cos_sin_cache``: ``[max_position, rotary_dim]`` holding
``cos(pos * inv_freq)`` in the first half and ``sin(pos * inv_freq)`` in the second.
Arithmetic is float32, rounded once to the activation dtype.

:func:`rotary_embedding_and_cache` fuses the rotation with the write of the new keys and
values into the paged KV cache (:func:`~.reshape_and_cache.reshape_and_cache`, vLLM's slot
mapping, negative slots skipped): one launch, one program per token, so a decode step pays
one small kernel per layer for both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import FLOATS, pdl, use_reference, wait_for_previous_kernel
from specula.runtime.kernels.reshape_and_cache import check_cache_write, reshape_and_cache_reference


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` table for ``inv_freq [rotary_dim // 2]`` (e.g.
    :attr:`specula.runtime.models.layers.RotaryEmbedding.inv_freq`), computed in float32
    as the model layer does and kept in float32: the kernels compute in float32 and round
    once, closer to the float32 reference than with a table in the activation dtype."""
    positions = torch.arange(max_position, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_position, rotary_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@triton.jit
def rotate_half_in_place(ptrs, mask, cos, sin, HALF: tl.constexpr):
    """Rotate the ``[heads, BLOCK_HALF]`` first halves at ``ptrs`` with the second halves
    at ``ptrs + HALF``, in float32, and store them back in the element dtype; returns the
    stored halves ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``."""
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(dtype)
    r2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptrs, r1, mask=mask)
    tl.store(ptrs + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _slot_ptrs(cache_ptr, block, offset, offs_h, offs_r, stride_b, stride_s, stride_h):
    """The ``[heads, BLOCK_HALF]`` first-half pointers of one cache slot."""
    base = cache_ptr + block * stride_b + offset * stride_s
    return base + offs_h[:, None] * stride_h + offs_r[None, :]


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    slot_mapping_ptr,  # [num_tokens] int64, read when WRITE_CACHE
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], read when HAS_KEY
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], read when WRITE_CACHE
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], when WRITE_CACHE
    value_cache_ptr,
    cos_sin_ptr,  # [max_position, rotary_dim]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # token, head
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,  # block, slot, head
    stride_cs, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr, HAS_KEY: tl.constexpr, WRITE_CACHE: tl.constexpr, PDL: tl.constexpr,
):
    # One program per token; WRITE_CACHE (full rotary only) also writes the rotated key
    # and the value to the token's cache slot (:func:`rotary_embedding_and_cache`).
    token = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    pos = tl.load(positions_ptr + token)
    offs_r = tl.arange(0, BLOCK_HALF)
    r_valid = offs_r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_r, mask=r_valid, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_r, mask=r_valid, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & r_valid[None, :]
    ptrs = query_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_r[None, :]
    rotate_half_in_place(ptrs, mask, cos, sin, HALF)
    if HAS_KEY:
        offs_kh = tl.arange(0, BLOCK_KH)
        kmask = (offs_kh < NUM_KV_HEADS)[:, None] & r_valid[None, :]
        kptrs = key_ptr + token * stride_kt + offs_kh[:, None] * stride_kh + offs_r[None, :]
        r1, r2 = rotate_half_in_place(kptrs, kmask, cos, sin, HALF)
        if WRITE_CACHE:
            slot = tl.load(slot_mapping_ptr + token)
            # A padding token (negative slot) writes nothing to the cache.
            cache_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
            cmask = (offs_kh < cache_heads)[:, None] & r_valid[None, :]
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            kc_ptrs = _slot_ptrs(key_cache_ptr, block, offset, offs_kh, offs_r, stride_kcb,
                                 stride_kcs, stride_kch)
            tl.store(kc_ptrs, r1, mask=cmask)
            tl.store(kc_ptrs + HALF, r2, mask=cmask)
            v_ptrs = value_ptr + token * stride_vt + offs_kh[:, None] * stride_vh + offs_r[None, :]
            v1 = tl.load(v_ptrs, mask=cmask, other=0.0)
            v2 = tl.load(v_ptrs + HALF, mask=cmask, other=0.0)
            vc_ptrs = _slot_ptrs(value_cache_ptr, block, offset, offs_kh, offs_r, stride_vcb,
                                 stride_vcs, stride_vch)
            tl.store(vc_ptrs, v1, mask=cmask)
            tl.store(vc_ptrs + HALF, v2, mask=cmask)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate ``query`` and ``key`` in place by their tokens' positions.

    Args:
        positions: [num_tokens] int64, each < ``max_position``.
        query: [num_tokens, num_heads, head_dim]; last dim contiguous (a view into a fused
            qkv output is fine).
        key: [num_tokens, num_kv_heads, head_dim] in ``query.dtype``, or ``None`` for
            layers that only have queries.
        cos_sin_cache: [max_position, rotary_dim] from :func:`build_cos_sin_cache`;
            ``rotary_dim`` even and <= ``head_dim``.
        cache: ``(value, key_cache, value_cache, slot_mapping)``: also write the rotated
            keys and the values to the paged cache; for
            :func:`rotary_embedding_and_cache`, which checks them.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert positions.ndim == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
    assert query.ndim == 3 and query.stride(-1) == 1 and query.dtype in FLOATS
    assert cos_sin_cache.ndim == 2 and cos_sin_cache.stride(-1) == 1
    num_tokens, num_heads, head_dim = query.shape
    assert positions.shape[0] == num_tokens
    if key is not None:
        assert key.ndim == 3 and key.stride(-1) == 1 and key.dtype == query.dtype
        assert key.shape[0] == num_tokens and key.shape[2] == head_dim
    half = cos_sin_cache.shape[1] // 2
    assert 2 * half == cos_sin_cache.shape[1] <= head_dim
    if num_tokens == 0:
        return
    if use_reference(query):
        _reference_in_place(positions, query, key, cos_sin_cache, cache)
        return
    k = key if key is not None else query
    num_kv_heads = 1 if key is None else key.shape[1]
    # Without WRITE_CACHE the slot mapping, value and cache pointers are never read.
    value, key_cache, value_cache, slot_mapping = cache or (k, k, k, positions)
    strides = (0,) * 8
    if cache is not None:
        strides = (*value.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3])
    with_pdl = pdl(query)
    _rotary_kernel[(num_tokens,)](
        positions, slot_mapping, query, k, value, key_cache, value_cache, cos_sin_cache,
        *query.stride()[:2], *k.stride()[:2], *strides, cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_SIZE=1 if cache is None else key_cache.shape[1],
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads), HAS_KEY=key is not None,
        WRITE_CACHE=cache is not None, PDL=with_pdl, enable_fp_fusion=True, launch_pdl=with_pdl)


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``query`` and ``key`` in place (the attention that follows reads the query,
    and a prefill attends over the new keys directly), then write the rotated keys and
    ``value`` into their cache slots.

    Args:
        positions, query, key: as :func:`rotary_embedding` (``key`` [num_tokens,
            num_kv_heads, head_dim] required).
        value, key_cache, value_cache, slot_mapping: as
            :func:`~specula.runtime.kernels.reshape_and_cache.reshape_and_cache`, in
            ``query.dtype``; negative slots write nothing.
        cos_sin_cache: [max_position, head_dim] (full rotary only: ``rotary_dim ==
            head_dim``, as Llama and Qwen3) from :func:`build_cos_sin_cache`.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above (including a
            partial rotary table: use the two separate kernels for those).
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    assert cos_sin_cache.shape[-1] == query.shape[-1], "full rotary only"
    cache = (value, key_cache, value_cache, slot_mapping)
    rotary_embedding(positions, query, key, cos_sin_cache, cache)


def rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`rotary_embedding`: returns rotated copies
    ``(query, key or None)`` instead of writing in place."""
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions].float().split(half, dim=-1)  # [num_tokens, half] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x[..., 2 * half :]), dim=-1)
    return rotate(query), None if key is None else rotate(key)


def rotary_embedding_and_cache_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Torch reference of :func:`rotary_embedding_and_cache` (same arguments, in place):
    the two unfused references one after the other."""
    cache = (value, key_cache, value_cache, slot_mapping)
    _reference_in_place(positions, query, key, cos_sin_cache, cache)


def _reference_in_place(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """:func:`rotary_embedding_reference` written back into ``query`` and ``key``, then,
    with ``cache``, :func:`reshape_and_cache_reference` of the rotated keys."""
    q, k = rotary_embedding_reference(positions, query, key, cos_sin_cache)
    query.copy_(q)
    if key is not None:
        key.copy_(k)
    if cache is not None:
        reshape_and_cache_reference(key, *cache)
