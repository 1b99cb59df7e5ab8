"""A paged KV cache whose layers differ in shape, and in which only some layers own one.

:class:`~specula.runtime.gpu.paged_kv.PagedKVCache` gives every decoder layer the same
``[num_blocks, block_size, num_kv_heads, head_dim]`` pair. Gemma4 breaks both
assumptions: sliding and full-attention layers have their own KV heads and head size,
and its ``num_kv_shared_layers`` last layers own no cache at all (they read the cache of
the last earlier non-shared layer of their type). :class:`PerLayerPagedKVCache` holds
one pair per layer that owns storage, each in its own shape
(:meth:`ModelConfig.kv_cache_shapes`), all with the same ``num_blocks`` and
``block_size``: one block manager, one block table per request and one slot mapping
serve every layer, so a single :class:`~specula.runtime.gpu.paged_kv.
PagedAttentionMetadata` describes a forward for all of them (vLLM's hybrid KV-cache
groups, simplified to one group with per-layer tensor shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.runtime.gpu.paged_kv import PagedKVCache
from specula.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class PerLayerKVCacheSpec:
    """Shape of a paged KV cache with per-layer ``(num_kv_heads, head_dim)``."""

    layer_shapes: tuple[tuple[int, int], ...]
    """``(num_kv_heads, head_dim)`` of each layer that owns storage, in layer order."""
    block_size: int
    """Token slots per block."""
    dtype: torch.dtype

    @classmethod
    def from_model_config(
        cls, config: ModelConfig, dtype: torch.dtype, block_size: int = 16
    ) -> PerLayerKVCacheSpec:
        """The cache ``config.kv_cache_shapes()`` asks for (KV-shared layers own none)."""
        return cls(tuple(config.kv_cache_shapes()), block_size, dtype)

    @property
    def num_layers(self) -> int:
        """Layers that own storage."""
        return len(self.layer_shapes)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all storage-owning layers, keys and values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(heads * head_dim for heads, head_dim in self.layer_shapes)
        return 2 * self.block_size * per_token * itemsize


class PerLayerPagedKVCache(PagedKVCache):
    """Key and value caches ``[num_blocks, block_size, num_kv_heads_i, head_dim_i]`` for
    each storage-owning layer ``i``; :meth:`layer` indexes them as
    :class:`PagedKVCache` does, and its :meth:`~PagedKVCache.from_free_memory` and
    :meth:`~PagedKVCache.block_manager` apply unchanged (they read ``spec.block_size``
    and ``spec.bytes_per_block`` only).

    Args:
        spec: the per-layer shapes.
        num_blocks: blocks per layer (> 0).
        device: where the tensors live.

    Raises:
        ValueError: ``num_blocks`` <= 0.
    """

    def __init__(self, spec: PerLayerKVCacheSpec, num_blocks: int, device: torch.device) -> None:
        # PagedKVCache.__init__ allocates one uniform shape; the tensors differ per
        # layer here, so the same attributes are set directly.
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        self.spec = spec
        self.num_blocks = num_blocks
        shapes = [(num_blocks, spec.block_size, h, d) for h, d in spec.layer_shapes]
        # Zero-filled for the reason PagedKVCache gives: padded rows may read stale slots.
        self.key_caches = [torch.zeros(s, dtype=spec.dtype, device=device) for s in shapes]
        self.value_caches = [torch.zeros(s, dtype=spec.dtype, device=device) for s in shapes]
