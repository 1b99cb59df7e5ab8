"""Maps ``speculator.method`` of the runtime config to a speculator class."""

from __future__ import annotations

from pathlib import Path

import torch

from specula.api.runtime_config import SpeculatorRuntimeConfig
from specula.runtime.loader import resolve_model_uri
from specula.runtime.models.config import ModelConfig
from specula.runtime.spec_decode.base import BaseSpeculator


class UnsupportedSpeculatorMethod(NotImplementedError):
    """The runtime config names a method this runtime does not implement yet."""


SUPPORTED_METHODS = ("draft_model", "ngram")


def create_speculator(
    config: SpeculatorRuntimeConfig,
    target_config: ModelConfig,
    max_num_seqs: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> BaseSpeculator:
    """Build the speculator ``config`` describes.

    Raises:
        UnsupportedSpeculatorMethod: the method is not implemented.
        ValueError: the method needs a draft model URI and has none, or the draft's
            vocabulary differs from the target's.
        FileNotFoundError: the draft checkpoint cannot be found.
    """
    if config.method not in SUPPORTED_METHODS:
        raise UnsupportedSpeculatorMethod(
            f"speculator method {config.method!r} is not implemented; "
            f"supported: {', '.join(SUPPORTED_METHODS)}"
        )
    if config.method == "ngram":
        from specula.runtime.spec_decode.ngram import NgramSpeculator

        lookup_min, lookup_max = config.prompt_lookup_range
        return NgramSpeculator(
            num_speculative_tokens=config.max_k,
            vocab_size=target_config.vocab_size,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
            device=device,
        )
    if config.model is None:
        raise ValueError(f"speculator method {config.method!r} needs a draft model URI")
    from specula.runtime.spec_decode.draft_model import PlainDraftModelSpeculator

    draft_dir: Path = resolve_model_uri(config.model)
    return PlainDraftModelSpeculator(
        draft_dir=draft_dir,
        target_config=target_config,
        num_speculative_tokens=config.max_k,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
    )
