"""The EAGLE-3 draft network (Li et al., arXiv 2503.01840) over Llama or Qwen3 layers, under the
``speculators`` checkpoint's parameter names (design reference: vLLM's ``llama_eagle3.py``).

``fc`` fuses the target's auxiliary hidden states ``[n, num_aux * H_target]`` to width
``H`` once, when they arrive. The first decoder layer attends over
``cat(input_layernorm(embedding), hidden_norm(hidden))`` of width ``2H`` and keeps
``hidden`` as its residual; further layers are ordinary. ``norm`` and an ``lm_head`` over
the draft vocabulary follow; draft id ``i`` is target id ``i + d2t[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from specula.runtime.kernels.gemv import linear
from specula.runtime.models.config import ModelConfig, check_aux_layer_ids
from specula.runtime.models.layers import MergedLinear, RMSNorm, RotaryEmbedding
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.speculators_format import (
    DECODER_LAYERS,
    draft_vocab_ids,
    layer_model_config,
    load_draft_head,
    read_speculators_config,
    speculators_weight_name,
    target_vocab_logits,
)


@dataclass(frozen=True)
class Eagle3Config:
    """The EAGLE-3 settings of a ``speculators`` ``eagle3`` config (top-level fields)."""

    layer: ModelConfig
    """``transformer_layer_config``: width ``H``, heads, layers; ``vocab_size`` the target's."""
    draft_vocab_size: int
    aux_hidden_state_layer_ids: tuple[int, ...]
    target_hidden_size: int
    """Width of each auxiliary state (``target_hidden_size``, default ``H``)."""
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False


class Eagle3LlamaForCausalLM(nn.Module):
    """EAGLE-3 draft head; ``config``: the layer :class:`ModelConfig` (the KV cache's
    shape; ``vocab_size`` the target's)."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, eagle: Eagle3Config, device: torch.device) -> None:
        super().__init__()
        self.eagle = eagle
        self.config = config = eagle.layer
        h, eps = config.hidden_size, config.rms_norm_eps
        num_aux = len(eagle.aux_hidden_state_layer_ids)
        aux_width = num_aux * eagle.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.input_norm = RMSNorm(aux_width, eps) if eagle.norm_before_fc else None
        self.fc_norm = None
        if eagle.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(eagle.target_hidden_size, eps) for _ in range(num_aux))
        self.fc = nn.Linear(aux_width, h, bias=False)
        layer_cls = DECODER_LAYERS[config.model_type]
        self.layers = nn.ModuleList(layer_cls(config) for _ in range(config.num_hidden_layers))
        first = self.layers[0]  # attends over [embedding, hidden]: q/k/v read width 2H
        first.self_attn.qkv_proj = MergedLinear(2 * h, first.self_attn.qkv_proj.output_sizes,
                                                config.attention_bias)
        first.hidden_norm = RMSNorm(h, eps)
        first.norm_before_residual = eagle.norm_before_residual
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, eagle.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(eagle.draft_vocab_size), persistent=False)
        """[draft_vocab_size] target id of each draft id (``i + d2t[i]``)."""
        self.rotary = RotaryEmbedding.from_config(config, device)

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fuse the target's auxiliary states ``[n, num_aux * H_target]`` to ``[n, H]``."""
        if self.input_norm is not None:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        if self.fc_norm is not None:
            chunks = aux_hidden_states.chunk(len(self.fc_norm), dim=-1)
            aux_hidden_states = torch.cat(
                [norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return linear(aux_hidden_states, self.fc.weight, self.fc.bias)

    def compute_draft_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, H] -> [num_positions, draft_vocab_size] float32."""
        return linear(hidden, self.lm_head.weight).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, H] -> [num_positions, target vocab_size] float32
        (:func:`~specula.runtime.models.speculators_format.target_vocab_logits`)."""
        draft = self.compute_draft_vocab_logits(hidden)
        return target_vocab_logits(draft, self.draft_to_target, self.config.vocab_size)


def load_eagle3_draft(checkpoint_dir: Path, target: ModelConfig, dtype: torch.dtype,
                      device: torch.device, load_format: str = "auto") -> Eagle3LlamaForCausalLM:
    """Build the EAGLE-3 head of a ``speculators`` ``eagle3`` checkpoint for ``target``;
    ``embed_tokens.weight`` and ``lm_head.weight`` it lacks are the target's, as
    ``speculators`` fills them from the verifier.

    Raises:
        FileNotFoundError: no ``config.json`` or ``*.safetensors``.
        ValueError: another ``speculators_model_type``; a vocabulary, hidden size or auxiliary
            layer id that does not fit ``target`` (the message names the field and both values);
            a malformed ``d2t``; a wrong-shaped, unknown or missing required tensor.
    """
    raw = read_speculators_config(checkpoint_dir, "eagle3")
    layer = layer_model_config(raw, target)
    target_hidden = raw.get("target_hidden_size")
    field = "target_hidden_size" if target_hidden else "transformer_layer_config.hidden_size"
    target_hidden = target_hidden or layer.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"{field} {target_hidden} != target hidden_size {target.hidden_size}")
    n = target.num_hidden_layers
    aux_ids = check_aux_layer_ids(
        # EAGLE-3's default auxiliary layers, as vLLM and ``speculators`` choose them.
        raw.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3), n,
        "eagle_aux_hidden_state_layer_ids")
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    eagle = Eagle3Config(layer=layer,
                         draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                         aux_hidden_state_layer_ids=aux_ids, target_hidden_size=target_hidden,
                         **{flag: bool(raw.get(flag, False)) for flag in flags})
    factory = partial(Eagle3LlamaForCausalLM, eagle, device)
    model = load_draft_head(factory, checkpoint_dir, dtype, device, load_format, speculators_weight_name)
    # Not a weight: rebuild what to_empty left uninitialised.
    model.draft_to_target = draft_vocab_ids(checkpoint_dir, eagle.draft_vocab_size,
                                            layer.vocab_size, load_format).to(device)
    if model.missing_target_weights and layer.hidden_size != target.hidden_size:
        raise ValueError(f"checkpoint lacks {sorted(model.missing_target_weights)} and "
                         f"transformer_layer_config.hidden_size {layer.hidden_size} != target "
                         f"hidden_size {target.hidden_size}: the target's cannot be shared")
    return model
