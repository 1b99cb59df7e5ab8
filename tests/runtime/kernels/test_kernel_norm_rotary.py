"""RMSNorm (plain and fused with the residual add) and rotary embedding in Triton's
interpreter vs their torch references; the references are checked against the model
layers (``specula.runtime.models.layers``) they stand for.

Tolerances: float32 1e-6 relative + absolute; float16 one unit in the last place (the
kernel's float32 reduction order differs from torch's, which can move a rounding
boundary); bfloat16 two units, because Triton's interpreter rounds float32 to bfloat16
toward zero where the GPU (and torch) round to nearest even, and the Llama RMSNorm rounds
twice. The residual sum is compared exactly (same float32 add, one rounding), except for
that interpreter rounding in bfloat16 (one unit). ``tests/gpu/test_kernels.py`` checks
the bfloat16 results on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm, rms_norm_reference
from specula.runtime.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_reference,
)
from specula.runtime.models.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.runtime

TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
    torch.float16: {"atol": 1e-3, "rtol": 2**-10},
    torch.bfloat16: {"atol": 1e-5, "rtol": 2**-6},
}
RESIDUAL_TOL = {
    torch.float32: {"atol": 0, "rtol": 0},
    torch.float16: {"atol": 0, "rtol": 0},
    torch.bfloat16: {"atol": 0, "rtol": 2**-7},
}


def check_rms_norm(dtype: torch.dtype, hidden: int, gemma: bool, fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    eps = 1e-6
    if fused:
        out, residual_out = fused_add_rms_norm(x, residual, weight, eps, gemma=gemma)
        _, ref_residual = rms_norm_reference(x, weight, eps, gemma=gemma, residual=residual)
        torch.testing.assert_close(residual_out, ref_residual, **RESIDUAL_TOL[dtype])
        # The norm of the sum the kernel produced, so that a one-unit difference in the
        # sum is not counted twice.
        ref, _ = rms_norm_reference(residual_out, weight, eps, gemma=gemma)
    else:
        out = rms_norm(x, weight, eps, gemma=gemma)
        ref, _ = rms_norm_reference(x, weight, eps, gemma=gemma)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize(
    "dtype, hidden, gemma, fused",
    [
        (torch.float32, 64, False, False),
        (torch.bfloat16, 48, False, True),  # hidden not a power of two: masked lanes
        (torch.float16, 64, True, False),
        (torch.bfloat16, 64, True, True),
        (torch.float32, 40, True, True),
    ],
)
def test_rms_norm_matches_reference(interpreted, dtype, hidden, gemma, fused):
    interpreted(check_rms_norm, dtype, hidden, gemma, fused)


def check_fused_add_rms_norm_in_place() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    residual = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    weight = torch.rand(32, generator=gen).to(torch.bfloat16)
    _, ref_residual = rms_norm_reference(x, weight, 1e-5, residual=residual)
    out, residual_out = fused_add_rms_norm(x, residual, weight, 1e-5, out=x, residual_out=residual)
    assert out.data_ptr() == x.data_ptr() and residual_out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, ref_residual, **RESIDUAL_TOL[torch.bfloat16])
    ref, _ = rms_norm_reference(residual, weight, 1e-5)
    torch.testing.assert_close(x, ref, **TOL[torch.bfloat16])


def test_fused_add_rms_norm_in_place(interpreted):
    interpreted(check_fused_add_rms_norm_in_place)


def check_gathered_rows_into_half_of_a_row() -> None:
    """``ids`` (strided, as a column of draft ids): the rows of a table (an embedding
    lookup), normed into the left half of a wider buffer (MTP's and EAGLE-3's
    ``[embedding, hidden]`` input, no cat); the right half is untouched."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(11, 48, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(48, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    ids = torch.tensor([[7, 1], [0, 1], [7, 1], [10, 1]])[:, 0]  # a strided column (draft ids)
    buf = torch.full((4, 96), 5.0, dtype=torch.bfloat16)
    out, _ = fused_add_rms_norm(table, None, weight, 1e-6, out=buf[:, :48], ids=ids)
    assert out.data_ptr() == buf.data_ptr() and torch.all(buf[:, 48:] == 5.0)
    ref, _ = rms_norm_reference(table[ids], weight, 1e-6)
    torch.testing.assert_close(buf[:, :48], ref, **TOL[torch.bfloat16])


