"""Architecture registry and safetensors weight loading."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path

import torch
from torch import nn

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.gemma4 import Gemma4ForCausalLM
from specula.runtime.models.layers import MergedLinear, build_empty, init_dummy_weights
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.qwen3 import Qwen3ForCausalLM
from specula.runtime.worker.parallel import check_divisible, shard_tensor

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM, "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,
}
"""``architectures[0]`` of ``config.json`` -> model class."""


def check_servable(config: ModelConfig) -> None:
    """Refuse, before any weight is read, a model the paged runners do not serve.

    Raises:
        ValueError: the mixture-of-experts Gemma4 (``enable_moe_block``); at
            ``tensor_parallel_size`` above 1, a Gemma4 target or heads and MLP columns
            that do not split evenly (the message names the field and both values).
    """
    if getattr(config, "enable_moe_block", False):
        raise ValueError("enable_moe_block is true: the mixture-of-experts Gemma4 is not served "
                         "(its expert dispatch reads expert ids on the host); serve a dense Gemma4")
    tp = config.tensor_parallel_size
    if tp > 1:
        if config.architecture not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            raise ValueError(f"tensor_parallel_size {tp}: architecture {config.architecture!r} "
                             "runs on one GPU (tensor_parallel_size 1); Llama and Qwen3 targets "
                             "can be sharded")
        check_divisible(config, tp)


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device,
               config: ModelConfig | None = None, load_format: str = "auto") -> LlamaForCausalLM:
    """Build the model named by the checkpoint's config and load it (:func:`load_checkpoint`).

    Raises:
        ValueError: unsupported architecture (or one :func:`check_servable` refuses), or
            a checkpoint tensor with the wrong shape or a parameter the checkpoint lacks.
        FileNotFoundError: no ``config.json`` or no ``*.safetensors`` file.
    """
    path = Path(checkpoint_dir)
    config = config or ModelConfig.from_pretrained(path)
    check_servable(config)
    model_cls = MODEL_REGISTRY.get(config.architecture)
    if model_cls is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    factory = partial(model_cls, config, device=device)
    return load_checkpoint(factory, path, dtype, device, load_format)[0]


def load_checkpoint(factory: Callable[[], nn.Module], checkpoint_dir: Path, dtype: torch.dtype,
                    device: torch.device, load_format: str = "auto",
                    rename: Callable[[str], str | None] | None = None,
                    optional: Collection[str] = ()) -> tuple[nn.Module, set[str]]:
    """``(model, the names of optional it was not given)``: ``factory()`` built by
    :func:`~specula.runtime.models.layers.build_empty`, in eval mode, loaded by
    :func:`load_safetensors` (whose errors it raises) or, for ``load_format: dummy``,
    :func:`~specula.runtime.models.layers.init_dummy_weights` (``optional`` left alone)."""
    model = build_empty(factory, dtype, device).eval()
    if load_format == "dummy":
        init_dummy_weights(model, skip=tuple(optional))
        return model, set(optional)
    return model, load_safetensors(model, checkpoint_dir, rename, optional)


def load_safetensors(model: nn.Module, checkpoint_dir: Path,
                     rename: Callable[[str], str | None] | None = None,
                     optional: Collection[str] = ()) -> set[str]:
    """Copy every tensor of ``checkpoint_dir/*.safetensors`` into ``model`` by HF name,
    projections fused in the model (``packed_modules_mapping``) into their shard of the
    fused parameter. ``rename`` (default: the model's ``checkpoint_name``, if any) maps
    each stored name first (``None``: a tensor the model does not use).

    Returns:
        the names of ``optional`` the checkpoint lacks (weights shared from the target).

    Raises:
        FileNotFoundError: no ``*.safetensors`` file.
        ValueError: an unknown tensor, a shape mismatch, or unloaded parameters not in ``optional``.
    """
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(checkpoint_dir)!r}")
    params, modules = model.state_dict(), dict(model.named_modules())
    unloaded = set(params)
    loaded_shards: dict[str, set[int]] = defaultdict(set)
    shard_map = {sub: (fused, i) for fused, subs in model.packed_modules_mapping.items()
                 for i, sub in enumerate(subs)}
    rename = rename or getattr(model, "checkpoint_name", None) or (lambda name: name)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = rename(stored)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue  # unused, or derived from the config (not a weight)
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied to embed_tokens, or the target's head
                tensor = f.get_tensor(stored)
                module_path, _, param_name = name.rpartition(".")
                parent, _, leaf = module_path.rpartition(".")
                if leaf in shard_map:
                    fused, shard_id = shard_map[leaf]
                    fused_path = f"{parent}.{fused}" if parent else fused
                    module = modules.get(fused_path)
                    if not isinstance(module, MergedLinear):
                        raise ValueError(f"checkpoint tensor {name!r} has no matching module")
                    if hasattr(module, "tp_style"):
                        rows = module.output_sizes[shard_id]
                        tensor = shard_tensor(tensor, module.tp_style, (rows, *tensor.shape[1:]))
                    module.load_shard(param_name, shard_id, tensor)
                    fused_name = f"{fused_path}.{param_name}"
                    loaded_shards[fused_name].add(shard_id)
                    if len(loaded_shards[fused_name]) == len(module.output_sizes):
                        unloaded.discard(fused_name)
                    continue
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                style = getattr(modules.get(module_path), "tp_style", None)
                if style is not None:
                    tensor = shard_tensor(tensor, style, param.shape)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                     f"!= model shape {tuple(param.shape)}")
                param.copy_(tensor)
                unloaded.discard(name)
    missing = unloaded & set(optional)
    if unloaded - missing:
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r} lacks {sorted(unloaded - missing)}")
    return missing
