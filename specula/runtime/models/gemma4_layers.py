"""Gemma4 building blocks: its RMSNorm and per-layer-type rotary embeddings (with
``proportional`` RoPE)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.layers import RotaryEmbedding


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation Hugging Face's ``ACT2FN[name]`` denotes.

    Raises:
        ValueError: a name other than ``gelu_pytorch_tanh``, ``gelu``, ``silu``.
    """
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"activation {name!r} is not supported")


class Gemma4RMSNorm(nn.Module):
    """RMSNorm in float32 with a plain ``weight`` scale (Gemma4 dropped the ``1 + weight``
    of Gemma 1-3); ``with_scale=False`` has no weight (Gemma4's value norm)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]; normed and scaled in float32, cast back last, as HF does.
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)


def layer_type_rotary(
    head_dim: int, params: dict, device: torch.device | None
) -> RotaryEmbedding:
    """The rotary embedding of one layer type from its ``rope_parameters`` entry.

    ``proportional`` RoPE keeps the default frequencies of the first
    ``int(partial_rotary_factor * head_dim // 2)`` pairs and zeroes the rest (those
    dimensions pass through unrotated), all divided by ``factor``.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type != "proportional":
        return RotaryEmbedding(head_dim, theta, params if rope_type != "default" else None, device)
    rotary = RotaryEmbedding(head_dim, theta, None, device)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = rotary.inv_freq.clone()
    inv_freq[angles:] = 0.0
    rotary.inv_freq = inv_freq / params.get("factor", 1.0)
    return rotary


class Gemma4Rotary:
    """One rotary embedding per layer type (not an ``nn.Module``: derived from the
    config, never loaded)."""

    def __init__(self, config: Gemma4ModelConfig, device: torch.device | None) -> None:
        rope = config.rope_parameters or {}
        self.by_type = {}
        for layer_type in dict.fromkeys(config.layer_types):
            head_dim = config.layer_head_dims[config.layer_types.index(layer_type)]
            self.by_type[layer_type] = layer_type_rotary(head_dim, rope.get(layer_type, {}), device)
