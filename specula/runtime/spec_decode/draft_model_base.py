"""State shared by every speculator that runs a draft network of its own."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specula.runtime.engine.kv_cache import KVCache
from specula.runtime.models.attention import build_attention_metadata
from specula.runtime.models.config import ModelConfig
from specula.runtime.spec_decode.base import BaseSpeculator


class DraftModelSpeculator(BaseSpeculator):
    """Owns the draft network, its KV cache (one slot per request, like the target's) and
    buffers sized by the maximum number of requests.

    Subclasses decide what the draft network is through :meth:`load_draft_model` and how
    drafting proceeds through :meth:`propose`. The network is any module with

    - ``config``: a :class:`ModelConfig` describing its attention layers (the KV cache
      is shaped from ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``) and
      ``vocab_size``, the size of the (target) vocabulary its logits cover;
    - ``forward(input_ids [n], positions [n], kv_caches, metadata[, hidden_states [n, H]])``
      (see :meth:`run_draft_model`);
    - ``compute_logits(hidden [m, H]) -> [m, vocab_size]`` float32 over the target's
      vocabulary.

    Raises (at construction):
        ValueError: the draft does not fit the target (see :meth:`check_draft_model`).
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
        self.model = self.load_draft_model()
        self.check_draft_model(self.model)
        # Drafting writes up to k positions past the last verified token.
        self.kv_cache = self.create_kv_cache(max_model_len + num_speculative_tokens)
        self.num_cached_tokens = [0] * max_num_seqs
        """Per slot: leading positions whose draft KV is in the cache and still valid."""
        self.draft_token_ids = torch.zeros(
            max_num_seqs, num_speculative_tokens, dtype=torch.long, device=device
        )
        """[max_num_seqs, k_max] staging buffer for proposals."""

    @abstractmethod
    def load_draft_model(self) -> nn.Module:
        """Build and load the draft network (extension point for each method).

        Raises:
            ValueError: the checkpoint is malformed or does not fit the target; the
                message names the field and both values.
        """

    def check_draft_model(self, model: Any) -> None:
        """Validate the loaded draft against the target; the default checks that its
        logits cover the target's vocabulary.

        Raises:
            ValueError: ``model.config.vocab_size`` differs from the target's.
        """
        if model.config.vocab_size != self.vocab_size:
            raise ValueError(
                f"draft model vocab_size {model.config.vocab_size} != target vocab_size "
                f"{self.vocab_size}: draft and target must share the tokenizer's vocabulary"
            )

    def create_kv_cache(self, max_len: int) -> KVCache | None:
        """The draft's own slot KV cache of ``max_len`` positions per slot, shaped by
        ``self.model.config``. Drafts that keep no KV of their own (reading the
        target's instead) return ``None`` and override :meth:`run_draft_model`."""
        return KVCache(self.model.config, self.max_num_seqs, max_len, self.dtype, self.device)

    def run_draft_model(
        self,
        slot_ids: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        start_positions: list[int],
        positions: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``query_lens[i]`` rows to draft slot ``slot_ids[i]`` from cache position
        ``start_positions[i]`` on and return the network's raw output.

        Args:
            input_ids: [num_tokens] int64, requests' rows concatenated in order.
            positions: [num_tokens] rotary positions; default: the cache positions.
            hidden_states: [num_tokens, H] conditioning rows, passed to the network as a
                fifth argument; ``None`` calls it with four (plain causal LMs).

        Returns:
            whatever ``self.model.forward`` returns: ``[num_tokens, H]``, or a tuple.
        """
        assert input_ids.ndim == 1 and input_ids.shape[0] == sum(query_lens)
        assert self.kv_cache is not None, "drafts without a KV cache override run_draft_model"
        self.kv_cache.ensure_capacity(
            max(s + q for s, q in zip(start_positions, query_lens, strict=True))
        )
        metadata = build_attention_metadata(slot_ids, query_lens, start_positions, self.device)
        if positions is None:
            positions = metadata.cache_positions
        args = (input_ids.to(self.device), positions, self.kv_cache.layers, metadata)
        if hidden_states is None:
            return self.model(*args)
        assert hidden_states.shape[0] == input_ids.shape[0]
        return self.model(*args, hidden_states)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_positions, H] -> [num_positions, target vocab_size]`` float32 draft
        logits; ids a draft cannot propose have ``-inf``."""
        return self.model.compute_logits(hidden)

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
