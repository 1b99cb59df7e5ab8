"""Gemma4 text hyper-parameters (Hugging Face ``Gemma4TextConfig``, model type
``gemma4_text``; the text part of ``gemma4`` checkpoints): per-layer-type attention
geometry (``per_layer_config``) and KV sharing between layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from specula.runtime.models.config import HF_FIELDS, ModelConfig, checkpoint_dtype, eos_token_ids

GEMMA4_MODEL_TYPES = frozenset({"gemma4_text", "gemma4"})
"""``model_type`` values whose text model :class:`Gemma4ModelConfig` describes."""

SLIDING = "sliding_attention"
FULL = "full_attention"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
}
"""The MLP activations Gemma4 may use, as Hugging Face's ``ACT2FN[name]``."""

_INT_FIELDS = ("num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input")
_BOOL_FIELDS = ("attention_k_eq_v", "use_double_wide_mlp", "enable_moe_block")


@dataclass(frozen=True)
class Gemma4ModelConfig(ModelConfig):
    """:class:`ModelConfig` plus the Gemma4 fields; the inherited ``head_dim`` and
    ``num_key_value_heads`` are layer 0's, :attr:`layer_head_dims` and
    :attr:`layer_num_kv_heads` every layer's."""

    layer_types: tuple[str, ...] = ()
    """Per layer, ``sliding_attention`` or ``full_attention`` (each type has its own head
    size, KV heads and rotary settings)."""
    sliding_window: int = 0
    """Sliding layers see the last ``sliding_window`` positions, their own included."""
    layer_head_dims: tuple[int, ...] = ()
    layer_num_kv_heads: tuple[int, ...] = ()
    rope_parameters: dict[str, dict[str, Any]] | None = None
    """Per layer type: ``rope_type`` (``default`` or ``proportional``), ``rope_theta``,
    optional ``partial_rotary_factor`` and ``factor``."""
    num_kv_shared_layers: int = 0
    """The last that many layers compute no keys and values and own no KV-cache storage;
    each reads the KV of the last earlier non-shared layer of its type."""
    final_logit_softcapping: float | None = None
    """Logits become ``cap * tanh(logits / cap)``; ``None`` disables it."""
    hidden_size_per_layer_input: int = 0
    """Width of the per-layer input embeddings (PLE); 0 disables them."""
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    """Full-attention layers have no ``v_proj``: values come from the key projection."""
    use_double_wide_mlp: bool = False
    """KV-shared layers have an MLP twice ``intermediate_size`` wide."""
    enable_moe_block: bool = False
    """Each layer adds a routed mixture of experts beside its dense MLP."""

    @classmethod
    def from_hf_config(cls, hf: Any) -> Gemma4ModelConfig:
        """Read a ``Gemma4TextConfig`` (or the ``text_config`` of a ``Gemma4Config``).

        Raises:
            ValueError: an activation we do not implement, bidirectional attention, or
                a KV-shared layer type with no non-shared layer to read from.
        """
        architecture = (getattr(hf, "architectures", None) or ["Gemma4ForCausalLM"])[0]
        text = hf.get_text_config() if hf.model_type == "gemma4" else hf
        config = cls.from_text_config(text, architecture, outer=hf)
        config.kv_source_layers()  # validates the sharing pattern
        return config

    @classmethod
    def from_text_config(cls, text: Any, architecture: str, outer: Any) -> Gemma4ModelConfig:
        """:meth:`from_hf_config` without the KV-sharing check (a Gemma4 MTP draft's layers all
        read the target's KV); ``outer``'s ``eos_token_id``, dtype and embedding tying win.

        Raises:
            ValueError: an activation we do not implement, or bidirectional attention.
        """
        act = text.hidden_activation
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported ({sorted(ACTIVATIONS)})")
        if getattr(text, "use_bidirectional_attention", None) is not None:
            raise ValueError(f"use_bidirectional_attention {text.use_bidirectional_attention!r} "
                             "is not supported (causal decoding only)")
        per_layer = [text.per_layer_config[i] for i in range(text.num_hidden_layers)]
        rope = {t: dict(p) for t, p in (text.rope_parameters or {}).items() if p is not None}
        return cls(architecture=architecture, **{f: getattr(text, f) for f in HF_FIELDS},
                   num_key_value_heads=int(per_layer[0].num_key_value_heads),
                   head_dim=int(per_layer[0].head_dim), rope_scaling=None,
                   rope_theta=float(rope.get(SLIDING, {}).get("rope_theta", 10000.0)),
                   tie_word_embeddings=bool(getattr(outer, "tie_word_embeddings", True)),
                   attention_bias=bool(text.attention_bias), mlp_bias=False,
                   torch_dtype=checkpoint_dtype(outer) or checkpoint_dtype(text),
                   eos_token_ids=eos_token_ids(outer) or eos_token_ids(text), hidden_act=act,
                   layer_types=tuple(text.layer_types), sliding_window=int(text.sliding_window),
                   layer_head_dims=tuple(int(c.head_dim) for c in per_layer),
                   layer_num_kv_heads=tuple(int(c.num_key_value_heads) for c in per_layer),
                   rope_parameters=rope, final_logit_softcapping=text.final_logit_softcapping,
                   **{f: int(getattr(text, f) or 0) for f in _INT_FIELDS},
                   **{f: bool(getattr(text, f)) for f in _BOOL_FIELDS})

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_producer_layers(self) -> dict[str, int]:
        """Per layer type, the last non-shared layer of that type, whose KV the shared
        layers (and a Gemma4 MTP draft) of that type read."""
        return {t: i for i, t in enumerate(self.layer_types[: self.first_kv_shared_layer])}

    def kv_source_layers(self) -> tuple[int, ...]:
        """Per layer, the layer whose KV it attends to (itself when not shared); as the
        non-shared layers are a prefix owning cache entries ``0..``, also its cache index.

        Raises:
            ValueError: a shared layer's type has no non-shared layer before it.
        """
        first_shared = self.first_kv_shared_layer
        shared = self.layer_types[first_shared:]
        producers = self.kv_producer_layers()
        for i, layer_type in enumerate(shared, first_shared):
            if layer_type not in producers:
                raise ValueError(f"layer {i} ({layer_type}) is KV-shared (num_kv_shared_layers="
                                 f"{self.num_kv_shared_layers}) but no earlier non-shared layer "
                                 "has that type")
        return (*range(first_shared), *(producers[t] for t in shared))

    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """``(num_kv_heads, head_dim)`` per non-shared layer, in order (shared layers own none)."""
        return tuple((self.layer_num_kv_heads[i], self.layer_head_dims[i])
                     for i in range(self.first_kv_shared_layer))
