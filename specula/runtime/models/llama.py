"""Llama decoder (arXiv 2302.13971, 2407.21783): the modules that hold the weights.

Parameter names follow Hugging Face ``LlamaForCausalLM`` so checkpoints load by name;
``q/k/v_proj`` and ``gate/up_proj`` are fused (see ``packed_modules_mapping``). The
forward over a paged KV cache is :class:`~specula.runtime.worker.model_runner.
ModelRunner`'s, which runs these parameters through the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specula.runtime.kernels.gemv import linear
from specula.runtime.models.config import ModelConfig, check_aux_layer_ids
from specula.runtime.models.layers import MergedLinear, RMSNorm, RotaryEmbedding


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


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM weights; ``compute_logits`` projects final hidden states to the
    vocabulary, so callers project only the positions they sample from."""

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
        self.rotary = RotaryEmbedding.from_config(config, device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def check_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """Validate auxiliary hidden-state layer ids: id ``i`` is the residual stream
        entering decoder layer ``i``, ``0`` the embedding output and ``num_hidden_layers``
        the last layer's output before the final norm, as EAGLE-3 (arXiv 2503.01840) and
        vLLM's ``aux_hidden_state_layers`` define them (for ``i < num_hidden_layers``
        Hugging Face's ``output_hidden_states[i]``).

        Raises:
            ValueError: an id outside ``[0, num_hidden_layers]``; the message names the
                field and both values.
        """
        return check_aux_layer_ids(layer_ids, self.config.num_hidden_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits."""
        return linear(hidden, self.lm_head_weight).float()
