"""Writing the new tokens' keys and values into the paged KV cache.

Named after vLLM's ``reshape_and_cache`` cache op, with its slot convention: token ``t``
goes to ``slot_mapping[t] = block * block_size + offset``, and a negative slot marks a
padding token (a CUDA-graph batch padded to a captured size) whose write is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh,  # key, value: token, head
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,  # block, slot, head
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A padding token (negative slot) masks out every head.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def check_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The argument checks (AssertionError) of the kernels that write the paged KV cache;
    shapes as :func:`reshape_and_cache`'s."""
    assert key.ndim == 3 and value.shape == key.shape
    assert key_cache.ndim == 4 and value_cache.shape == key_cache.shape
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
    assert slot_mapping.ndim == 1 and slot_mapping.dtype == torch.int64
    assert slot_mapping.is_contiguous() and slot_mapping.shape[0] == key.shape[0]
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    assert key_cache.shape[2:] == key.shape[1:]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key`` and ``value`` of each token into its cache slot, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]; last dim contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same
            dtype as ``key``; last dim contiguous.
        slot_mapping: [num_tokens] int64, ``block * block_size + offset``; negative
            entries are skipped.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if use_reference(key):
        return reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride()[:2], *value.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=True)


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`reshape_and_cache` (same arguments, in place)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]
