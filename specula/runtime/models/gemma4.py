"""Gemma4 text decoder over a flattened batch with a slot KV cache.

Parameter names follow Hugging Face ``Gemma4ForCausalLM`` so checkpoints load by name
(``Gemma4ForConditionalGeneration`` checkpoints too: their text model). Only
``gate/up_proj`` are fused: KV-shared layers have no ``k/v_proj``, and full-attention
layers with ``attention_k_eq_v`` no ``v_proj``.

What sets it apart from Llama (Gemma 4 model card, Google DeepMind 2026; the Gemma 3
report, arXiv 2503.19786, for the shared parts):

- sliding-window and full-attention layers (``layer_types``), each type with its own
  head size, KV heads and rotary embedding (``proportional`` RoPE rotates only a
  ``partial_rotary_factor`` share of the full layers' dimensions);
- RMSNorm on queries, keys and (unscaled) values, attention scale 1, and a norm after
  attention and after the MLP as well as before them; embeddings scaled by
  ``sqrt(hidden_size)``; a learned ``layer_scalar`` per layer; final logit soft-capping;
- per-layer input embeddings (PLE): a second, narrow embedding per layer, gated into the
  residual stream after each MLP;
- ``num_kv_shared_layers``: the last layers compute no keys or values and attend to the
  cache of the last earlier non-shared layer of their type, which the KV cache does
  not allocate for them (:meth:`Gemma4ModelConfig.kv_cache_shapes`);
- optionally (26B-A4B) a routed mixture of experts beside each dense MLP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.attention import (
    AttentionMetadata,
    attend_cached,
    cached_attention,
    with_sliding_window,
)
from specula.runtime.models.gemma4_config import SLIDING, Gemma4ModelConfig
from specula.runtime.models.gemma4_layers import (
    Gemma4Experts,
    Gemma4RMSNorm,
    Gemma4Rotary,
    Gemma4Router,
    activation,
)
from specula.runtime.models.layers import MergedLinear, apply_rotary
from specula.runtime.models.llama import KVCaches, LlamaForCausalLM


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``: HF Gemma keeps its embedding scales as tensors in
    the weights' dtype (sqrt(3072) is 55.5 in bfloat16), and checkpoints expect that."""
    return torch.tensor(value, dtype=dtype).item()


