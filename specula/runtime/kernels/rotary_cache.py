"""Rotary embedding of the new tokens' queries and keys fused with the write of their
keys and values into the paged KV cache: :func:`specula.runtime.kernels.rotary.
rotary_embedding` followed by :func:`specula.runtime.kernels.reshape_and_cache.
reshape_and_cache`, in one launch (one program per token), so a decode step pays one
small kernel per layer for both.

Same conventions as those two: rotate-half layout with a ``cos_sin_cache
[max_position, head_dim]`` (full rotary only: ``rotary_dim == head_dim``, as Llama and
Qwen3), float32 arithmetic rounded once, vLLM's slot mapping with negative slots
skipped (padding tokens). ``query`` and ``key`` are rotated in place as well, because
the attention that follows reads the query, and a prefill attends over the new keys
directly.
"""

from __future__ import annotations

import torch

from specula.runtime.kernels.reshape_and_cache import (
    check_cache_write,
    reshape_and_cache_reference,
)
from specula.runtime.kernels.rotary import rotary_embedding, rotary_embedding_reference


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate ``query`` and ``key`` in place, then write the rotated keys and ``value``
    into their cache slots.

    Args:
        positions, query, key: as :func:`~specula.runtime.kernels.rotary.rotary_embedding`
            (``key`` [num_tokens, num_kv_heads, head_dim] required).
        value, key_cache, value_cache, slot_mapping: as
            :func:`~specula.runtime.kernels.reshape_and_cache.reshape_and_cache`, in
            ``query.dtype``; negative slots write nothing.
        cos_sin_cache: [max_position, head_dim] (full rotary) from
            :func:`specula.runtime.kernels.rotary.build_cos_sin_cache`.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above (including a
            partial rotary table: use the two separate kernels for those).
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    assert cos_sin_cache.shape[-1] == query.shape[-1], "full rotary only"
    cache = (value, key_cache, value_cache, slot_mapping)
    rotary_embedding(positions, query, key, cos_sin_cache, cache)


def rotary_embedding_and_cache_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Torch reference of :func:`rotary_embedding_and_cache` (same arguments, in place):
    the two unfused references one after the other."""
    q, k = rotary_embedding_reference(positions, query, key, cos_sin_cache)
    query.copy_(q)
    key.copy_(k)
    reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
