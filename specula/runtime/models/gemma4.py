"""Gemma4 text decoder: the modules that hold the weights (the paged forward is
:class:`~specula.runtime.worker.gemma4_runner.Gemma4Runner`'s), under Hugging Face
``Gemma4ForCausalLM`` parameter names (``Gemma4ForConditionalGeneration`` checkpoints
too: their text model). Only ``gate/up_proj`` are fused: KV-shared layers have no
``k/v_proj``, full-attention layers with ``attention_k_eq_v`` no ``v_proj``.

What sets it apart from Llama (Gemma 4 model card, Google DeepMind 2026; the Gemma 3 report, arXiv
2503.19786, for the shared parts): per-layer-type geometry and rotary embeddings (``proportional``
RoPE rotates a ``partial_rotary_factor`` share of the dimensions); RMSNorm on queries, keys and
(unscaled) values, attention scale 1, norms after attention and the MLP as well as before;
embeddings scaled by ``sqrt(hidden_size)``; a learned ``layer_scalar`` per layer; final logit
soft-capping; per-layer input embeddings (PLE) gated into the residual stream after each MLP;
KV-shared layers (:class:`~specula.runtime.models.gemma4_config.Gemma4ModelConfig`). The
mixture-of-experts variant (``enable_moe_block``) is refused at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.gemma4_config import ACTIVATIONS, SLIDING, Gemma4ModelConfig
from specula.runtime.models.gemma4_layers import Gemma4RMSNorm, Gemma4Rotary
from specula.runtime.models.layers import MergedLinear
from specula.runtime.models.llama import LlamaForCausalLM


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as HF Gemma keeps its embedding scales (sqrt(3072)
    is 55.5 in bfloat16)."""
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
        bias, eps = config.attention_bias, config.rms_norm_eps
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not kv_shared:
            self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
            k_eq_v = config.attention_k_eq_v and config.layer_types[layer_idx] != SLIDING
            self.v_proj = None if k_eq_v else nn.Linear(hidden, kv_size, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)


class Gemma4MLP(nn.Module):
    def __init__(self, config: Gemma4ModelConfig, intermediate_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate_up_proj = MergedLinear(hidden, [intermediate_size] * 2, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP, the per-layer input, then the learned ``layer_scalar``."""

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
        ple = config.hidden_size_per_layer_input
        if ple:
            self.act = ACTIVATIONS[config.hidden_act]
            self.per_layer_input_gate = nn.Linear(hidden, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)


class Gemma4TextModel(nn.Module):
    """Embeddings, decoder layers and final norm; ``all_kv_shared``: every layer reads
    another model's KV (a Gemma4 MTP draft's layers, over the target's cache)."""

    def __init__(self, config: Gemma4ModelConfig, all_kv_shared: bool = False) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, all_kv_shared or i >= config.first_kv_shared_layer)
            for i in range(config.num_hidden_layers))
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
    """Gemma4 causal LM with the :class:`LlamaForCausalLM` interface (aux id ``0``: the
    scaled embedding output)."""

    model_cls = Gemma4TextModel
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Gemma4ModelConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.config: Gemma4ModelConfig = config
        self.rotary = Gemma4Rotary(config, device)
        self.multimodal_checkpoint = config.architecture == "Gemma4ForConditionalGeneration"

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for checkpoint tensor ``name`` (``None``: the vision and
        audio towers of a ``Gemma4ForConditionalGeneration`` checkpoint, whose text model
        is under ``model.language_model.``)."""
        if not self.multimodal_checkpoint or not name.startswith("model."):
            return name
        prefix = "model.language_model."
        return "model." + name[len(prefix) :] if name.startswith(prefix) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits,
        soft-capped to ``(-cap, cap)`` when ``final_logit_softcapping`` is set."""
        logits = F.linear(hidden, self.lm_head_weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
