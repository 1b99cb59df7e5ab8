"""The Gemma4 MTP draft network (Hugging Face ``Gemma4AssistantForCausalLM``, model type
``gemma4_assistant``) and its checkpoint loading.

A row is ``pre_projection(cat(target_embedding(token), backbone_hidden))`` through Gemma4
decoder layers with query-only attention on the target's KV (layer type ``t`` reads the
target's last non-shared layer of type ``t``), then the final norm; its logits come from
the tied ``lm_head`` or, with ``use_ordered_embeddings``, only over the tokens of the top
centroids. The draft steps: :mod:`specula.runtime.spec_decode.gemma4`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.config import read_hf_config
from specula.runtime.models.gemma4 import Gemma4ForCausalLM, Gemma4TextModel
from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.gemma4_layers import Gemma4Rotary
from specula.runtime.models.registry import load_checkpoint

ASSISTANT_MODEL_TYPE = "gemma4_assistant"


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    """``transformers``' ``Gemma4AssistantConfig``: the layers' text config plus the
    projection and logits settings."""

    text: Gemma4ModelConfig
    """The assistant's own layers (every one KV-shared with the target)."""
    backbone_hidden_size: int
    """Hidden size of the target it was trained with."""
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> Gemma4AssistantConfig:
        """Read ``config.json`` of a ``gemma4_assistant`` checkpoint.

        Raises:
            FileNotFoundError: no ``config.json``.
            ValueError: another ``model_type``, or settings the assistant does not allow (per-layer
                inputs, experts, double-wide MLPs); the message names the field and its value.
        """
        hf = read_hf_config(checkpoint_dir)
        if hf.model_type != ASSISTANT_MODEL_TYPE:
            raise ValueError(f"gemma4_mtp draft model_type {hf.model_type!r} != "
                             f"{ASSISTANT_MODEL_TYPE!r}")
        text = hf.get_text_config()
        for field in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
            if getattr(text, field, None):
                raise ValueError(f"gemma4_assistant text_config.{field} "
                                 f"{getattr(text, field)!r} must be off")
        architectures = getattr(hf, "architectures", None) or ["Gemma4AssistantForCausalLM"]
        return cls(text=Gemma4ModelConfig.from_text_config(text, architectures[0], outer=hf),
                   backbone_hidden_size=int(hf.backbone_hidden_size),
                   use_ordered_embeddings=bool(hf.use_ordered_embeddings),
                   num_centroids=int(hf.num_centroids),
                   centroid_intermediate_top_k=int(hf.centroid_intermediate_top_k))


def check_gemma4_target(config: Gemma4AssistantConfig, target: Any) -> None:
    """Check that a Gemma4 assistant can draft for ``target`` (a ``ModelConfig``).

    Raises:
        ValueError: the target is not a Gemma4 text model, or a shape the assistant
            depends on differs; the message names the field and both values.
    """
    if not isinstance(target, Gemma4ModelConfig):
        raise ValueError(f"a gemma4_mtp draft needs a Gemma4 target: target model_type "
                         f"{target.model_type!r} ({target.architecture}) != 'gemma4_text'")
    text = config.text
    for field, ours, theirs in (
        ("backbone_hidden_size", config.backbone_hidden_size, "hidden_size"),
        ("vocab_size", text.vocab_size, "vocab_size"),
    ):
        if ours != getattr(target, theirs):
            raise ValueError(f"draft {field} {ours} != target {theirs} {getattr(target, theirs)}")
    producers = target.kv_producer_layers()
    for i, layer_type in enumerate(text.layer_types):
        if layer_type not in producers:
            raise ValueError(f"draft layer {i} is {layer_type} but the target has no non-shared "
                             f"{layer_type} layer (target layer_types "
                             f"{sorted(set(target.layer_types))})")
        src = producers[layer_type]
        if text.layer_head_dims[i] != target.layer_head_dims[src]:
            raise ValueError(f"draft layer {i} ({layer_type}) head_dim {text.layer_head_dims[i]} "
                             f"!= target layer {src} head_dim {target.layer_head_dims[src]}")
        if text.num_attention_heads % target.layer_num_kv_heads[src]:
            raise ValueError(f"draft num_attention_heads {text.num_attention_heads} is not a "
                             f"multiple of target layer {src} ({layer_type}) num_key_value_heads "
                             f"{target.layer_num_kv_heads[src]}")


