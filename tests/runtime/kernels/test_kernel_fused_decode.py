"""The decode-step fusions of the GPU runner: SiLU-and-multiply, and rotary embedding
fused with the paged cache write, in Triton's interpreter against their torch
references (the unfused kernels' references, themselves checked against the model
layers), plus compilation for Hopper (sm_90) at Llama-3.1-8B constants.

Tolerances: float32 1e-6; bfloat16 two units in the last place (the interpreter rounds
float32 to bfloat16 toward zero where torch rounds to nearest even); padding slots
leave the cache untouched exactly.
"""

from __future__ import annotations

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specula.runtime.kernels import activation, rotary
from specula.runtime.kernels.activation import silu_and_mul, silu_and_mul_reference
from specula.runtime.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding_and_cache,
    rotary_embedding_and_cache_reference,
)

pytestmark = pytest.mark.runtime

TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
    torch.bfloat16: {"atol": 1e-5, "rtol": 2**-6},
}


def check_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 2 * d, generator=gen) * 3).to(dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (3, d) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **TOL[dtype])
    # Writing into a strided output buffer (a row slice of a wider tensor).
    wide = torch.zeros(3, d + 5, dtype=dtype)
    silu_and_mul(gate_up, out=wide[:, :d])
    torch.testing.assert_close(wide[:, :d], out, atol=0, rtol=0)
    assert torch.all(wide[:, d:] == 0)


@pytest.mark.parametrize("dtype, d", [(torch.float32, 48), (torch.bfloat16, 1500)])
def test_silu_and_mul_matches_reference(interpreted, dtype, d):
    interpreted(check_silu_and_mul, dtype, d)


def check_rotary_and_cache(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    num_tokens = 5
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim

    def views(t):
        return (
            t[:, :q_size].view(num_tokens, num_heads, head_dim),
            t[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
            t[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim),
        )

    shape = (6, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 64)
    positions = torch.tensor([0, 7, 3, 63, 20])
    slots = torch.tensor([5, -1, 12, 23, -1])  # two padding tokens

    ref_qkv, ref_k, ref_v = qkv.clone(), key_cache.clone(), value_cache.clone()
    original_k, original_v = key_cache.clone(), value_cache.clone()
    rotary_embedding_and_cache(positions, *views(qkv), key_cache, value_cache, slots, cos_sin)
    rotary_embedding_and_cache_reference(positions, *views(ref_qkv), ref_k, ref_v, slots, cos_sin)
    torch.testing.assert_close(qkv, ref_qkv, **TOL[dtype])
    torch.testing.assert_close(key_cache, ref_k, **TOL[dtype])
    assert torch.equal(value_cache, ref_v)  # values are copied, not computed
    # Only the three real tokens' slots changed.
    untouched = torch.ones(6 * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for cache, original in ((key_cache, original_k), (value_cache, original_v)):
        assert torch.equal(cache.flatten(0, 1)[untouched], original.flatten(0, 1)[untouched])
        assert not torch.equal(cache.flatten(0, 1)[~untouched], original.flatten(0, 1)[~untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_matches_reference(interpreted, dtype):
    interpreted(check_rotary_and_cache, dtype)


HOPPER = GPUTarget("cuda", 90, 32)
CASES = {
    "silu_and_mul": (
        activation._silu_and_mul_kernel,
        {"out_ptr": "*bf16", "gate_up_ptr": "*bf16"},
        dict(BLOCK=1024),
    ),
    "rotary_and_cache": (
        rotary._rotary_kernel,
        {
            "positions_ptr": "*i64",
            "slot_mapping_ptr": "*i64",
            "query_ptr": "*bf16",
            "key_ptr": "*bf16",
            "value_ptr": "*bf16",
            "key_cache_ptr": "*bf16",
            "value_cache_ptr": "*bf16",
            "cos_sin_ptr": "*fp32",
        },
        dict(
            NUM_HEADS=32,
            NUM_KV_HEADS=8,
            HALF=64,
            BLOCK_SIZE=16,
            BLOCK_HALF=64,
            BLOCK_H=32,
            BLOCK_KH=8,
            HAS_KEY=True,
            WRITE_CACHE=True,
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_sm90(name):
    kernel, types, constexprs = CASES[name]
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs),
        target=HOPPER,
        options={"num_warps": 4, "enable_fp_fusion": True},
    )
    assert f".entry {kernel.fn.__name__}" in compiled.asm["ptx"]
    assert compiled.asm["cubin"], "ptxas produced no binary"
