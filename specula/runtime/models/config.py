"""Architecture hyper-parameters read from a Hugging Face ``config.json``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_DEFAULT_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

HF_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "rms_norm_eps", "max_position_embeddings")
""":class:`ModelConfig` fields read unchanged from the Hugging Face (text) config."""


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-only hyper-parameters our model classes need, read through
    ``transformers.AutoConfig`` so that per-architecture defaults (Qwen3's ``head_dim``
    of 128) are those the checkpoint's authors relied on."""

    architecture: str
    """``architectures[0]`` of the checkpoint, e.g. ``LlamaForCausalLM``."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Per-head size: explicit in Qwen3 configs, else ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """``None`` for the default rotary embedding, else a dict with ``rope_type``."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: torch.dtype | None
    """Dtype the checkpoint was saved in, ``None`` when the config does not say."""
    eos_token_ids: tuple[int, ...]
    hidden_act: str
    tensor_parallel_size: int = field(default=1, kw_only=True)
    """Ranks the heads, MLP columns and vocabulary are split over (the runtime's
    setting, not the checkpoint's)."""

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` in ``checkpoint_dir`` (:func:`read_hf_config`).

        Raises:
            FileNotFoundError: no ``config.json``.
            ValueError: a setting our models do not implement (activation, sliding window).
        """
        return cls.from_hf_config(read_hf_config(checkpoint_dir))

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        from specula.runtime.models.gemma4_config import GEMMA4_MODEL_TYPES, Gemma4ModelConfig

        if hf.model_type in GEMMA4_MODEL_TYPES:
            return Gemma4ModelConfig.from_hf_config(hf)
        default = _DEFAULT_ARCHITECTURE.get(hf.model_type)
        architectures = getattr(hf, "architectures", None) or [default]
        if architectures[0] is None:
            raise ValueError("config.json lists no 'architectures'")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        # transformers >= 4.57 moved rope settings into ``rope_parameters``.
        rope_params = dict(getattr(hf, "rope_parameters", None) or {})
        rope_theta = getattr(hf, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
        rope_scaling = dict(getattr(hf, "rope_scaling", None) or rope_params)
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope_scaling["rope_type"] = rope_type
        if rope_type == "default":
            rope_scaling = None
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        hidden_act = getattr(hf, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        return cls(architecture=architectures[0], **{f: getattr(hf, f) for f in HF_FIELDS},
                   num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
                   head_dim=head_dim, rope_theta=float(rope_theta), rope_scaling=rope_scaling,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(hf, "attention_bias", False)),
                   mlp_bias=bool(getattr(hf, "mlp_bias", False)), torch_dtype=checkpoint_dtype(hf),
                   eos_token_ids=eos_token_ids(hf), hidden_act=hidden_act)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """``(num_kv_heads, head_dim)`` of each layer owning KV-cache storage, in order;
        this rank's ``num_key_value_heads / tensor_parallel_size`` heads."""
        heads = self.num_key_value_heads // self.tensor_parallel_size
        return ((heads, self.head_dim),) * self.num_hidden_layers


def read_hf_config(checkpoint_dir: str | Path) -> Any:
    """``transformers.AutoConfig`` of ``checkpoint_dir``.

    Raises:
        FileNotFoundError: no ``config.json``.
    """
    from transformers import AutoConfig

    if not (Path(checkpoint_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(checkpoint_dir)!r}")
    return AutoConfig.from_pretrained(str(checkpoint_dir))


def check_aux_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int,
                        field: str = "aux_hidden_state_layer_ids") -> tuple[int, ...]:
    """``layer_ids`` as a tuple of auxiliary hidden-state ids: id ``i`` is the residual
    stream entering decoder layer ``i`` (HF's ``output_hidden_states[i]``), ``0`` the
    embedding output, ``num_hidden_layers`` the last layer's output before the final norm,
    as EAGLE-3 (arXiv 2503.01840) and vLLM's ``aux_hidden_state_layers`` define them.

    Raises:
        ValueError: an id outside ``[0, num_hidden_layers]`` (the message: ``field``, both values).
    """
    for i in layer_ids:
        if not 0 <= i <= num_hidden_layers:
            raise ValueError(f"{field} contains {i}, outside [0, {num_hidden_layers}] "
                             f"for a target with num_hidden_layers={num_hidden_layers}")
    return tuple(layer_ids)


def checkpoint_dtype(hf: Any) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights were saved in, if any."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def eos_token_ids(hf: Any) -> tuple[int, ...]:
    """``eos_token_id`` of a Hugging Face config as a tuple (empty when unset)."""
    eos = getattr(hf, "eos_token_id", None)
    return () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The weight/activation dtype: ``"auto"`` takes the checkpoint's (float32 when
    absent), except that a float16 checkpoint runs in float32 on CPU, where half-precision
    matmuls are slow and partly unimplemented (bfloat16 is kept).

    Raises:
        ValueError: unknown dtype name.
    """
    if dtype == "auto":
        chosen = config.torch_dtype or torch.float32
        return torch.float32 if device.type == "cpu" and chosen == torch.float16 else chosen
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
