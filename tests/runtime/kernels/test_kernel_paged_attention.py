"""Paged attention and ``reshape_and_cache`` in Triton's interpreter vs their torch
references; the reference itself is checked against the model code's
``scaled_dot_product_attention`` with an explicit mask on the same keys and values.

Tolerances (max abs error, unit-variance inputs): float32 1e-5 (both sides accumulate in
float32); float16 3e-3 (the kernel rounds the softmax weights to float16 before the
value product, as flash attention does).
"""

from __future__ import annotations

import pytest
import torch
import triton

from specula.runtime.kernels.paged_attention import (
    default_num_splits,
    paged_attention,
    paged_attention_reference,
)
from specula.runtime.kernels.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_reference,
)

pytestmark = pytest.mark.runtime

ATOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, req: int, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of request ``req``: [seq_len, num_kv_heads, head_dim]."""
    blocks = block_table[req, : -(-seq_len // cache.shape[1])].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _paged_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_query_tokens: int,
    seed: int = 0,
):
    """A cache whose blocks are handed out in a random order (so block-table indirection
    matters), one spare block-table column, and spare blocks nobody owns."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    max_blocks = max(triton.cdiv(s, block_size) for s in seq_lens) + 1
    num_blocks = num_reqs * max_blocks + 3
    table = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
    block_table = table.view(num_reqs, max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(num_query_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def check_paged_attention(
    seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits,
    sliding_window=None, pack=None,
) -> None:
    query, key_cache, value_cache, block_table, lens = _paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, len(seq_lens) * q_len
    )
    scale = head_dim**-0.5
    out = paged_attention(
        query, key_cache, value_cache, block_table, lens, scale, q_len,
        num_splits=num_splits, sliding_window=sliding_window, pack=pack,
    )
    ref = paged_attention_reference(
        query, key_cache, value_cache, block_table, lens, scale, q_len, sliding_window
    )
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    # A padding request (seq_len 0) attends to nothing and gets zeros, not NaN.
    for req, n in enumerate(seq_lens):
        if n == 0:
            assert torch.all(out[req * q_len : (req + 1) * q_len] == 0)


@pytest.mark.parametrize(
    "seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits",
    [
        # decode, GQA 4:2, a 1-token context, a padding request, one program per head
        ([1, 7, 16, 0], 1, 4, 2, 16, 4, torch.float32, 1),
        # same, split three ways: most splits of the short requests are empty
        ([1, 7, 16, 0], 1, 4, 2, 16, 4, torch.float32, 3),
        # decode, float16, no GQA, a context longer than one key tile (64)
        ([70, 5], 1, 2, 2, 16, 8, torch.float16, 2),
        # verification, q_len 3, GQA 4:1 (12 query rows per program)
        ([3, 9, 20], 3, 4, 1, 16, 4, torch.float32, 1),
        # verification, float16, head_dim not a power of two, split in two
        ([4, 33], 4, 4, 2, 24, 8, torch.float16, 2),
        # 9 query tokens x 8 heads per KV head: rows tiled over two programs
        ([12, 30], 9, 8, 1, 16, 4, torch.float32, 2),
    ],
    ids=["decode", "decode-split", "decode-fp16", "verify-gqa", "verify-fp16", "verify-m-tiles"],
)
def test_paged_attention_matches_reference(
    interpreted, seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits
):
    interpreted(
        check_paged_attention,
        seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits,
    )


@pytest.mark.parametrize(
    "seq_lens, num_heads, num_kv_heads, head_dim, dtype, window, pack",
    [
        # two KV heads a program, GQA 4:1 (8 rows), a padding request, contexts of 1-70 keys
        ([1, 7, 70, 0], 16, 4, 16, torch.float32, None, 2),
        # four a program (16 rows), float16, no GQA
        ([33, 5], 8, 8, 16, torch.float16, None, 4),
        # two a program inside a sliding window
        ([9, 40, 0], 8, 4, 16, torch.float32, 5, 2),
    ],
    ids=["pack2-gqa", "pack4-fp16", "pack2-window"],
)
def test_packed_kv_heads_match_reference(interpreted, seq_lens, num_heads, num_kv_heads, head_dim,
                                         dtype, window, pack):
    """Programs of several KV heads (``pack``) give each head's rows its own keys only."""
    interpreted(check_paged_attention, seq_lens, 1, num_heads, num_kv_heads, head_dim, 4, dtype, 1,
                window, pack)


def check_packed_value_strides() -> None:
    """Two KV heads a program, a head size padded to the tile (24 -> 32), and a value cache
    that is a view of a wider tensor (a head stride of its own)."""
    query, key_cache, value_cache, block_table, lens = _paged_case(
        [5, 40, 0], 8, 4, 24, 4, torch.float32, 3)
    wide = torch.randn(*value_cache.shape[:-1], 40)
    wide[..., :24] = value_cache
    scale = 24**-0.5
    out = paged_attention(query, key_cache, wide[..., :24], block_table, lens, scale, num_splits=1,
                          pack=2)
    ref = paged_attention_reference(query, key_cache, value_cache, block_table, lens, scale)
    torch.testing.assert_close(out, ref, atol=ATOL[torch.float32], rtol=0)


def test_packed_kv_heads_read_values_by_their_own_strides(interpreted):
    interpreted(check_packed_value_strides)


def test_pack_must_be_a_power_of_two():
    query, key_cache, value_cache, block_table, lens = _paged_case(
        [5, 9], 8, 4, 16, 4, torch.float32, 2)
    for pack in (0, 3):
        with pytest.raises(AssertionError):
            paged_attention(query, key_cache, value_cache, block_table, lens, 0.25, pack=pack)


def check_with_poisoned_partials(check, *args) -> None:
    """``check(*args)`` (:func:`check_paged_attention` or :func:`check_new_kv`) with the
    split partials allocated full of NaN: the merge reads no row of a split that saw no
    key (which stores only its log-sum-exp)."""
    new_empty, filled = torch.Tensor.new_empty, []

    def poisoned(self, *size, **kwargs):
        out = new_empty(self, *size, **kwargs)
        if out.dtype == torch.float32:  # the partials (outputs and log-sum-exps)
            filled.append(out.fill_(float("nan")))
        return out

    torch.Tensor.new_empty = poisoned
    try:
        check(*args)
    finally:
        torch.Tensor.new_empty = new_empty
    assert filled, "no split partials were allocated: nothing was poisoned"


@pytest.mark.parametrize(
    "case",
    [  # most splits of the short contexts empty
        ("paged", [1, 7, 16, 0], 1, 4, 2, 16, 4, torch.float32, 3),
        ("paged", [3, 9, 20], 3, 4, 2, 16, 4, torch.float32, 4),
        # the engine's layout: the context in the first splits, the new keys in the last
        ("new_kv", [1, 7, 70, 0], 1, 4, 1, 16, torch.float16, 3, None),
        ("new_kv", [3, 9, 20], 3, 4, 1, 32, torch.float32, 4, None),
    ],
    ids=["decode", "verify", "decode-new-kv", "verify-new-kv"],
)
def test_splits_without_keys_are_not_merged(interpreted, case):
    check = check_paged_attention if case[0] == "paged" else check_new_kv
    interpreted(check_with_poisoned_partials, check, *case[1:])


@pytest.mark.parametrize(
    "seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, window",
    [
        # decode, a window shorter than two contexts and longer than one, padding request
        ([3, 20, 0, 9], 1, 4, 2, 16, 4, torch.float32, 1, 8),
        # decode, contexts past one key tile: the loop starts mid-tile, mid-block, and
        # the window's keys are split over three programs
        ([70, 131], 1, 4, 2, 16, 8, torch.float32, 3, 37),
        # verification: each of the 4 query tokens has its own window start; float16
        ([4, 30], 4, 4, 1, 24, 4, torch.float16, 2, 5),
        # window 1: each query sees only its own key
        ([6, 11], 3, 2, 2, 16, 4, torch.float32, 1, 1),
    ],
    ids=["decode", "decode-split-long", "verify-fp16", "window-1"],
)
def test_sliding_window_matches_reference(
    interpreted, seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype,
    num_splits, window,
):
    interpreted(
        check_paged_attention,
        seq_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits,
        window,
    )


def check_write_then_attend(dtype: torch.dtype) -> None:
    """A verification step as the engine runs it: write the new tokens' keys/values
    (two requests plus padding slots), then attend with the default split count."""
    q_len, num_heads, num_kv_heads, head_dim, block_size = 3, 4, 2, 16, 4
    seq_lens = [6, 11]
    query, key_cache, value_cache, block_table, lens = _paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, 2 * q_len, seed=1
    )
    gen = torch.Generator().manual_seed(2)
    slots = []
    for req, n in enumerate(seq_lens):
        for pos in range(n - q_len, n):
            slots.append(int(block_table[req, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1, -1], dtype=torch.int64)
    new_shape = (len(slots) + 2, num_kv_heads, head_dim)
    key = torch.randn(new_shape, generator=gen).to(dtype)
    value = torch.randn(new_shape, generator=gen).to(dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    reshape_and_cache_reference(key, value, ref_k, ref_v, slot_mapping)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)

    scale = head_dim**-0.5
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale, q_len)
    ref = paged_attention_reference(query, key_cache, value_cache, block_table, lens, scale, q_len)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_then_attend(interpreted, dtype):
    interpreted(check_write_then_attend, dtype)


