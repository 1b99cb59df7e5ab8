"""Gemma4 building blocks: its RMSNorm, per-layer-type rotary embeddings (with
``proportional`` RoPE) and the routed experts of the mixture-of-experts variant."""

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

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, ``cos, sin`` of shape ``[num_tokens, head_dim]``."""
        return {t: r.cos_sin(positions, dtype) for t, r in self.by_type.items()}


class Gemma4Router(nn.Module):
    """Top-k expert choice: an unscaled RMSNorm, a learned per-channel ``scale`` and
    ``1 / sqrt(hidden_size)``, a softmax over experts (float32), the top
    ``top_k_experts`` renormalised to sum to one and multiplied by ``per_expert_scale``.
    """

    def __init__(self, config: Gemma4ModelConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, hidden_size] -> ``(weights, experts)``, each
        ``[num_tokens, top_k_experts]`` (float32 weights, int64 expert ids)."""
        scores = self.proj(self.norm(hidden) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Experts(nn.Module):
    """``num_experts`` gated MLPs stored as stacked tensors (HF layout):
    ``gate_up_proj [E, 2 * moe_intermediate_size, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, config: Gemma4ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.act = activation(config.hidden_act)

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's chosen experts.

        Args:
            hidden: [num_tokens, hidden_size]
            weights, experts: [num_tokens, top_k] from :class:`Gemma4Router`.

        Returns:
            [num_tokens, hidden_size]
        """
        out = torch.zeros_like(hidden)
        # Loop over the experts actually chosen: each runs one matmul over its tokens.
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out
