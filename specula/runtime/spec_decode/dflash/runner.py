"""The DFlash draft's forwards on the kernels (Chen, Liang, Liu, arXiv 2602.06036)."""

from __future__ import annotations

import torch

from specula.runtime.kernels.layernorm import rms_norm
from specula.runtime.kernels.reshape_and_cache import reshape_and_cache
from specula.runtime.kernels.rotary import rotary_embedding
from specula.runtime.models.dflash import DFlashDraftModel
from specula.runtime.spec_decode.draft_model_base import DraftRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache


class DFlashRunner(DraftRunner):
    """Runs :class:`DFlashDraftModel` on its own paged KV cache (raises as :class:`DraftRunner`)."""

    def __init__(self, model: DFlashDraftModel, kv_cache: PagedKVCache, max_model_len: int) -> None:
        super().__init__(model, kv_cache, max_model_len)
        self.has_qk_norm = True  # the layers are Qwen3's whatever the config's model_type
        self.own_keys_only = False  # a block's rows read each other's keys: cache them first

    @torch.no_grad()
    def store_context(self, aux_hidden_states: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Write every layer's context KV of the target's rows (``aux_hidden_states
        [num_tokens, num_aux * H]`` at ``positions``) to the cache slots ``slot_mapping``
        (-1: skip), as vLLM's ``precompute_and_store_context_kv``."""
        features = self.model.context_features(aux_hidden_states.to(self.dtype))  # [n, H]
        n = features.shape[0]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj
            q_size = qkv.output_sizes[0]
            bias = None if qkv.bias is None else qkv.bias[q_size:]
            kv = torch.nn.functional.linear(features, qkv.weight[q_size:], bias)
            k, v = kv.split(qkv.output_sizes[1:], dim=-1)
            heads, head_dim = attn.num_kv_heads, attn.head_dim
            k = rms_norm(k.reshape(-1, head_dim), attn.k_norm.weight, attn.k_norm.eps).view(n, heads, head_dim)
            rotary_embedding(positions, k, None, self.cos_sin_cache)
            key_cache, value_cache = self.kv_cache.layer(i)
            reshape_and_cache(k, v.view(n, heads, head_dim), key_cache, value_cache, slot_mapping)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> torch.Tensor:
        """The draft layers over block rows, ``inputs_embeds [num_tokens, H]`` ->
        [num_tokens, H] final normed states; ``metadata`` makes each row a one-query
        request seeing the whole context and block."""
        ln = self.model.layers[0].input_layernorm
        hidden = rms_norm(inputs_embeds, ln.weight, ln.eps)
        return self.decoder(self.model.layers, hidden, inputs_embeds, positions, metadata,
                            self.model.norm)[0]