def check_new_kv(seq_lens, q_len, num_heads, num_kv_heads, head_dim, dtype, num_splits,
                 window=None) -> None:
    """A step's attention with rotary and the cache write in the kernel (``new_kv``)
    against the references run one after the other: the rotated keys and the values land
    in their slots (none for padding) and the output matches."""
    from specula.runtime.kernels.rotary import (
        build_cos_sin_cache,
        rotary_embedding_and_cache_reference,
    )

    block_size = 4
    n = len(seq_lens) * q_len
    query, key_cache, value_cache, block_table, lens = _paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, n, seed=5
    )
    gen = torch.Generator().manual_seed(6)
    # q, k, v as views into one fused qkv output, as the layers produce them.
    qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions, slots = [], []
    for req, length in enumerate(seq_lens):
        for pos in range(length - q_len, length):
            positions.append(max(pos, 0))
            block = int(block_table[req, max(pos, 0) // block_size])
            slots.append(block * block_size + pos % block_size if length else -1)
    positions = torch.tensor(positions, dtype=torch.int64)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 128)
    ref_q, ref_k, ref_kc, ref_vc = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
    rotary_embedding_and_cache_reference(positions, ref_q, ref_k, value, ref_kc, ref_vc,
                                         slot_mapping, cos_sin)
    scale = head_dim**-0.5
    ref = paged_attention_reference(ref_q, ref_kc, ref_vc, block_table, lens, scale, q_len, window)
    unrotated = query.clone()
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale, q_len,
                          num_splits=num_splits, sliding_window=window,
                          new_kv=(key, value, positions, slot_mapping, cos_sin))
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    assert torch.equal(key_cache, ref_kc) and torch.equal(value_cache, ref_vc)
    assert torch.equal(query, unrotated)  # the kernel rotates in registers


