"""The multi-token-prediction (MTP) draft head of DeepSeek-V3 (arXiv 2412.19437, §2.2).

At position ``p``, ``eh_proj(cat(enorm(embedding of t_{p+1}), hnorm(h_p)))`` (``h_p`` the target's
final hidden state) goes through one decoder block and a final norm; the target's LM head gives
logits for ``t_{p+2}`` and the normed state conditions the next step. Checkpoints are the
``speculators`` ``mtp`` format, whose ``token_layernorm``, ``hidden_layernorm`` and ``input_proj``
are DeepSeek's ``enorm``, ``hnorm`` and ``eh_proj``. Design reference: vLLM's ``deepseek_mtp.py``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from specula.runtime.kernels.gemv import linear
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.layers import RMSNorm, RotaryEmbedding
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.speculators_format import (
    DECODER_LAYERS,
    layer_model_config,
    load_draft_head,
    read_speculators_config,
    speculators_weight_name,
)

_CHECKPOINT_NAMES = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj"}
"""``speculators`` MTP module name -> DeepSeek name used here."""


class MTPLayer(nn.Module):
    """``enorm``, ``hnorm``, ``eh_proj``, one decoder ``block``, ``final_layernorm``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DECODER_LAYERS[config.model_type](config)
        self.final_layernorm = RMSNorm(h, config.rms_norm_eps)


class MTPForCausalLM(nn.Module):
    """One MTP layer over the target's embeddings and LM head; ``config``: the layer
    :class:`ModelConfig` with ``num_hidden_layers`` 1 (the format's counts the verifier's)."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.config = replace(config, num_hidden_layers=1)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp_layers = nn.ModuleList([MTPLayer(config)])
        self.rotary = RotaryEmbedding.from_config(config, device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, H] -> [num_positions, vocab_size] float32."""
        return linear(hidden, self.lm_head.weight).float()


def _model_name(checkpoint_name: str) -> str | None:
    """Our parameter name of a ``speculators`` MTP tensor (``None``: not a weight)."""
    parts = checkpoint_name.split(".")
    if parts[0] != "mtp_layers" or len(parts) < 4 or parts[2] == "final_layernorm":
        return speculators_weight_name(checkpoint_name)
    module = _CHECKPOINT_NAMES.get(parts[2], f"block.{parts[2]}")
    return ".".join([*parts[:2], module, *parts[3:]])


def load_mtp_draft(checkpoint_dir: Path, target: ModelConfig, dtype: torch.dtype,
                   device: torch.device, load_format: str = "auto") -> MTPForCausalLM:
    """Build the MTP head of a ``speculators`` ``mtp`` checkpoint for ``target``; it
    shares the target's ``embed_tokens`` and ``lm_head``, which ``speculators`` never
    saves (:func:`~specula.runtime.models.speculators_format.share_target_weights`).

    Raises:
        FileNotFoundError: no ``config.json`` or ``*.safetensors``.
        ValueError: another ``speculators_model_type``; a vocabulary or hidden size that differs
            from ``target``'s (the message names the field and both values); a wrong-shaped,
            unknown or missing required tensor; ``num_nextn_predict_layers`` other than 1.
    """
    raw = read_speculators_config(checkpoint_dir, "mtp")
    layer = layer_model_config(raw, target)
    if layer.hidden_size != target.hidden_size:
        raise ValueError(f"transformer_layer_config.hidden_size {layer.hidden_size} != target "
                         f"hidden_size {target.hidden_size}")
    num_layers = raw.get("num_nextn_predict_layers", 1)
    if num_layers != 1:
        # The format itself defines one layer (speculators' MTPSpeculatorConfig).
        raise ValueError(f"num_nextn_predict_layers {num_layers} is not supported (only 1)")
    factory = partial(MTPForCausalLM, layer, device)
    return load_draft_head(factory, checkpoint_dir, dtype, device, load_format, _model_name)
