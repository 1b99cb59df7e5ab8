"""Qwen3 decoder (arXiv 2505.09388): Llama plus RMSNorm over each query and key head
before the rotary embedding; HF ``Qwen3ForCausalLM`` parameter names."""

from __future__ import annotations

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.layers import RMSNorm
from specula.runtime.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
