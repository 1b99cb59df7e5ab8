"""The ``dflash`` method: parallel block drafting conditioned on the target's hidden
states (Chen, Liang, Liu, arXiv 2602.06036; vLLM's ``dflash`` method)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specula.runtime.engine.kv_cache import KVCache
from specula.runtime.engine.sampler import sample
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.dflash import build_block_attention_metadata, load_dflash_draft
from specula.runtime.spec_decode.base import (
    BaseSpeculator,
    DraftProposal,
    SpeculatorInput,
    TargetHiddenStates,
)
from specula.runtime.spec_decode.dflash.config import DFlashConfig

if TYPE_CHECKING:
    from specula.runtime.engine.model_runner import ModelRunner


class DFlashSpeculator(BaseSpeculator):
    """Drafts ``k`` tokens per request with ONE forward of the DFlash draft.

    State per slot: the draft's context keys and values (its KV cache), written by
    :meth:`observe_target` from the target's auxiliary hidden states of every committed
    position, and how many leading positions they cover. At :meth:`propose`, request
    ``i`` with ``L`` verified tokens has context for positions ``0 .. L - 2`` (the target
    has not seen the last token yet); its block is that last token (the anchor, position
    ``L - 1``) plus ``block_size - 1`` mask tokens, and block slot ``j`` predicts the token
    at position ``L - 1 + j`` (``j + 1`` with ``sample_from_anchor``).

    The whole block is always run, whatever ``k``: attention is non-causal within the
    block, so a shorter block would change every slot's prediction from what the draft
    was trained on, and a draft token's distribution would depend on the ``k`` of the
    step. (vLLM instead feeds ``1 + num_speculative_tokens`` query tokens.) ``k`` is
    therefore bounded by the block: ``max_num_speculative_tokens`` above
    ``block_size - 1`` is refused at load, not clamped.

    Draft probabilities cover the target vocabulary (0 outside a reduced draft
    vocabulary), so rejection sampling stays exact.

    Raises (at construction):
        ValueError: not a ``speculators`` ``dflash`` checkpoint, or one that does not fit
            the target (:meth:`DFlashConfig.check_target`), or bad weights.
        FileNotFoundError: no ``config.json`` or ``*.safetensors`` in ``draft_dir``.
    """

    uses_target_hidden_states = True

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
        self.config = DFlashConfig.from_pretrained(draft_dir)
        self.config.check_target(target_config, num_speculative_tokens)
        self.max_num_speculative_tokens = num_speculative_tokens
        self.aux_hidden_state_layers = self.config.aux_hidden_state_layer_ids
        self.block_size = self.config.block_size
        self.device = device
        self.model = load_dflash_draft(
            draft_dir,
            self.config.layer_config,
            num_aux_layers=len(self.aux_hidden_state_layers),
            draft_vocab_size=self.config.draft_vocab_size if self.config.uses_draft_vocab else None,
            target_vocab_size=target_config.vocab_size,
            dtype=dtype,
            device=device,
        )
        # A block occupies the block_size positions after the last committed one.
        self.kv_cache = KVCache(
            self.config.layer_config, max_num_seqs, max_model_len + self.block_size, dtype, device
        )
        self.num_context_tokens = [0] * max_num_seqs
        """Per slot: leading positions whose context keys and values are in the cache."""
        self.embed_weight: torch.Tensor | None = None
        """[vocab_size, hidden_size] the target's token embedding (set by bind_target)."""
        self.lm_head_weight: torch.Tensor | None = None
        """[vocab_size, hidden_size] the target's LM head (set by bind_target)."""

    def init_cudagraph_manager(self) -> None:
        """No-op: the draft runs eagerly; CUDA graphs come with the GPU runner."""

    def capture(self) -> None:
        """No-op: the draft runs eagerly; CUDA graphs come with the GPU runner."""

    def bind_target(self, target_runner: ModelRunner) -> None:
        """Share the target's token embedding and LM head (``speculators`` DFlash
        checkpoints never store the embedding, nor the head of a full-vocabulary draft).
        Both are used as plain matrices: the draft was trained on the verifier's raw
        ``embed_tokens`` and ``lm_head``."""
        target = target_runner.model
        self.embed_weight = target.model.embed_tokens.weight
        self.lm_head_weight = target.lm_head_weight

    def add_requests(self, slot_ids: list[int]) -> None:
        for slot in slot_ids:
            self.num_context_tokens[slot] = 0

    def rollback(self, slot_ids: list[int], num_valid_tokens: list[int]) -> None:
        # The engine hands over committed rows only, so context never covers a rejected
        # token; the clamp keeps that true for any caller.
        for slot, n in zip(slot_ids, num_valid_tokens, strict=True):
            self.num_context_tokens[slot] = min(self.num_context_tokens[slot], n)

    def observe_target(self, states: TargetHiddenStates) -> None:
        """Turn the target's auxiliary hidden states of newly committed positions into
        context keys and values (``fc``, ``hidden_norm``, then each layer's K/V
        projections) and store them in the slots' cache.

        Raises:
            RuntimeError: no auxiliary states, or rows that would leave a gap after a
                slot's existing context.
        """
        if states.aux_hidden_states is None:
            raise RuntimeError("dflash needs the target's auxiliary hidden states")
        for slot, start in zip(states.slot_ids, states.start_positions, strict=True):
            if start > self.num_context_tokens[slot]:
                raise RuntimeError(
                    f"slot {slot}: target states start at position {start}, but its "
                    f"context ends at {self.num_context_tokens[slot]}"
                )
        ends = [s + n for s, n in zip(states.start_positions, states.num_rows, strict=True)]
        self.kv_cache.ensure_capacity(max(ends))
        num_rows = torch.tensor(states.num_rows)
        slot_ids = torch.tensor(states.slot_ids).repeat_interleave(num_rows)
        positions = torch.cat(
            [torch.arange(s, e) for s, e in zip(states.start_positions, ends, strict=True)]
        )
        features = self.model.context_features(states.aux_hidden_states.to(self.model.fc.weight))
        self.model.store_context_kv(
            features, slot_ids.to(self.device), positions.to(self.device), self.kv_cache.layers
        )
        for slot, end in zip(states.slot_ids, ends, strict=True):
            self.num_context_tokens[slot] = end

    def block_hidden_states(
        self, slot_ids: list[int], token_ids: list[list[int]]
    ) -> torch.Tensor:
        """Run one block per request: anchor ``token_ids[i][-1]`` then mask tokens, over
        the slot's context.

        Returns:
            [num_reqs, block_size, hidden_size] the draft's final hidden states.

        Raises:
            RuntimeError: a slot's context does not cover exactly the positions before
                its anchor, or :meth:`bind_target` was not called.
        """
        if self.embed_weight is None:
            raise RuntimeError("bind_target must be called before drafting")
        num_reqs, block = len(slot_ids), self.block_size
        context_lens = [len(toks) - 1 for toks in token_ids]
        for slot, n in zip(slot_ids, context_lens, strict=True):
            if self.num_context_tokens[slot] != n:
                raise RuntimeError(
                    f"slot {slot}: dflash context covers {self.num_context_tokens[slot]} "
                    f"positions; the block needs the {n} before its anchor"
                )
        block_ids = torch.full((num_reqs, block), self.config.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = torch.tensor([toks[-1] for toks in token_ids], dtype=torch.long)
        self.kv_cache.ensure_capacity(max(context_lens) + block)
        metadata = build_block_attention_metadata(slot_ids, context_lens, block, self.device)
        embeds = F.embedding(block_ids.flatten().to(self.device), self.embed_weight)
        hidden = self.model(embeds, metadata.cache_positions, self.kv_cache.layers, metadata)
        return hidden.view(num_reqs, block, -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden_size]`` -> ``[..., vocab_size]`` float32 draft logits over the
        target vocabulary (``-inf`` outside a reduced draft vocabulary)."""
        assert self.lm_head_weight is not None
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self.model.compute_logits(flat, self.lm_head_weight).view(*hidden.shape[:-1], -1)

    def propose(self, inputs: SpeculatorInput, num_speculative_tokens: int) -> DraftProposal:
        """Draft ``num_speculative_tokens`` tokens per request from one block forward.

        Returns draft_token_ids ``[num_reqs, k]`` and, unless every request is greedy,
        draft_probs ``[num_reqs, k, vocab_size]``: each position's distribution under the
        request's temperature/top-k/top-p, sampled independently (the block predicts all
        positions at once).

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, max_num_speculative_tokens]``.
            RuntimeError: see :meth:`block_hidden_states`.
        """
        self.check_num_speculative_tokens(num_speculative_tokens)
        k = num_speculative_tokens
        first = self.config.first_draft_slot
        hidden = self.block_hidden_states(inputs.slot_ids, inputs.token_ids)
        logits = self.compute_logits(hidden[:, first : first + k])  # [num_reqs, k, vocab_size]
        if inputs.sampling.all_greedy:
            return DraftProposal(draft_token_ids=logits.argmax(dim=-1), draft_probs=None)
        token_ids, probs = [], []
        for step in range(k):
            ids, step_probs = sample(logits[:, step], inputs.sampling)
            assert step_probs is not None
            token_ids.append(ids)
            probs.append(step_probs)
        return DraftProposal(
            draft_token_ids=torch.stack(token_ids, dim=1), draft_probs=torch.stack(probs, dim=1)
        )
