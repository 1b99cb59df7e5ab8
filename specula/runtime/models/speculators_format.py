"""Reading draft heads saved in the ``speculators`` format: a ``config.json`` naming the
method in ``speculators_model_type`` (``"eagle3"``, ``"mtp"``, ...), the draft's decoder
layers in ``transformer_layer_config`` (a Hugging Face config dict) and method settings at
the top level; ``*.safetensors`` named after the draft's modules, plus the ``d2t`` /
``t2d`` vocabulary maps of heads with a reduced vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama import LlamaDecoderLayer
from specula.runtime.models.qwen3 import Qwen3DecoderLayer
from specula.runtime.models.registry import load_checkpoint

DECODER_LAYERS: dict[str, type[LlamaDecoderLayer]] = {"llama": LlamaDecoderLayer,
                                                      "qwen3": Qwen3DecoderLayer}
"""``transformer_layer_config.model_type`` -> decoder layer class."""

SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
"""Parameters a draft head's checkpoint may lack: the target's embeddings and head."""


def read_speculators_config(checkpoint_dir: Path, expected_type: str) -> dict[str, Any]:
    """Parse ``config.json`` of a ``speculators`` checkpoint for method ``expected_type``.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: ``speculators_model_type`` missing or not ``expected_type``, or no
            ``transformer_layer_config``; the message names the field and both values.
    """
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(checkpoint_dir)!r}")
    config = json.loads(path.read_text())
    found = config.get("speculators_model_type")
    if found != expected_type:
        raise ValueError(f"speculators_model_type is {found!r}, expected {expected_type!r} "
                         f"(checkpoint {str(checkpoint_dir)!r})")
    if not isinstance(config.get("transformer_layer_config"), dict):
        raise ValueError(f"{expected_type} checkpoint has no transformer_layer_config")
    return config


def layer_model_config(config: dict[str, Any], target: ModelConfig | None = None,
                       default_type: str | None = None) -> ModelConfig:
    """``transformer_layer_config`` (``model_type`` default: ``default_type``) through
    ``transformers.AutoConfig.for_model``, as ``speculators`` reads it; with a ``target``,
    layers of :data:`DECODER_LAYERS` over its vocabulary.

    Raises:
        ValueError: a setting our layers do not implement (sliding-window layers, an
            activation other than SiLU); with a ``target``, a ``model_type`` outside
            :data:`DECODER_LAYERS` or a ``vocab_size`` other than ``target``'s.
    """
    from transformers import AutoConfig

    layer = dict(config["transformer_layer_config"])
    model_type = layer.pop("model_type", None) or default_type
    if target is not None and model_type not in DECODER_LAYERS:
        raise ValueError(f"transformer_layer_config.model_type {model_type!r} is not supported "
                         "(llama, qwen3)")
    hf = AutoConfig.for_model(model_type, **layer)
    layer_types = getattr(hf, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"transformer_layer_config.layer_types {list(layer_types)}: only "
                         "full-attention layers are supported")
    # Only the layer shapes matter here; ModelConfig wants an architecture name.
    hf.architectures = getattr(hf, "architectures", None) or ["DraftLayers"]
    ours = ModelConfig.from_hf_config(hf)
    if target is not None and ours.vocab_size != target.vocab_size:
        raise ValueError(f"transformer_layer_config.vocab_size {ours.vocab_size} != target "
                         f"vocab_size {target.vocab_size}")
    return ours


def load_draft_head(factory: Callable[[], nn.Module], checkpoint_dir: Path, dtype: torch.dtype,
                    device: torch.device, load_format: str,
                    rename: Callable[[str], str | None]) -> nn.Module:
    """:func:`load_checkpoint` through ``rename``, recording the :data:`SHARED_WITH_TARGET`
    tensors it lacks in ``missing_target_weights`` for :func:`share_target_weights`."""
    model, missing = load_checkpoint(factory, checkpoint_dir, dtype, device, load_format, rename,
                                     SHARED_WITH_TARGET)
    model.missing_target_weights = missing
    return model


def speculators_weight_name(name: str) -> str | None:
    """``name``, or ``None`` for the vocabulary maps and training-only ``verifier_*``."""
    return None if name in ("d2t", "t2d") or name.startswith("verifier_") else name


def share_target_weights(model: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                         rows: torch.Tensor | None = None) -> None:
    """Give a draft head the target's embeddings and LM head where its checkpoint had
    none (``model.missing_target_weights``); ``rows``: the LM head is a copy of only these
    rows (the target ids of a draft vocabulary)."""
    if "embed_tokens.weight" in model.missing_target_weights:
        model.embed_tokens = embed
    if "lm_head.weight" in model.missing_target_weights:
        weight = lm_head_weight if rows is None else lm_head_weight[rows]
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        model.lm_head.weight = weight
    model.missing_target_weights = set()


def draft_vocab_ids(checkpoint_dir: Path, draft_vocab_size: int, vocab_size: int,
                    load_format: str) -> torch.Tensor:
    """The target id ``i + d2t[i]`` of each draft id ``i``, ``[draft_vocab_size]`` int64 on
    the CPU (random distinct ids for ``load_format: dummy``).

    Raises:
        ValueError: a reduced vocabulary without a ``d2t`` of shape ``[draft_vocab_size]``,
            or one mapping outside ``[0, vocab_size)`` or two draft ids onto one target id.
    """
    n = draft_vocab_size
    if n == vocab_size:
        return torch.arange(n)
    if load_format == "dummy":
        return torch.randperm(vocab_size)[:n].sort().values
    from safetensors import safe_open

    d2t = None
    for file in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if d2t is None and "d2t" in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                d2t = f.get_tensor("d2t")
    if d2t is None:
        raise ValueError(f"draft_vocab_size {n} != target vocab_size {vocab_size} but the "
                         "checkpoint has no d2t")
    if d2t.shape != (n,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {n}")
    target_ids = torch.arange(n) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ValueError(f"d2t maps draft ids to target ids in [{int(target_ids.min())}, "
                         f"{int(target_ids.max())}], outside the target vocab_size {vocab_size}")
    if target_ids.unique().numel() != n:
        raise ValueError("d2t maps two draft ids onto one target id")
    return target_ids


def target_vocab_logits(draft_logits: torch.Tensor, draft_to_target: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """``[n, draft_vocab_size]`` logits -> ``[n, vocab_size]``: each at its target id
    (``draft_to_target``), ``-inf`` (probability zero) at ids outside the draft vocabulary."""
    if draft_logits.shape[-1] == vocab_size:
        return draft_logits
    logits = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    logits[:, draft_to_target] = draft_logits
    return logits
