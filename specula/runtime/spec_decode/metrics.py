"""Speculative-decoding counters (counting only; exporting is the server's job).

Same semantics as vLLM's ``SpecDecodingStats`` (``vllm/v1/spec_decode/metrics.py``), so
the Prometheus series ``specula:spec_decode_*`` mean what ``vllm:spec_decode_*`` mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counters since engine start; never reset, only incremented.

    Derived figures (for display, not export): acceptance rate = ``num_accepted_tokens /
    num_draft_tokens``; mean acceptance length = ``1 + num_accepted_tokens / num_drafts``
    (tokens emitted per target forward, counting the recovered or bonus token)."""

    num_spec_tokens: int
    """Maximum k the engine was started with; length of the per-position list."""
    num_drafts: int = 0
    """Draft proposals verified (one per request per speculative step)."""
    num_draft_tokens: int = 0
    """Draft tokens proposed (k per proposal at the k in effect)."""
    num_accepted_tokens: int = 0
    """Draft tokens the target accepted (excluding recovered and bonus tokens)."""
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """``[i]``: proposals whose draft token at position ``i`` (0-based) was accepted."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        assert len(self.num_accepted_tokens_per_pos) == self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verified proposal of ``num_draft_tokens`` with
        ``num_accepted_tokens`` accepted (a prefix, by construction)."""
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