@pytest.mark.parametrize(
    "seq_lens, q_len, num_heads, num_kv_heads, head_dim, dtype, num_splits, window",
    [
        # decode: a 1-token context (only the new key), a padding request, no split
        ([1, 7, 16, 0], 1, 4, 1, 16, torch.float32, 1, None),
        # decode split three ways (the new key in the last split); float16
        ([1, 7, 70, 0], 1, 4, 1, 16, torch.float16, 3, None),
        # verification, q_len 3, causal among the new keys, split in two
        ([3, 9, 20], 3, 4, 1, 32, torch.float32, 2, None),
        # 9 query tokens x 8 heads per KV head: two row tiles, one writes the cache
        ([12, 30], 9, 8, 1, 16, torch.float32, 2, None),
        # a window over the new keys and the cached ones
        ([6, 40], 4, 4, 2, 16, torch.float32, 2, 5),
        # more (request, KV head) programs than SMs (4 in the interpreter), split in two
        ([5, 9, 12], 2, 4, 2, 16, torch.float32, 2, None),
    ],
    ids=["decode", "decode-split-fp16", "verify-split", "verify-m-tiles", "verify-window",
         "many-programs"],
)
def test_new_kv_matches_rotary_cache_write_then_attention(
    interpreted, seq_lens, q_len, num_heads, num_kv_heads, head_dim, dtype, num_splits, window
):
    interpreted(check_new_kv, seq_lens, q_len, num_heads, num_kv_heads, head_dim, dtype,
                num_splits, window)


