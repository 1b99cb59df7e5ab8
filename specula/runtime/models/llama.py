"""Llama decoder (arXiv 2302.13971, 2407.21783) over a flattened batch with a KV cache.

Parameter names follow Hugging Face ``LlamaForCausalLM`` so checkpoints load by name;
``q/k/v_proj`` and ``gate/up_proj`` are fused (see ``packed_modules_mapping``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.attention import AttentionMetadata, cached_attention
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.layers import MergedLinear, RMSNorm, RotaryEmbedding, apply_rotary

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, ``(k_cache, v_cache)`` each ``[num_slots, num_kv_heads, capacity, head_dim]``."""


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head query/key norms (Qwen3); Llama has none."""
        return q, k

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = cached_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, kv_cache, metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM whose ``forward`` returns final hidden states and ``compute_logits`` the
    vocabulary logits, so callers project only the positions they sample from."""

    model_cls: type[LlamaModel] = LlamaModel
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    """Fused parameter -> the checkpoint projections stacked in it, in row order."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over a flattened batch.

        Args:
            input_ids: [num_tokens] token ids.
            positions: [num_tokens] rotary positions.
            kv_caches: one ``(k_cache, v_cache)`` per layer; this forward's keys and values
                are written at ``metadata.cache_positions``.
            metadata: from :func:`~specula.runtime.models.attention.build_attention_metadata`.

        Returns:
            [num_tokens, hidden_size] final (normed) hidden states.
        """
        hidden, _ = self.forward_with_aux(input_ids, positions, kv_caches, metadata, ())
        return hidden

    def check_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """Validate auxiliary hidden-state layer ids (see :meth:`forward_with_aux`).

        Raises:
            ValueError: an id outside ``[0, num_hidden_layers]``; the message names the
                field and both values.
        """
        num_layers = self.config.num_hidden_layers
        for i in layer_ids:
            if not 0 <= i <= num_layers:
                raise ValueError(
                    f"aux_hidden_state_layer_ids contains {i}, outside [0, {num_layers}] "
                    f"for a target with num_hidden_layers={num_layers}"
                )
        return tuple(layer_ids)

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: AttentionMetadata,
        aux_layer_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, also returning auxiliary hidden states.

        Aux id ``i`` is the residual stream entering decoder layer ``i``: ``0`` is the
        embedding output and ``num_hidden_layers`` the last layer's output before the
        final norm, as EAGLE-3 (arXiv 2503.01840) and vLLM's ``aux_hidden_state_layers``
        define them. For ``i < num_hidden_layers`` this is Hugging Face's
        ``output_hidden_states[i]``; HF's last entry is taken after the final norm.

        Returns:
            ``(hidden [num_tokens, hidden_size], aux [num_tokens, len(aux_layer_ids) *
            hidden_size] | None)``; ``aux`` concatenates the states in the order of
            ``aux_layer_ids`` and is ``None`` when that is empty.
        """
        assert input_ids.ndim == 1 and input_ids.shape == positions.shape
        hidden = self.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)  # [num_tokens, head_dim]
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if i in aux_layer_ids:
                captured[i] = hidden
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        captured[len(self.model.layers)] = hidden
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return self.model.norm(hidden), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits."""
        return F.linear(hidden, self.lm_head_weight).float()
