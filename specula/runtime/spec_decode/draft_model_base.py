"""State shared by every speculator that runs a draft network of its own."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

import torch

from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.spec_decode.base import BaseSpeculator


class DraftModelSpeculator(BaseSpeculator):
    """Owns the draft network, its KV cache (one slot per request, like the target's) and
    buffers sized by the maximum number of requests.

    Subclasses decide what the draft network is through :meth:`load_draft_model` and how
    drafting proceeds through :meth:`propose`.

    Raises (at construction):
        ValueError: the draft's vocabulary size differs from the target's.
    """

    def __init__(
        self,
        draft_dir: Path,
        target_config: ModelConfig,
        num_speculative_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.draft_dir = draft_dir
        self.target_config = target_config
        self.max_num_speculative_tokens = num_speculative_tokens
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        self.device = device
        self.vocab_size = target_config.vocab_size
        model = self.load_draft_model()
        if model.config.vocab_size != self.vocab_size:
            raise ValueError(
                f"draft model vocab_size {model.config.vocab_size} != target vocab_size "
                f"{self.vocab_size}: draft and target must share the tokenizer's vocabulary"
            )
        # Drafting writes up to k positions past the last verified token.
        self.runner = ModelRunner(
            model, max_num_seqs, max_model_len + num_speculative_tokens, device
        )
        self.num_cached_tokens = [0] * max_num_seqs
        """Per slot: leading tokens whose draft KV is in the cache and still valid."""
        self.draft_token_ids = torch.zeros(
            max_num_seqs, num_speculative_tokens, dtype=torch.long, device=device
        )
        """[max_num_seqs, k_max] staging buffer for proposals."""

    @abstractmethod
    def load_draft_model(self) -> LlamaForCausalLM:
        """Build and load the draft network (extension point for each method)."""

    def init_cudagraph_manager(self) -> None:
        """No-op: drafts run eagerly on CPU; CUDA graphs come with the GPU runner."""

    def capture(self) -> None:
        """No-op: drafts run eagerly on CPU; CUDA graphs come with the GPU runner."""

    def add_requests(self, slot_ids: list[int]) -> None:
        for slot in slot_ids:
            self.num_cached_tokens[slot] = 0

    def rollback(self, slot_ids: list[int], num_valid_tokens: list[int]) -> None:
        for slot, n in zip(slot_ids, num_valid_tokens, strict=True):
            self.num_cached_tokens[slot] = min(self.num_cached_tokens[slot], n)
