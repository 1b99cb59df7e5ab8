"""Paged attention for decode and for the (k + 1)-token verification query.

The KV cache uses vLLM's paged layout: ``key_cache, value_cache [num_blocks, block_size,
num_kv_heads, head_dim]``; request ``i`` owns the blocks listed in ``block_table[i]``, so its
token ``t`` lives in block ``block_table[i, t // block_size]`` at offset ``t % block_size``.
Every request has the same query length ``q_len`` (1 for decode, ``k + 1`` for verifying ``k``
draft tokens); its query tokens are the last ``q_len`` of its ``seq_lens[i]`` context tokens,
and query token ``j`` sees keys ``[0, seq_lens[i] - q_len + j]`` (causal within the query).

With a sliding window ``W`` (Mistral, Gemma 2-4 sliding layers) a query at position ``p``
sees only keys at positions ``(p - W, p]``: its own and the ``W - 1`` before it, the
convention of Hugging Face ``sliding_window_overlay`` (``kv_idx > q_idx - W``) and of
:func:`specula.runtime.models.attention.with_sliding_window`. The loop over keys then
starts at the window of the request's first query token instead of at 0, so a long
context costs no more than ``W + q_len - 1`` keys.

One program handles the ``q_len * (num_heads // num_kv_heads)`` query rows that share a KV head, so
each key/value tile is read once for the whole GQA group and every query token (that read is what
bounds decode); at large decode batches, those of two adjacent KV heads (``pack``). Long
contexts are split across programs (flash-decoding: Dao et al.,
https://crfm.stanford.edu/2023/10/12/flashdecoding.html): each split writes a partial output and its
log-sum-exp, and a second kernel merges them, so a batch-1 decode still fills the GPU. Online
softmax as in FlashAttention (arXiv 2205.14135), in base 2.

With ``new_kv`` the step's keys and values are not in the cache yet: the kernel rotates the query
tile (RoFormer, arXiv 2104.09864, as :mod:`~.rotary`), the last split of each KV head attends to the
rotated new keys straight from the qkv output and writes them to the cache, in place of a rotary
kernel before it (up to four programs per SM; past that the rotary kernel runs first).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import FLOATS, pdl, use_reference, wait_for_previous_kernel
from specula.runtime.kernels.reshape_and_cache import check_cache_write

_MIN_TOKENS_PER_SPLIT = 128
"""A split reads at least this many keys: fewer would cost more in the merge than the
extra parallelism gains."""
_MAX_SPLITS = 64
_BLOCK_N = 64
"""Keys per inner-loop tile at most (:func:`_block_n`)."""
_HOPPER_SMEM_BYTES = 232448
"""Shared memory one program may take on an H100/H200 (``shared_memory_per_block_optin``);
the CPU interpreter sizes tiles as for that GPU."""
_MAX_BLOCK_M = 64
"""Query rows (query tokens x heads of a GQA group) per program."""


@triton.jit
def _rotated(ptrs, mask, pos, cos_sin_ptr, stride_cs, offs_d, HALF: tl.constexpr):
    """The ``[rows, BLOCK_D]`` head vectors at ``ptrs`` rotated by their rows' positions
    ``pos`` ("rotate half", as :mod:`~.rotary` computes it: float32, rounded once)."""
    first = offs_d < HALF
    x = tl.load(ptrs, mask=mask, other=0.0)
    xp = tl.load(ptrs + tl.where(first, HALF, -HALF)[None, :], mask=mask, other=0.0)
    cs = cos_sin_ptr + pos[:, None] * stride_cs + (offs_d % HALF)[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    return tl.where(first[None, :], xf * cos - xpf * sin, xf * cos + xpf * sin).to(x.dtype)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, offs_n, n_valid, key_limit, key_start, scale_log2,
                 INPUT_PRECISION: tl.constexpr, SLIDING: tl.constexpr):
    """One key tile of the online softmax: keys ``k`` and values ``v`` [BLOCK_N, BLOCK_D]
    at positions ``offs_n``; returns the updated ``(acc, m_i, l_i)``."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
    visible = n_valid[None, :] & (offs_n[None, :] < key_limit[:, None])
    if SLIDING:
        visible = visible & (offs_n[None, :] >= key_start[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps -inf; subtracting 0 then keeps exp2 at 0
    # instead of producing NaN from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, base-2
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    key_ptr,  # NEW_KV: [num_tokens, num_kv_heads, head_dim], the new keys, unrotated
    value_ptr,  # NEW_KV: [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # NEW_KV: [num_tokens] int64
    slot_mapping_ptr,  # NEW_KV: [num_tokens] int64, negative: no cache write
    cos_sin_ptr,  # NEW_KV: [max_position, head_dim] float32
    scale_log2,  # softmax scale * log2(e)
    q_len, sliding_window,  # keys per query when SLIDING (its own position included)
    num_heads, num_m_blocks,
    stride_qt, stride_qh, stride_ot, stride_oh,  # query, out: token, head
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,  # caches: block, slot, head
    stride_bt, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cs,
    GROUP_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, SLIDING: tl.constexpr, NEW_KV: tl.constexpr, PDL: tl.constexpr,
    PACK: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // num_m_blocks * PACK  # the first of the program's PACK KV heads
    m_block = tl.program_id(1) % num_m_blocks
    split = tl.program_id(2)

    # Row m of the tile is query token m // (GROUP_SIZE * PACK), head m % (GROUP_SIZE * PACK)
    # of the pack's heads; column c is dimension c % BLOCK_D of the pack's KV head c // BLOCK_D.
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < q_len * GROUP_SIZE * PACK
    q_idx = offs_m // (GROUP_SIZE * PACK)
    head = kv_head * GROUP_SIZE + offs_m % (GROUP_SIZE * PACK)
    token = req * q_len + q_idx
    offs_d = tl.arange(0, BLOCK_D * PACK)
    dim = offs_d % BLOCK_D
    d_valid = dim < HEAD_DIM
    own = (offs_d // BLOCK_D)[None, :] == (offs_m % (GROUP_SIZE * PACK) // GROUP_SIZE)[:, None]

    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :]
    q_mask = row_valid[:, None] & d_valid[None, :]
    if NEW_KV:
        pos = tl.load(positions_ptr + token, mask=row_valid, other=0)
        q = _rotated(q_ptrs, q_mask, pos, cos_sin_ptr, stride_cs, offs_d, HEAD_DIM // 2)
    else:  # with PACK > 1 block-diagonal: a row's scores and output take its own KV head's columns
        q = tl.load(q_ptrs, mask=q_mask & own, other=0.0)

    seq_len = tl.load(seq_lens_ptr + req)
    # Keys [0, key_limit) are visible to each row; padded rows see none.
    key_limit = tl.where(row_valid, seq_len - q_len + q_idx + 1, 0)
    ctx_end = tl.maximum(tl.max(key_limit, axis=0), 0)
    key_start = key_limit
    if SLIDING:
        # Keys [key_start, key_limit): the window ends at the row's own position.
        key_start = tl.maximum(key_limit - sliding_window, 0)
        ctx_start = tl.min(tl.where(row_valid, key_start, ctx_end), axis=0)
    else:
        ctx_start = 0
    if NEW_KV:  # the cache holds keys before this step's; the last split takes the new ones
        ctx_end = tl.maximum(tl.minimum(ctx_end, seq_len - q_len), ctx_start)
    tokens_per_split = tl.cdiv(tl.cdiv(ctx_end - ctx_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = ctx_start + split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, ctx_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D * PACK], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < split_end
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k_col = offs_d // BLOCK_D * stride_kh + dim
        k = tl.load(key_cache_ptr + k_off[:, None] + k_col[None, :], mask=kv_mask, other=0.0)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v_col = offs_d // BLOCK_D * stride_vh + dim
        v = tl.load(value_cache_ptr + v_off[:, None] + v_col[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, offs_n, n_valid, key_limit,
                                     key_start, scale_log2, INPUT_PRECISION, SLIDING)
    if NEW_KV:
        if split == NUM_SPLITS - 1:  # this step's q_len keys, rotated here; one tile
            offs_j = tl.arange(0, BLOCK_N)
            j_valid = offs_j < tl.where(seq_len > 0, q_len, 0)  # none for padding
            new = req * q_len + offs_j
            kv_mask = j_valid[:, None] & d_valid[None, :]
            k_ptrs = key_ptr + new[:, None] * stride_nkt + kv_head * stride_nkh + offs_d[None, :]
            new_pos = tl.load(positions_ptr + new, mask=j_valid, other=0)
            k = _rotated(k_ptrs, kv_mask, new_pos, cos_sin_ptr, stride_cs, offs_d, HEAD_DIM // 2)
            v_ptrs = value_ptr + new[:, None] * stride_nvt + kv_head * stride_nvh + offs_d[None, :]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, seq_len - q_len + offs_j, j_valid,
                                         key_limit, key_start, scale_log2, INPUT_PRECISION, SLIDING)
            if m_block == 0:  # the cache write, once per KV head (no one reads it this launch)
                slot = tl.load(slot_mapping_ptr + new, mask=j_valid, other=-1)
                w_mask = (slot >= 0)[:, None] & d_valid[None, :]
                c_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
                tl.store(key_cache_ptr + (c_off + kv_head * stride_kh)[:, None] + offs_d[None, :],
                         k, mask=w_mask)
                c_off = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs
                tl.store(value_cache_ptr + (c_off + kv_head * stride_vh)[:, None] + offs_d[None, :],
                         v, mask=w_mask)

    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if PACK > 1:
        acc = tl.sum(tl.reshape(tl.where(own, acc, 0.0), [BLOCK_M, PACK, BLOCK_D]), axis=1)
    offs_d = tl.arange(0, BLOCK_D)
    out_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        # Rows that saw no key (most of a short context's splits) store only their lse.
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=out_mask & has_keys[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, base-2
    num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token, head = tl.program_id(0), tl.program_id(1)
    row = token.to(tl.int64) * num_heads + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    d_valid = offs_d < HEAD_DIM
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # 0 for empty splits, whose outputs are not stored
    parts = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(lse > float("-inf"))[:, None] & d_valid[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    merged = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_valid)


def _block_n(block_m: int, block_d: int, itemsize: int, device: torch.device, split: bool) -> int:
    """Keys per tile: ``_BLOCK_N``, half in a ``split`` launch (bound by each program's chain of
    dependent loads, not its tiles: 8B heads at batch 1, one H100, ``bench/attention.py``, 5.8 ->
    5.2 us a layer at 1 query token, 8.4 -> 6.8 at 7), less where the tiles would exceed the
    device's shared memory (Gemma4's 512-wide heads). The estimate, fitted to Triton 3.6 on an H100:
    ``block_d * itemsize`` bytes per query row and per key and value row (twice for 16-bit keys and
    values, double-buffered), the ``[block_m, block_n]`` score tiles, and 8 KiB of slack."""
    limit = (torch.cuda.get_device_properties(device).shared_memory_per_block_optin
             if device.type == "cuda" else _HOPPER_SMEM_BYTES)
    per_key = 4 if itemsize == 2 else 2
    for block_n in (_BLOCK_N, _BLOCK_N // 2)[int(split):]:
        tiles = itemsize * block_d * (block_m + per_key * block_n) + 8 * block_m * block_n
        if tiles + 8192 <= limit:
            return block_n
    return _BLOCK_N // 4


def _num_sms(device: torch.device) -> int:
    """The device's SM count (4 off CUDA, for the interpreter's tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_num_splits(num_reqs: int, num_kv_heads: int, num_m_blocks: int, max_context: int,
                       device: torch.device) -> int:
    """How many programs share one request's context: as many as keep the launch within
    two programs per SM (rounded down: at 256 (request, KV head) programs on an H100 one
    split beats two by 4 us a layer, ``bench/attention.py``), but no split shorter than
    ``_MIN_TOKENS_PER_SPLIT`` keys of ``max_context``.

    A pure function of host-side sizes, so a CUDA graph captured with one value stays
    valid for every ``seq_lens`` up to ``max_context``."""
    wanted = max(1, 2 * _num_sms(device) // (num_reqs * num_kv_heads * num_m_blocks))
    by_length = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, q_len: int = 1,
                    *, num_splits: int | None = None, sliding_window: int | None = None,
                    new_kv: tuple[torch.Tensor, ...] | None = None,
                    pack: int | None = None) -> torch.Tensor:
    """Attention of ``q_len`` new query tokens per request over the paged KV cache.

    The new tokens' keys and values must already be in the cache (see
    :func:`specula.runtime.kernels.reshape_and_cache.reshape_and_cache`).

    Args:
        query: [num_reqs * q_len, num_heads, head_dim], request-major; last dim contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same
            dtype as ``query`` (float16, bfloat16 or float32); last dim contiguous.
        block_table: [num_reqs, max_blocks_per_req] int32 block ids.
        seq_lens: [num_reqs] int32, context length including the ``q_len`` new tokens;
            0 marks a padding request (its output is 0).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        q_len: query tokens per request: 1 for decode, ``k + 1`` for verification.
        num_splits: programs per (request, KV head) along the context; default from
            :func:`default_num_splits` with ``max_blocks_per_req * block_size`` (with a window: at
            most ``sliding_window + q_len - 1``) as the longest context. Fixed per launch shape,
            independent of ``seq_lens`` values, so no device-to-host copy happens.
        sliding_window: ``W`` >= 1: a query at position ``p`` sees keys at positions ``(p - W, p]``
            only (see the module docstring); ``None`` (default): all keys up to its own.
        new_kv: ``(key, value, positions, slot_mapping, cos_sin_cache)``: the step's keys and values
            are not in the cache yet and ``query`` and ``key`` are not rotated. The kernel rotates
            them (full rotary, as :func:`~.rotary.rotary_embedding_and_cache`), attends to the new
            keys from ``key``/``value`` and writes them to their slots, sparing that kernel's
            launch. ``key``, ``value``: [num_tokens, num_kv_heads, head_dim]; ``positions``,
            ``slot_mapping``: [num_tokens] int64; ``cos_sin_cache``: [max_position, head_dim]
            float32. Off CUDA, past one key tile of query tokens, with a padded head dimension, or
            past four (request, KV head, row tile) programs per SM, the two kernels' path runs,
            which rotates ``query`` and ``key`` in place.
        pack: KV heads per program, a power of two dividing ``num_kv_heads`` (more than 1 only at
            ``q_len`` 1 in one split without ``new_kv``): the program's query rows take the pack's
            heads, and its key and value tiles their adjacent columns, the others' scores masked
            out by a block-diagonal query. Default 2 where the head fits and there are more than
            four (request, KV head) programs per SM, else 1: fewer, wider programs (8B heads, batch
            128 on an H100: 55.4 -> 52.6 us a layer at 256 keys, 33.6 -> 30.0 at 128,
            ``bench/attention.py``).

    Returns:
        [num_reqs * q_len, num_heads, head_dim] in ``query.dtype``.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above; off CUDA, with
            ``new_kv``, positions other than the last ``q_len`` of each request's context.
    """
    assert query.ndim == 3 and key_cache.ndim == 4 and value_cache.shape == key_cache.shape
    assert block_table.ndim == 2 and block_table.dtype == torch.int32
    assert seq_lens.ndim == 1 and seq_lens.dtype == torch.int32
    assert query.dtype in FLOATS and key_cache.dtype == query.dtype == value_cache.dtype
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert block_table.stride(-1) == 1 and seq_lens.is_contiguous()
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_reqs = block_table.shape[0]
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert q_len >= 1 and num_tokens == num_reqs * q_len and seq_lens.shape[0] == num_reqs
    assert sliding_window is None or sliding_window >= 1
    group_size = num_heads // num_kv_heads
    rows = q_len * group_size
    block_m = max(16, min(_MAX_BLOCK_M, triton.next_power_of_2(rows)))
    num_m_blocks = triton.cdiv(rows, block_m)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    if num_splits is None and num_reqs:
        max_context = block_table.shape[1] * block_size
        if sliding_window is not None:
            max_context = min(max_context, sliding_window + q_len - 1)
        num_splits = default_num_splits(num_reqs, num_kv_heads, num_m_blocks, max_context,
                                        query.device)
    block_n = _block_n(block_m, block_d, query.element_size(), query.device, (num_splits or 1) > 1)
    # Past four (request, KV head, row tile) programs per SM, the rotary kernel first is
    # cheaper (8B, batch 128 on an H100: a step 2 % faster; 256 programs at batch 32 fuse).
    many = query.is_cuda and num_reqs * num_kv_heads * num_m_blocks > 4 * _num_sms(query.device)
    if pack is None:
        fits = num_kv_heads % 2 == 0 and block_d == head_dim <= 128 and 2 * group_size <= _MAX_BLOCK_M
        pack = 2 if many and fits and q_len == 1 and num_splits == 1 else 1
    if new_kv is not None and (use_reference(query) or q_len > block_n or block_d != head_dim or many):
        from specula.runtime.kernels.rotary import rotary_embedding_and_cache

        key, value, positions, slot_mapping, cos_sin = new_kv
        if use_reference(query):  # the kernel's premise: a request's new tokens end its context
            lens = seq_lens.long().repeat_interleave(q_len)
            want = lens - q_len + torch.arange(num_tokens, device=lens.device) % q_len
            assert bool(((positions == want) | (lens == 0)).all()), "new_kv: positions must end each context"
        rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                                   slot_mapping, cos_sin)
        new_kv = None
    assert pack >= 1 and pack & (pack - 1) == 0 and (pack == 1 or num_reqs == 0 or (
        q_len == 1 and num_splits == 1 and new_kv is None and num_kv_heads % pack == 0))
    if pack > 1:  # 2 (or more) heads' rows, one row tile; short key tiles (the best at batch 128)
        block_m, block_n = max(16, triton.next_power_of_2(group_size * pack)), _BLOCK_N // 4
    if use_reference(query):
        return paged_attention_reference(query, key_cache, value_cache, block_table, seq_lens, scale,
                                         q_len, sliding_window)
    out = torch.empty_like(query)
    if num_reqs == 0:
        return out
    assert num_splits >= 1
    partial_out = partial_lse = out  # unused by the kernel when NUM_SPLITS == 1
    if num_splits > 1:
        partial_shape = (num_tokens, num_heads, num_splits)
        partial_out = query.new_empty(*partial_shape, head_dim, dtype=torch.float32)
        partial_lse = query.new_empty(*partial_shape, dtype=torch.float32)
    key, value, positions, slot_mapping, cos_sin = new_kv or (query, query, seq_lens, seq_lens, query)
    if new_kv is not None:
        check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        assert positions.shape == (num_tokens,) and positions.dtype == torch.int64 and positions.is_contiguous()
        assert cos_sin.shape[-1] == head_dim and cos_sin.stride(-1) == 1, "full rotary only"
    # float32 caches are for tests and references: keep their dot products exact.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    with_pdl = pdl(query)
    _paged_attention_kernel[(num_reqs, num_kv_heads // pack * num_m_blocks, num_splits)](
        out, partial_out, partial_lse, query, key_cache, value_cache, block_table, seq_lens, key,
        value, positions, slot_mapping, cos_sin, scale * math.log2(math.e), q_len,
        sliding_window or 0, num_heads, num_m_blocks, *query.stride()[:2], *out.stride()[:2],
        *key_cache.stride()[:3], *value_cache.stride()[:3], block_table.stride(0),
        *key.stride()[:2], *value.stride()[:2], cos_sin.stride(0), GROUP_SIZE=group_size,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, INPUT_PRECISION=precision, SLIDING=sliding_window is not None,
        NEW_KV=new_kv is not None, PDL=with_pdl, PACK=pack, num_warps=4, enable_fp_fusion=True,
        launch_pdl=with_pdl)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, num_heads, *out.stride()[:2], HEAD_DIM=head_dim,
            BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            PDL=with_pdl, enable_fp_fusion=True, launch_pdl=with_pdl)
    return out


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float, q_len: int = 1,
                              sliding_window: int | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_attention` (same arguments and result): gathers
    every request's keys and values through its block table (padded to the longest
    context) and computes the masked softmax in float32, all requests at once."""
    num_reqs = block_table.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max()) if num_reqs else 0
    if max_len == 0:
        return torch.zeros_like(query)
    blocks = block_table[:, : triton.cdiv(max_len, block_size)].long()  # [R, nb]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [R, nb, block_size, kv_heads, d] -> [R, max_len, heads, d] float32
        kv = cache[blocks].flatten(1, 2)[:, :max_len].float()
        return kv.repeat_interleave(num_heads // num_kv_heads, dim=2)

    keys, values = gather(key_cache), gather(value_cache)
    q = query.view(num_reqs, q_len, num_heads, head_dim).float()
    scores = torch.einsum("rqhd,rkhd->rhqk", q, keys) * scale
    key_pos = torch.arange(max_len, device=query.device)
    lens = seq_lens.long()
    query_pos = lens[:, None] - q_len + torch.arange(q_len, device=query.device)  # [R, q]
    masked = key_pos[None, None, :] > query_pos[:, :, None]  # [R, q, max_len]
    if sliding_window is not None:
        masked |= key_pos[None, None, :] <= query_pos[:, :, None] - sliding_window
    scores = scores.masked_fill(masked[:, None], -math.inf)
    # A padding request (length 0) sees no key: zeros, as the kernel writes.
    probs = torch.where((lens > 0)[:, None, None, None], scores.softmax(dim=-1), 0.0)
    out = torch.einsum("rhqk,rkhd->rqhd", probs, values).reshape(num_tokens, num_heads, head_dim)
    return out.to(query.dtype)