def test_new_kv_off_cuda_rotates_in_place_then_attends():
    """Off CUDA (the engine's torch references) ``new_kv`` runs the two references: the
    same output and cache as calling them in turn."""
    seq_lens, q_len, num_heads, num_kv_heads, head_dim = [5, 9], 2, 4, 2, 16
    from specula.runtime.kernels.rotary import build_cos_sin_cache, rotary_embedding_and_cache

    query, key_cache, value_cache, block_table, lens = _paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, 4, torch.float32, 4, seed=7
    )
    key, value = torch.randn(2, 4, num_kv_heads, head_dim).unbind(0)
    positions = torch.tensor([3, 4, 7, 8])
    slot_mapping = torch.tensor([int(block_table[r, p // 4]) * 4 + p % 4
                                 for r, p in ((0, 3), (0, 4), (1, 7), (1, 8))])
    cos_sin = build_cos_sin_cache(torch.rand(head_dim // 2), 16)
    q2, k2, kc2, vc2 = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
    rotary_embedding_and_cache(positions, q2, k2, value, kc2, vc2, slot_mapping, cos_sin)
    ref = paged_attention_reference(q2, kc2, vc2, block_table, lens, 0.25, q_len)
    out = paged_attention(query, key_cache, value_cache, block_table, lens, 0.25, q_len,
                          new_kv=(key, value, positions, slot_mapping, cos_sin))
    assert torch.equal(out, ref) and torch.equal(key_cache, kc2) and torch.equal(value_cache, vc2)


def check_reshape_and_cache_copies_exactly(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 3, 8
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    # Keys as a strided view of a fused qkv output, as attention layers produce them.
    qkv = torch.randn(4, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slot_mapping = torch.tensor([17, -1, 2, 8], dtype=torch.int64)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache[4, 1], key[0]) and torch.equal(value_cache[4, 1], value[0])
    assert torch.equal(key_cache[0, 2], key[2]) and torch.equal(value_cache[2, 0], value[3])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[4, 1] = written[0, 2] = written[2, 0] = True
    assert torch.all(key_cache[~written] == 0) and torch.all(value_cache[~written] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reshape_and_cache_skips_padding(interpreted, dtype):
    interpreted(check_reshape_and_cache_copies_exactly, dtype)


@pytest.mark.parametrize("q_len, window", [(1, None), (4, None), (1, 3), (4, 6)])
def test_reference_agrees_with_sdpa(q_len, window):
    """The reference equals ``scaled_dot_product_attention`` on each request's gathered
    keys and values with an explicit mask: causal among the query tokens, and with a
    window, Hugging Face's ``sliding_window_overlay`` (``kv_idx > q_idx - W``)."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = [5, 13, 4], 4, 2, 16, 4
    query, key_cache, value_cache, block_table, lens = _paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
        len(seq_lens) * q_len,
    )
    scale = head_dim**-0.5
    ref = paged_attention_reference(
        query, key_cache, value_cache, block_table, lens, scale, q_len, window
    )
    for req, n in enumerate(seq_lens):
        keys = gather_kv(key_cache, block_table, req, n).transpose(0, 1)  # [kv_heads, n, d]
        values = gather_kv(value_cache, block_table, req, n).transpose(0, 1)
        q = query[req * q_len : (req + 1) * q_len].transpose(0, 1)  # [heads, q_len, d]
        q_pos = torch.arange(n - q_len, n)[:, None]
        kv_pos = torch.arange(n)[None, :]
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        torch.testing.assert_close(
            ref[req * q_len : (req + 1) * q_len], out.transpose(0, 1), atol=1e-5, rtol=1e-5
        )


def test_default_num_splits():
    cpu = torch.device("cpu")  # counts as 4 SMs
    # Few programs and a long context: enough splits for two programs per SM.
    assert default_num_splits(1, 1, 1, 4096, cpu) == 8
    # The context caps it: no split shorter than 128 keys.
    assert default_num_splits(1, 1, 1, 200, cpu) == 2
    # Enough programs already: no split.
    assert default_num_splits(8, 8, 1, 4096, cpu) == 1
    assert default_num_splits(1, 1, 1, 1 << 20, cpu) == 8
    # Rounded down: 5 programs on 4 SMs take no split (two would make 10 for 8 places).
    assert default_num_splits(5, 1, 1, 4096, cpu) == 1
    assert default_num_splits(3, 1, 1, 4096, cpu) == 2


def test_reference_window_convention():
    """A hand-checked window: query at position 5 with window 3 weighs keys 3, 4, 5
    equally when their scores are equal, and nothing else."""
    block_table = torch.tensor([[0, 1]], dtype=torch.int32)
    key_cache = torch.zeros(2, 4, 1, 2)  # equal scores for every key
    value_cache = torch.arange(8.0).repeat_interleave(2).view(2, 4, 1, 2)  # value = position
    query = torch.ones(1, 1, 2)
    lens = torch.tensor([6], dtype=torch.int32)
    out = paged_attention_reference(query, key_cache, value_cache, block_table, lens, 1.0, 1, 3)
    assert torch.allclose(out, torch.full((1, 1, 2), (3 + 4 + 5) / 3))
    full = paged_attention_reference(query, key_cache, value_cache, block_table, lens, 1.0, 1)
    assert torch.allclose(full, torch.full((1, 1, 2), sum(range(6)) / 6))
