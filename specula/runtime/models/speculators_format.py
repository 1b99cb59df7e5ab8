"""Reading draft heads saved in the ``speculators`` format.

A ``speculators`` checkpoint is a directory with a ``config.json`` that names the
method in ``speculators_model_type`` (``"eagle3"``, ``"mtp"``, ...), describes the draft's
decoder layers in ``transformer_layer_config`` (a Hugging Face config dict with its own
``model_type``), keeps method settings at the top level and the proposal and verifier
settings in ``speculators_config``; the weights are ``*.safetensors`` named after the
draft's modules, plus the ``d2t`` / ``t2d`` vocabulary-mapping buffers for heads with a
reduced vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.layers import MergedLinear


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
        raise ValueError(
            f"speculators_model_type is {found!r}, expected {expected_type!r} "
            f"(checkpoint {str(checkpoint_dir)!r})"
        )
    if not isinstance(config.get("transformer_layer_config"), dict):
        raise ValueError(f"{expected_type} checkpoint has no transformer_layer_config")
    return config


def layer_model_config(config: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of ``transformer_layer_config`` (through
    ``transformers.AutoConfig.for_model``, so architecture defaults apply).

    Raises:
        ValueError: an unknown ``model_type`` or a setting our layers do not implement
            (sliding-window layers, an activation other than SiLU).
    """
    from transformers import AutoConfig

    layer = dict(config["transformer_layer_config"])
    model_type = layer.pop("model_type", None)
    if model_type not in ("llama", "qwen3"):
        raise ValueError(
            f"transformer_layer_config.model_type {model_type!r} is not supported (llama, qwen3)"
        )
    hf = AutoConfig.for_model(model_type, **layer)
    if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
        raise ValueError("transformer_layer_config.layer_types: sliding attention is not supported")
    return ModelConfig.from_hf_config(hf)


def iter_checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of ``checkpoint_dir/*.safetensors``, on the CPU.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(checkpoint_dir)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> list[str]:
    """Copy checkpoint tensor ``name`` into ``model``; a projection fused in the model
    (``model.packed_modules_mapping``, fused name -> checkpoint names in row order) goes
    to its shard. Returns the names of the model parameters written (partly, for a shard).

    Raises:
        ValueError: no matching parameter, or a shape mismatch (names both shapes).
    """
    module_path, _, param_name = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    for fused, subs in getattr(model, "packed_modules_mapping", {}).items():
        if leaf in subs:
            fused_path = f"{parent}.{fused}" if parent else fused
            try:
                module = model.get_submodule(fused_path)
            except AttributeError as exc:
                raise ValueError(f"checkpoint tensor {name!r} has no matching module") from exc
            assert isinstance(module, MergedLinear)
            module.load_shard(param_name, subs.index(leaf), tensor)
            return [f"{fused_path}.{param_name}"]
    params = dict(model.named_parameters())
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
    if param.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
    return [name]
