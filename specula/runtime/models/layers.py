"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, fused linears."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specula.runtime.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (arXiv 1910.07467), computed in float32 like HF Llama."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MergedLinear(nn.Linear):
    """A linear layer whose output rows concatenate several checkpoint projections (one
    matmul instead of two or three): ``output_sizes[i]`` rows starting at
    ``sum(output_sizes[:i])`` hold shard ``i`` (for ``qkv_proj``: q, k, v)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, shard_id: int, loaded: torch.Tensor) -> None:
        """Copy checkpoint tensor ``loaded`` into rows of shard ``shard_id``.

        Raises:
            ValueError: ``loaded`` does not have the shard's shape.
        """
        start = sum(self.output_sizes[:shard_id])
        rows = getattr(self, param_name).data.narrow(0, start, self.output_sizes[shard_id])
        if rows.shape != loaded.shape:
            raise ValueError(f"shard {shard_id} of {param_name}: checkpoint shape "
                             f"{tuple(loaded.shape)} != expected {tuple(rows.shape)}")
        rows.copy_(loaded)


def sharded(module: nn.Module, style: str, tensor_parallel_size: int) -> nn.Module:
    """Mark ``module`` as split over ``tensor_parallel_size`` ranks by ``style``
    (``colwise``, ``rowwise`` or ``vocab``; :func:`~specula.runtime.worker.parallel.
    shard_tensor`): the loader copies only this rank's part of each checkpoint tensor."""
    if tensor_parallel_size > 1:
        module.tp_style = style
    return module


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 frequency remapping: long wavelengths are divided by `factor`, short ones
    # kept, and the band between is interpolated smoothly.
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotary position embedding (RoFormer, arXiv 2104.09864), "rotate half" layout, of
    rope type ``default``, ``linear``, ``llama3`` or Gemma4's ``proportional`` (the first
    ``int(partial_rotary_factor * head_dim // 2)`` pairs' default frequencies, the rest
    zero, all divided by ``factor``). Not an ``nn.Module``: derived, never loaded.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "proportional":
            inv_freq[int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2) :] = 0.0
            inv_freq = inv_freq / scaling.get("factor", 1.0)
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported")
        self.inv_freq = inv_freq  # [head_dim // 2], float32

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device) -> RotaryEmbedding:
        """The embedding of ``config``'s ``head_dim``, ``rope_theta`` and ``rope_scaling``."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, device)


LOAD_FORMATS = ("auto", "dummy")
"""``auto``: read the checkpoint's ``*.safetensors``; ``dummy``: random weights from the
config alone, for benchmarks (vLLM's ``load_format`` of the same names)."""


@torch.no_grad()
def init_dummy_weights(model: nn.Module, skip: tuple[str, ...] = (), std: float = 0.02) -> None:
    """Random weights for ``load_format: dummy``: matrices ``N(0, std)``, norm weights
    and scalars 1, biases 0; parameters named in ``skip`` are left alone."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if name in skip:
            continue
        if p.ndim >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def build_empty(factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device):
    """Build ``factory()`` on the meta device, cast its floating-point tensors to ``dtype``
    and allocate uninitialised storage on ``device`` (no time spent initialising weights
    a checkpoint overwrites); callers rebuild buffers computed at construction."""
    with torch.device("meta"):
        model = factory()
        model.to(dtype)
    return model.to_empty(device=device)
