"""A slot KV cache: one contiguous row per running request.

Each layer holds ``k`` and ``v`` of shape ``[max_num_seqs, num_kv_heads, capacity,
head_dim]``; a request owns one slot (row) from admission to completion. Positions past a
request's valid length are simply ignored by the attention mask, so rolling back rejected
draft tokens costs nothing: the owner just lowers its length.

Capacity grows by doubling (up to ``max_len``) instead of being reserved up front, so a
checkpoint with a long context does not pin memory that short requests never touch. A
paged cache replaces this on GPU.
"""

from __future__ import annotations

import torch

from specula.runtime.models.config import ModelConfig

_INITIAL_CAPACITY = 256


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of key plus value one token occupies across all layers that own KV storage
    (``config.kv_cache_shapes()``), at ``dtype``; layers that read another layer's KV
    (Gemma4 ``num_kv_shared_layers``) add nothing."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * heads * head_dim * itemsize for heads, head_dim in config.kv_cache_shapes())


class KVCache:
    """Per-layer key/value tensors for ``max_num_seqs`` slots of up to ``max_len`` positions.

    ``layers`` has one ``(k, v)`` per layer that owns storage, shaped by
    ``config.kv_cache_shapes()`` (layers may differ in KV heads and head size).
    """

    def __init__(
        self,
        config: ModelConfig,
        max_num_seqs: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._layer_shapes = config.kv_cache_shapes()
        self.num_layers = len(self._layer_shapes)
        """Layers that own storage (fewer than the model's when layers share KV)."""
        self.max_num_seqs = max_num_seqs
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.capacity = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ensure_capacity(min(_INITIAL_CAPACITY, max_len))

    def ensure_capacity(self, num_positions: int) -> None:
        """Make room for positions ``[0, num_positions)`` in every slot.

        Raises:
            ValueError: ``num_positions`` exceeds ``max_len``.
        """
        if num_positions <= self.capacity:
            return
        if num_positions > self.max_len:
            raise ValueError(f"KV cache needs {num_positions} positions; max_len is {self.max_len}")
        new_cap = min(self.max_len, max(num_positions, 2 * self.capacity))
        slots = self.max_num_seqs
        new_layers = []
        for i, (heads, head_dim) in enumerate(self._layer_shapes):
            k = torch.zeros(slots, heads, new_cap, head_dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            if self.layers:
                old_k, old_v = self.layers[i]
                k[:, :, : self.capacity] = old_k
                v[:, :, : self.capacity] = old_v
            new_layers.append((k, v))
        self.layers = new_layers
        self.capacity = new_cap