def test_gathered_rows_into_half_of_a_row(interpreted):
    interpreted(check_gathered_rows_into_half_of_a_row)
    check_gathered_rows_into_half_of_a_row()  # the torch reference's path


def check_normed_pair_in_one_launch() -> None:
    """``pair``: gathered table rows normed into the left half and a second input, with its
    own weight and eps, into the right half of one ``[n, 2H]`` buffer (``normed_pair``)."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(11, 48, generator=gen).to(torch.bfloat16)
    hidden = (torch.randn(4, 64, generator=gen) * 3).to(torch.bfloat16)[:, :48]  # row stride 64
    w1, w2 = ((torch.randn(48, generator=gen) * 0.5 + 1).to(torch.bfloat16) for _ in range(2))
    ids = torch.tensor([[7, 1], [0, 1], [7, 1], [10, 1]])[:, 0]
    buf = torch.full((4, 96), 5.0, dtype=torch.bfloat16)
    out, _ = fused_add_rms_norm(table, None, w1, 1e-6, out=buf, ids=ids, pair=(hidden, w2, 0.5))
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:, :48], rms_norm_reference(table[ids], w1, 1e-6)[0], **TOL[torch.bfloat16])
    # eps 0.5 against 1e-6 would move these rows' norms by more than the tolerance.
    torch.testing.assert_close(buf[:, 48:], rms_norm_reference(hidden, w2, 0.5)[0], **TOL[torch.bfloat16])


def test_normed_pair_in_one_launch(interpreted):
    interpreted(check_normed_pair_in_one_launch)
    check_normed_pair_in_one_launch()  # the torch reference's path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_the_model_layer(dtype):
    torch.manual_seed(0)
    layer = RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48))
    x = torch.randn(4, 48).to(dtype)
    ref, _ = rms_norm_reference(x, layer.weight.detach(), 1e-5)
    assert torch.equal(ref, layer(x))


def check_rotary(dtype: torch.dtype, rotary_dim: int, with_key: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_heads, num_kv_heads, head_dim, max_position = 6, 4, 2, 16, 64
    rope = RotaryEmbedding(rotary_dim, 10000.0, None, torch.device("cpu"))
    cache = build_cos_sin_cache(rope.inv_freq, max_position)
    # q and k as views into one fused qkv output: strided token dimension.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    ref_q, ref_k = rotary_embedding_reference(positions, query, key if with_key else None, cache)
    original = qkv.clone()
    rotary_embedding(positions, query, key if with_key else None, cache)
    torch.testing.assert_close(query, ref_q, **TOL[dtype])
    if with_key:
        torch.testing.assert_close(key, ref_k, **TOL[dtype])
    else:
        assert torch.equal(key, original[:, num_heads : num_heads + num_kv_heads])
    # Channels past rotary_dim, and the value heads, are untouched.
    assert torch.equal(query[..., rotary_dim:], original[:, :num_heads, rotary_dim:])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], original[:, num_heads + num_kv_heads :])


@pytest.mark.parametrize(
    "dtype, rotary_dim, with_key",
    [(torch.float32, 16, True), (torch.bfloat16, 16, True), (torch.float16, 8, True),
     (torch.float32, 16, False)],
    ids=["fp32", "bf16", "fp16-partial", "query-only"],
)
def test_rotary_matches_reference(interpreted, dtype, rotary_dim, with_key):
    interpreted(check_rotary, dtype, rotary_dim, with_key)


def test_rotary_reference_is_transformers_rotary():
    """Full rotary: the reference on the layer's table equals ``transformers``' Llama
    rotary (``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb``), Llama 3.1 frequency
    scaling included."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    torch.manual_seed(3)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = RotaryEmbedding(32, 500000.0, scaling, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 100, 511])
    query = torch.randn(5, 3, 32)
    ref_q, _ = rotary_embedding_reference(
        positions, query, None, build_cos_sin_cache(rope.inv_freq, 512)
    )
    config = LlamaConfig(
        hidden_size=96, num_attention_heads=3, head_dim=32, rope_theta=500000.0,
        rope_scaling=scaling, max_position_embeddings=512,
    )
    hf = LlamaRotaryEmbedding(config)
    cos, sin = hf(query, positions[None])
    q = query.transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    hf_q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
