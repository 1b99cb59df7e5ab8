"""The ``draft_model`` method (vLLM's; Leviathan et al., arXiv 2211.17192)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specula.runtime.kernels.gemv import screen_weight
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.qwen3 import Qwen3ForCausalLM
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.worker import create_model_runner

SCREENED = (LlamaForCausalLM, Qwen3ForCausalLM)
"""Drafts whose runner reads ``lm_head_screen`` (not Gemma4's: softcapped logits)."""


class PlainDraftModelSpeculator(AutoRegressiveSpeculator):
    """A smaller causal LM of the target's vocabulary (any architecture the paged runners
    serve) drafting over the generic loop with its own paged KV cache; sharded over
    ``tensor_parallel_size`` ranks (vLLM's ``draft_tensor_parallel_size``) like the target,
    else whole on every rank."""

    def __init__(self, *, tensor_parallel_size: int = 1, **kwargs) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        super().__init__(**kwargs)

    def load_draft_model(self) -> nn.Module:
        config = ModelConfig.from_pretrained(self.draft_dir)
        if config.vocab_size != self.vocab_size:
            raise ValueError(f"draft model vocab_size {config.vocab_size} != target vocab_size "
                             f"{self.vocab_size}: draft and target must share the tokenizer's "
                             "vocabulary")
        config = replace(config, tensor_parallel_size=self.tensor_parallel_size)
        model = load_model(self.draft_dir, self.dtype, self.device, config, self.load_format)
        greedy = not self.keeps_draft_probs and self.dtype in (torch.bfloat16, torch.float16)
        if type(model) in SCREENED and self.tensor_parallel_size == 1 and greedy:  # ModelRunner's
            model.lm_head_screen = screen_weight(model.lm_head_weight)  # exact greedy drafts
        return model

    def build_runner(self, kv_cache, max_model_len: int):
        return create_model_runner(self.model, kv_cache, max_model_len)

    def draft_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.runner.logits_and_argmax(hidden, need_logits=False, into=out)[1]  # epilogue
