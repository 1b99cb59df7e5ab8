"""The speculator interface the engine calls, never naming a method.

Shaped after vLLM Model Runner V2's ``Speculator`` (``vllm/v1/worker/gpu/spec_decode/
speculator.py``; PRs #40410, #43241): a small abstract base, one subclass family per
method, device tensors in and out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specula.runtime.engine.sampler import SamplingMetadata
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedAttentionMetadata

if TYPE_CHECKING:
    from specula.runtime.engine.input_batch import InputBatch
    from specula.runtime.worker.cudagraph import BatchExecutionDescriptor, CapturedAttentionState


@dataclass
class ProposeInputs:
    """One step's target forward and verification outcome. Requests are in batch order:
    ``num_decode`` running requests (each verified the same number of drafts, or decoded
    one token), then the requests prefilled this step."""

    num_reqs: int
    num_decode: int
    idx_mapping: torch.Tensor
    """[num_reqs] int64 row of each request in the engine's :class:`InputBatch`."""
    input_batch: InputBatch
    input_ids: torch.Tensor
    """[num_tokens] int64 the target forward's inputs: per running request its last token
    and its drafts, per prefill its tokens."""
    positions: torch.Tensor
    """[num_tokens] int64."""
    metadata: PagedAttentionMetadata
    descriptor: BatchExecutionDescriptor | None
    """The target graph that ran (its captured attention state holds the batch, padded),
    or ``None`` for an eager forward."""
    hidden_states: torch.Tensor
    """[num_tokens, H] the target's final (normed) hidden states."""
    aux_hidden_states: torch.Tensor | None
    """[num_tokens, len(aux_hidden_state_layers) * H], or ``None``."""
    cu_num_draft_tokens: torch.Tensor
    """[num_reqs] int32 inclusive cumulative drafts each request verified (0 for a prefill)."""
    num_accepted: torch.Tensor
    """[num_reqs] int64 accepted drafts (0 for a prefill)."""
    next_token_ids: torch.Tensor
    """[num_reqs] int64 the token each request sampled last (recovered, bonus, or a
    prefill's first token); it is not in any KV cache yet."""
    next_positions: torch.Tensor
    """[num_reqs] int64 the position of ``next_token_ids`` (the committed length)."""
    sampling: SamplingMetadata
    num_speculative_tokens: int
    """k of the next verification; 0: keep the draft's state complete, propose nothing."""

    @property
    def draw_keys(self) -> torch.Tensor:
        """[num_reqs] int64 keys of this proposal's random draws, ``next_positions + 1``
        (computed when a sampling speculator asks: greedy drafts launch nothing for it)."""
        return self.next_positions + 1


@dataclass
class DraftOutput:
    draft_token_ids: torch.Tensor
    """[num_reqs, k] int64 target vocabulary ids."""
    draft_probs: torch.Tensor | None = None
    """[num_reqs, k, vocab_size] float32, the distributions the drafts were sampled from; ``None``
    for deterministic drafts (greedy, n-gram), which the rejection sampler treats as one-hot."""
    num_draft_tokens: torch.Tensor | None = None
    """[num_reqs] int64 real drafts per request (``0 .. k``; the rest is padding the
    verifier accepts no further than); ``None``: all ``k``."""


class BaseSpeculator(ABC):
    """Proposes draft tokens for the target to verify. The engine calls, in order:
    :meth:`bind_target`, :meth:`kv_cache_spec` and :meth:`allocate_kv_cache`,
    :meth:`init_cudagraph_manager`, :meth:`capture` (CUDA only), then :meth:`propose` every step."""

    max_num_speculative_tokens: int
    """The largest k :meth:`propose` is asked for."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    """Target layers whose input residual streams the method reads (EAGLE-3, DFlash),
    as :func:`~specula.runtime.models.config.check_aux_layer_ids` defines the ids."""

    needs_token_ids: bool = False
    """The method reads every request's tokens (n-gram lookup): the engine keeps them
    in :attr:`InputBatch.token_ids`."""

    keeps_draft_probs: bool = False
    """Drafts are sampled (``draft_sample_method: probabilistic``): the engine keeps
    their distributions for the verifier."""

    def bind_target(self, target_runner) -> None:
        """Called once after the target is loaded: methods that share its weights or
        read its KV cache keep what they need (default: nothing).

        Raises:
            ValueError: the draft does not fit this target (names the field and values).
        """
        return None

    def num_lookahead_tokens(self, num_speculative_tokens: int) -> int:
        """KV slots :meth:`propose` writes after a request's last sampled position when
        drafting ``num_speculative_tokens`` (the engine reserves them)."""
        return 0

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec | None:
        """The draft's own paged KV cache (indexed by the target's block tables), or
        ``None`` (the default)."""
        return None

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Allocate the :meth:`kv_cache_spec` cache with ``num_blocks`` blocks of
        ``block_size`` tokens; positions up to ``max_model_len``."""
        return None

    def init_cudagraph_manager(self) -> None:
        """Allocate the static buffers draft graphs read and write (default: none)."""
        return None

    def capture(
        self, captured_attention_states: dict[BatchExecutionDescriptor, CapturedAttentionState]
    ) -> None:
        """Capture the draft's CUDA graphs after the target's: graphs over the target's
        token slots read the target's captured attention states and output buffers
        (vLLM PR #40410). The default captures nothing (a method run eagerly)."""
        return None

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> DraftOutput | None:
        """Draft ``inputs.num_speculative_tokens`` tokens per request (``None`` when 0),
        keeping any state the method carries across steps complete.

        Raises:
            ValueError: ``num_speculative_tokens`` above ``max_num_speculative_tokens``.
        """

    def check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Raises ValueError: ``num_speculative_tokens`` outside ``[0, max]``."""
        k, k_max = num_speculative_tokens, self.max_num_speculative_tokens
        if not 0 <= k <= k_max:
            raise ValueError(f"num_speculative_tokens {k} outside [0, {k_max}]")
