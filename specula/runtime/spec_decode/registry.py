"""Maps ``speculator.method`` of the runtime config to a speculator factory
(:data:`SPECULATOR_FACTORIES`, importing each class only when it is built)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.api.runtime_config import SpeculatorRuntimeConfig
from specula.runtime.loader import resolve_model_uri
from specula.runtime.models.config import ModelConfig
from specula.runtime.spec_decode.base import BaseSpeculator


class UnsupportedSpeculatorMethod(NotImplementedError):
    """The runtime config names a method this runtime does not implement yet."""


@dataclass(frozen=True)
class SpeculatorContext:
    """What every factory gets besides the method's own config."""

    config: SpeculatorRuntimeConfig
    target_config: ModelConfig
    target_dir: Path
    """The resolved target checkpoint (for factories registered from outside)."""
    max_num_seqs: int
    dtype: torch.dtype
    device: torch.device
    load_format: str = "auto"

    def draft_dir(self) -> Path:
        """The resolved draft checkpoint.

        Raises:
            ValueError: the config names no draft model.
            FileNotFoundError: the checkpoint cannot be found.
        """
        if self.config.model is None:
            raise ValueError(f"speculator method {self.config.method!r} needs a draft model URI")
        return resolve_model_uri(self.config.model)


def draft_kwargs(ctx: SpeculatorContext) -> dict:
    """Constructor arguments of a :class:`DraftModelSpeculator` subclass."""
    return {"draft_dir": ctx.draft_dir(), "target_config": ctx.target_config,
            "num_speculative_tokens": ctx.config.max_k, "max_num_seqs": ctx.max_num_seqs,
            "dtype": ctx.dtype, "device": ctx.device,
            "draft_sample_method": ctx.config.draft_sample_method, "load_format": ctx.load_format}


def _draft_model_kwargs(ctx: SpeculatorContext) -> dict:
    return draft_kwargs(ctx) | {"tensor_parallel_size": ctx.config.draft_tensor_parallel_size}


def _ngram_kwargs(ctx: SpeculatorContext) -> dict:
    lookup_min, lookup_max = ctx.config.prompt_lookup_range
    return {"num_speculative_tokens": ctx.config.max_k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def _lazy(module: str, name: str, kwargs=draft_kwargs) -> Callable[[SpeculatorContext], BaseSpeculator]:
    """The factory of class ``name`` of ``specula.runtime.spec_decode.<module>``, imported
    when the factory is called, with the constructor arguments ``kwargs(ctx)``."""

    def factory(ctx: SpeculatorContext) -> BaseSpeculator:
        args = kwargs(ctx)
        return getattr(importlib.import_module(f"specula.runtime.spec_decode.{module}"), name)(**args)
    return factory


SPECULATOR_FACTORIES: dict[str, Callable[[SpeculatorContext], BaseSpeculator]] = {
    "dflash": _lazy("dflash", "DFlashSpeculator"),
    "draft_model": _lazy("draft_model", "PlainDraftModelSpeculator", _draft_model_kwargs),
    "eagle3": _lazy("eagle", "EagleSpeculator"),
    "gemma4_mtp": _lazy("gemma4", "Gemma4MTPSpeculator"), "mtp": _lazy("mtp", "MTPSpeculator"),
    "ngram": _lazy("ngram", "NgramSpeculator", _ngram_kwargs),
}
"""Method name (vLLM ``speculative_config.method``) -> factory."""


def supported_methods() -> tuple[str, ...]:
    """The methods this runtime implements."""
    return tuple(SPECULATOR_FACTORIES)


def create_speculator(config: SpeculatorRuntimeConfig, target_config: ModelConfig, *,
                      target_dir: Path, max_num_seqs: int, dtype: torch.dtype,
                      device: torch.device, load_format: str = "auto") -> BaseSpeculator:
    """Build the speculator ``config`` describes.

    Raises:
        UnsupportedSpeculatorMethod: the method is not implemented.
        ValueError: the method needs a draft model URI and has none, the draft does
            not fit the target (the message names the field and both values), or a
            ``draft_tensor_parallel_size`` above 1 for a method other than
            ``draft_model`` (draft heads run unsharded on every rank).
        FileNotFoundError: the draft checkpoint cannot be found.
    """
    factory = SPECULATOR_FACTORIES.get(config.method)
    if factory is None:
        raise UnsupportedSpeculatorMethod(f"speculator method {config.method!r} is not "
                                          "implemented; supported: "
                                          f"{', '.join(supported_methods())}")
    if config.draft_tensor_parallel_size != 1 and config.method != "draft_model":
        raise ValueError(f"draft_tensor_parallel_size {config.draft_tensor_parallel_size}: a "
                         f"{config.method} draft runs unsharded on every rank "
                         "(draft_tensor_parallel_size 1); only draft_model drafts can be sharded")
    return factory(SpeculatorContext(
        config, target_config, Path(target_dir), max_num_seqs, dtype, device, load_format))
