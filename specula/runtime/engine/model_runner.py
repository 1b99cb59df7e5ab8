"""Runs one model over a flattened batch against its own slot KV cache."""

from __future__ import annotations

import torch

from specula.runtime.engine.kv_cache import KVCache
from specula.runtime.models.attention import build_attention_metadata
from specula.runtime.models.llama import LlamaForCausalLM


class ModelRunner:
    """A model plus its KV cache; used for the target and for draft models.

    ``max_len`` is the cache length per slot: the context length plus room for the draft
    tokens a verification step writes past the last committed token.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_num_seqs: int,
        max_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = KVCache(model.config, max_num_seqs, max_len, self.dtype, device)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forward(
        self,
        slot_ids: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        start_positions: list[int],
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``query_lens[i]`` tokens to slot ``slot_ids[i]`` from
        ``start_positions[i]`` on, and return their final hidden states.

        Args:
            input_ids: [num_tokens] int64, requests' tokens concatenated in order.
            positions: [num_tokens] rotary positions; default: the cache positions.

        Returns:
            [num_tokens, hidden_size]
        """
        hidden, _ = self.forward_with_aux(
            slot_ids, input_ids, query_lens, start_positions, (), positions
        )
        return hidden

    def forward_with_aux(
        self,
        slot_ids: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        start_positions: list[int],
        aux_layer_ids: tuple[int, ...],
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` that also returns the model's auxiliary hidden states
        ``[num_tokens, len(aux_layer_ids) * hidden_size]`` (``None`` when
        ``aux_layer_ids`` is empty); see ``LlamaForCausalLM.forward_with_aux``."""
        assert input_ids.ndim == 1 and input_ids.shape[0] == sum(query_lens)
        self.kv_cache.ensure_capacity(
            max(s + q for s, q in zip(start_positions, query_lens, strict=True))
        )
        metadata = build_attention_metadata(slot_ids, query_lens, start_positions, self.device)
        if positions is None:
            positions = metadata.cache_positions
        return self.model.forward_with_aux(
            input_ids.to(self.device), positions, self.kv_cache.layers, metadata, aux_layer_ids
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32."""
        return self.model.compute_logits(hidden)