class Gemma4AssistantMaskedEmbedder(nn.Module):
    """Sparse logits over an ordered vocabulary: ``centroids`` score ``num_centroids``
    clusters of ``vocab_size / num_centroids`` tokens (``token_ordering`` lists them
    cluster by cluster); only tokens of the top ``centroid_intermediate_top_k`` clusters
    get a real logit, every other token the row's lowest real logit minus one."""

    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.num_centroids, self.top_k = config.num_centroids, config.centroid_intermediate_top_k
        self.centroids = nn.Linear(config.text.hidden_size, config.num_centroids, bias=False)
        self.token_ordering = nn.Parameter(torch.zeros(config.text.vocab_size, dtype=torch.long),
                                           requires_grad=False)

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] (hidden's dtype)."""
        n = hidden.shape[0]
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [n, top_k]
        clusters = self.token_ordering.view(self.num_centroids, -1)  # [C, V / C]
        tokens = clusters[top].reshape(n, -1)  # [n, top_k * V / C]
        selected = torch.einsum("nh,nth->nt", hidden, lm_head_weight[tokens])
        # Per row (HF takes the minimum over the whole batch): one request's logits never
        # depend on which other requests share the forward.
        floor = selected.min(dim=-1, keepdim=True).values - 1.0
        return floor.expand(n, lm_head_weight.shape[0]).clone().scatter_(1, tokens, selected)


class Gemma4AssistantForCausalLM(nn.Module):
    """The assistant network; parameter names follow the Hugging Face checkpoint."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Gemma4AssistantConfig, device: torch.device) -> None:
        super().__init__()
        self.config, text = config, config.text
        # Its embedding serves only the logits (tied lm_head); inputs use the target's embedding.
        self.model = Gemma4TextModel(text, all_kv_shared=True)
        self.lm_head = (None if text.tie_word_embeddings
                        else nn.Linear(text.hidden_size, text.vocab_size, bias=False))
        backbone = config.backbone_hidden_size
        self.pre_projection = nn.Linear(2 * backbone, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, backbone, bias=False)
        self.masked_embedding = (Gemma4AssistantMaskedEmbedder(config)
                                 if config.use_ordered_embeddings else None)
        self.rotary = Gemma4Rotary(text, device)

    lm_head_weight = Gemma4ForCausalLM.lm_head_weight  # the tied embedding or the own head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 draft logits."""
        if self.masked_embedding is not None:
            return self.masked_embedding(hidden, self.lm_head_weight).float()
        return F.linear(hidden, self.lm_head_weight).float()

    @property
    def sliding_window(self) -> int:
        """Target positions a sliding layer's row at position ``p`` sees: ``p - 1 - W ..
        p - 1``, i.e. ``W + 1`` of them, since the assistant counts distance inclusively
        (``|q - kv| <= W``, transformers' bidirectional sliding-window mask)."""
        return self.config.text.sliding_window + 1


def load_gemma4_assistant(checkpoint_dir: Path, dtype: torch.dtype, device: torch.device,
                          load_format: str = "auto") -> Gemma4AssistantForCausalLM:
    """Build the assistant of ``checkpoint_dir`` and load its ``*.safetensors``.

    Raises:
        FileNotFoundError: no ``config.json`` or ``*.safetensors``.
        ValueError: not a ``gemma4_assistant`` checkpoint, or tensors that do not fit.
    """
    config = Gemma4AssistantConfig.from_pretrained(checkpoint_dir)
    factory = partial(Gemma4AssistantForCausalLM, config, device=device)
    model, _ = load_checkpoint(factory, Path(checkpoint_dir), dtype, device, load_format)
    if load_format == "dummy" and model.masked_embedding is not None:
        model.masked_embedding.token_ordering.copy_(torch.randperm(config.text.vocab_size))
    return model
