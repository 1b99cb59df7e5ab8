"""The speculator interface: what the engine asks of every drafting method.

Shaped after vLLM Model Runner V2's ``Speculator`` (PRs #40410, #43241): a small abstract
base, one subclass family per method, no shared mutable config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specula.runtime.engine.sampler import SamplingMetadata

if TYPE_CHECKING:
    from specula.runtime.engine.model_runner import ModelRunner


@dataclass
class SpeculatorInput:
    """The requests to draft for in one speculative step."""

    slot_ids: list[int]
    """KV-cache slot of each request (stable from admission to completion)."""
    token_ids: list[list[int]]
    """Per request, every verified token (prompt + output). The last one was just emitted
    by the target and has not been fed to any model yet."""
    sampling: SamplingMetadata
    """Per-request temperature/top-k/top-p and generators; the draft samples under the
    same processing the verifier applies to the target."""


@dataclass
class DraftProposal:
    draft_token_ids: torch.Tensor
    """[num_reqs, k] int64."""
    draft_probs: torch.Tensor | None
    """[num_reqs, k, vocab_size] float32, the distributions the draft tokens were sampled
    from; ``None`` when every request is greedy."""
    num_draft_tokens: list[int] | None = None
    """Per request, how many leading draft tokens are real (``0 .. k``; the rest is
    padding the engine does not verify); ``None`` means all ``k`` for every request.
    Methods that may find nothing to propose (n-gram lookup) set it."""


@dataclass
class TargetHiddenStates:
    """The target's hidden states at the positions one target forward verified.

    Rows are flattened request by request: request ``i`` contributes ``num_rows[i]`` rows
    for cache positions ``start_positions[i] .. start_positions[i] + num_rows[i] - 1``,
    whose input tokens are now committed (the prompt after a prefill; the last emitted
    token plus the accepted draft tokens after a verification; the last emitted token
    after a plain decode step). Rows built on rejected draft tokens are never included.
    """

    slot_ids: list[int]
    start_positions: list[int]
    num_rows: list[int]
    hidden_states: torch.Tensor
    """[sum(num_rows), hidden_size] the target's final (normed) hidden states."""
    aux_hidden_states: torch.Tensor | None
    """[sum(num_rows), len(aux_hidden_state_layers) * hidden_size], or ``None`` when the
    speculator asked for no auxiliary layers."""


class BaseSpeculator(ABC):
    """Proposes draft tokens for the target to verify."""

    max_num_speculative_tokens: int
    """The largest k :meth:`propose` accepts (the k the engine was started with)."""

    uses_target_hidden_states: bool = False
    """True when the method conditions on the target's hidden states (EAGLE, MTP,
    DFlash, Gemma4 MTP): the engine then hands them over through :meth:`observe_target`
    after every target forward. False spares the engine that work."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    """Target layers whose input residual stream the method needs (EAGLE-3 auxiliary
    hidden states); ids as ``LlamaForCausalLM.forward_with_aux`` defines them."""

    @abstractmethod
    def init_cudagraph_manager(self) -> None:
        """Set up CUDA-graph managers for the draft forwards (no-op for eager execution)."""

    @abstractmethod
    def capture(self) -> None:
        """Capture CUDA graphs for the draft forwards (no-op for eager execution)."""

    @abstractmethod
    def propose(self, inputs: SpeculatorInput, num_speculative_tokens: int) -> DraftProposal:
        """Propose ``num_speculative_tokens`` tokens to follow each request's tokens."""

    def check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Validate the ``k`` a :meth:`propose` call was given.

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, max_num_speculative_tokens]``.
        """
        k = num_speculative_tokens
        if not 1 <= k <= self.max_num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens {k} outside [1, {self.max_num_speculative_tokens}]"
            )

    def bind_target(self, target_runner: ModelRunner) -> None:
        """Called once by the engine after the target is loaded, before any request.
        Methods that share the target's weights (embeddings, LM head) or read its KV cache
        (Gemma4 MTP) keep the runner; validation against the target happens here.
        The default keeps nothing.

        Raises:
            ValueError: the draft does not fit this target (names the field and values).
        """
        return None

    def observe_target(self, states: TargetHiddenStates) -> None:
        """Receive the target's hidden states at newly committed positions (called
        after every target forward when :attr:`uses_target_hidden_states` is true).
        The default ignores them."""
        return None

    def add_requests(self, slot_ids: list[int]) -> None:
        """Forget whatever state earlier occupants of ``slot_ids`` left (new requests).
        Stateless speculators keep this default, which does nothing."""
        return None

    def rollback(self, slot_ids: list[int], num_valid_tokens: list[int]) -> None:
        """After verification, drop draft state beyond the first ``num_valid_tokens[i]``
        tokens of request ``i`` (those built on rejected draft tokens). Stateless
        speculators keep this default, which does nothing."""
        return None