class Gemma4Attention(nn.Module):
    """Attention of layer ``layer_idx``; a KV-shared layer has only ``q_proj`` (and
    ``q_norm``, ``o_proj``) and reads the cache it is given without writing it."""

    def __init__(self, config: Gemma4ModelConfig, layer_idx: int, kv_shared: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_num_kv_heads[layer_idx]
        self.head_dim = config.layer_head_dims[layer_idx]
        self.kv_shared = kv_shared
        bias = config.attention_bias
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        eps = config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not kv_shared:
            self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
            k_eq_v = config.attention_k_eq_v and config.layer_types[layer_idx] != SLIDING
            self.v_proj = None if k_eq_v else nn.Linear(hidden, kv_size, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]; cos, sin: [num_tokens, head_dim]
        n = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(n, self.num_heads, self.head_dim))
        q = apply_rotary(q, cos, sin)
        # q, k and v are normed, so the softmax scale is 1 (no head_dim ** -0.5).
        if self.kv_shared:
            out = attend_cached(q, kv_cache[0], kv_cache[1], metadata, 1.0)
        else:
            k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(hidden).view(k.shape)
            k = apply_rotary(self.k_norm(k), cos, sin)
            v = self.v_norm(v)
            out = cached_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, 1.0)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class Gemma4MLP(nn.Module):
    def __init__(self, config: Gemma4ModelConfig, intermediate_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate_up_proj = MergedLinear(hidden, [intermediate_size] * 2, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden, bias=False)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP (plus experts), then the layer's per-layer
    input, then the learned ``layer_scalar``."""

    def __init__(self, config: Gemma4ModelConfig, layer_idx: int, kv_shared: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, kv_shared)
        wide = config.use_double_wide_mlp and kv_shared
        self.mlp = Gemma4MLP(config, config.intermediate_size * (2 if wide else 1))
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        # A parameter (not a buffer) so that it loads from the checkpoint by name.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.enable_moe_block = config.enable_moe_block
        if self.enable_moe_block:
            self.router = Gemma4Router(config)
            self.experts = Gemma4Experts(config)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        ple = config.hidden_size_per_layer_input
        if ple:
            self.act = activation(config.hidden_act)
            self.per_layer_input_gate = nn.Linear(hidden, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]; per_layer_input: [num_tokens, ple] | None
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.enable_moe_block:
            # The router and experts read the residual stream before the MLP.
            weights, experts = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), weights, experts)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        hidden = hidden + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, config: Gemma4ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, config.is_kv_shared(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = Gemma4RMSNorm(hidden, eps)
        ple = config.hidden_size_per_layer_input
        if ple:
            packed = config.num_hidden_layers * ple
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, packed)
            self.per_layer_model_projection = nn.Linear(hidden, packed, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(ple, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden_size], scaled by ``sqrt(hidden_size)``
        rounded to the weights' dtype (as the checkpoint was trained)."""
        scale = _rounded(self.config.hidden_size**0.5, self.embed_tokens.weight.dtype)
        return self.embed_tokens(input_ids) * scale

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE: ``(norm(proj(embeds) / sqrt(H)) + sqrt(ple) * E_pl[ids]) / sqrt(2)``.

        Returns:
            [num_tokens, num_hidden_layers, hidden_size_per_layer_input]
        """
        n, layers = input_ids.shape[0], self.config.num_hidden_layers
        ple = self.config.hidden_size_per_layer_input
        scale = _rounded(ple**0.5, self.embed_tokens_per_layer.weight.dtype)
        token = (self.embed_tokens_per_layer(input_ids) * scale).view(n, layers, ple)
        context = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.view(n, layers, ple))
        return (context + token) * 2.0**-0.5


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma4 causal LM with the :class:`LlamaForCausalLM` interface (``forward``,
    ``forward_with_aux``, ``compute_logits``); ``kv_caches`` holds one entry per
    non-shared layer, in layer order."""

    model_cls = Gemma4TextModel
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Gemma4ModelConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.config: Gemma4ModelConfig = config
        self.rotary = Gemma4Rotary(config, device)
        self.kv_sources = config.kv_source_layers()
        """Per layer, the index in ``kv_caches`` it reads (and writes when not shared)."""
        self.multimodal_checkpoint = config.architecture == "Gemma4ForConditionalGeneration"

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for checkpoint tensor ``name``: a
        ``Gemma4ForConditionalGeneration`` checkpoint keeps the text model under
        ``model.language_model.`` and its vision/audio towers (which text generation does
        not use, ``None``) elsewhere under ``model.``."""
        if not self.multimodal_checkpoint or not name.startswith("model."):
            return name
        prefix = "model.language_model."
        return "model." + name[len(prefix) :] if name.startswith(prefix) else None

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        metadata: AttentionMetadata,
        aux_layer_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`LlamaForCausalLM.forward_with_aux`; aux ids count Gemma4 decoder
        layers the same way (``0``: the scaled embedding output)."""
        assert input_ids.ndim == 1 and input_ids.shape == positions.shape
        config = self.config
        assert len(kv_caches) == config.first_kv_shared_layer
        hidden = self.model.embed(input_ids)  # [num_tokens, hidden_size]
        per_layer = None
        if config.hidden_size_per_layer_input:
            per_layer = self.model.per_layer_inputs(input_ids, hidden)  # [n, layers, ple]
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        layer_metadata = {t: metadata for t in rope}
        if SLIDING in layer_metadata:
            layer_metadata[SLIDING] = with_sliding_window(metadata, config.sliding_window)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                captured[i] = hidden
            layer_type = config.layer_types[i]
            cos, sin = rope[layer_type]
            hidden = layer(
                hidden,
                None if per_layer is None else per_layer[:, i],
                cos,
                sin,
                kv_caches[self.kv_sources[i]],
                layer_metadata[layer_type],
            )
        captured[len(self.model.layers)] = hidden
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return self.model.norm(hidden), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits,
        soft-capped to ``(-cap, cap)`` when ``final_logit_softcapping`` is set."""
        logits = F.linear(hidden, self.lm_head_weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
