"""The ``draft_model`` method (vLLM's): an independent, smaller causal LM of the same
vocabulary drafts autoregressively (Leviathan et al., arXiv 2211.17192)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specula.runtime.models.config import ModelConfig
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.worker import create_model_runner


class PlainDraftModelSpeculator(AutoRegressiveSpeculator):
    """A Hugging Face-layout causal LM (any architecture the paged runners serve) as the
    draft (Leviathan et al., arXiv 2211.17192), with its own paged KV cache on the
    target's block tables; everything else is the generic loop. With
    ``tensor_parallel_size`` N (the target's; vLLM's ``draft_tensor_parallel_size``) it is
    sharded over the ranks as the target is, else it runs whole on every rank."""

    def __init__(self, *, tensor_parallel_size: int = 1, **kwargs) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        super().__init__(**kwargs)

    def load_draft_model(self) -> nn.Module:
        config = ModelConfig.from_pretrained(self.draft_dir)
        config = replace(config, tensor_parallel_size=self.tensor_parallel_size)
        return load_model(self.draft_dir, self.dtype, self.device, config, self.load_format)

    def build_runner(self, kv_cache, max_model_len: int):
        return create_model_runner(self.model, kv_cache, max_model_len)

    def draft_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.logits_and_argmax(hidden)[1]  # the LM head's argmax epilogue
