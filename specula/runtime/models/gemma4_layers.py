"""Gemma4 building blocks: its RMSNorm and per-layer-type rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.layers import RotaryEmbedding


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


class Gemma4Rotary:
    """One rotary embedding per layer type, from its ``rope_parameters`` entry (not an
    ``nn.Module``: derived from the config, never loaded).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """

    def __init__(self, config: Gemma4ModelConfig, device: torch.device | None) -> None:
        self.by_type = {}
        for layer_type in dict.fromkeys(config.layer_types):
            head_dim = config.layer_head_dims[config.layer_types.index(layer_type)]
            params = (config.rope_parameters or {}).get(layer_type, {})
            theta = float(params.get("rope_theta", 10000.0))
            self.by_type[layer_type] = RotaryEmbedding(head_dim, theta, params, device)
