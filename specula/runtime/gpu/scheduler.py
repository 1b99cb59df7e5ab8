"""Continuous batching over a paged KV cache: admission by KV capacity, recompute
preemption (Orca, Yu et al., OSDI 2022; vLLM's scheduler, Kwon et al., arXiv 2309.06180).

Every step runs the *running* requests (each decodes one token, or verifies its ``k``
drafts: ``k + 1`` query tokens) together with *prefills* of newly admitted requests, in
one forward. Invariants kept between steps:

- a running request holds KV slots for exactly the tokens of its next forward: its
  context ``len(token_ids) - 1`` plus ``k + 1`` verification (or 1 decode) slots;
- after a step the engine keeps the slots of the accepted tokens and appends those of
  the next forward (:meth:`PagedScheduler.finish_step`), which may take up to
  ``lookahead_slots = max_num_speculative_tokens + 1`` new slots per request.

:meth:`PagedScheduler.schedule` therefore *reserves* those future blocks for every
running request before anything is admitted, so the end-of-step growth never fails.
When the reserve does not fit, the newest running requests are preempted: their
blocks are freed and they go back to the front of the waiting queue with all their
tokens (prompt and output so far), which are prefilled again when readmitted
(vLLM's ``PreemptionMode.RECOMPUTE``). A step that preempted admits nothing.

Waiting requests are admitted oldest first while the requests fit ``max_num_seqs``,
their prompt tokens fit the step's ``max_num_batched_tokens`` budget, and their blocks
(prompt plus the lookahead reserve) fit above the block manager's watermark.

Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specula.runtime.engine.request import Request
from specula.runtime.gpu.block_manager import BlockManager


@dataclass
class SchedulerOutput:
    """The requests of one step, in the order of the forward's rows."""

    decode: list[Request] = field(default_factory=list)
    """Running requests: one decode token or ``k + 1`` verification tokens each."""
    prefill: list[Request] = field(default_factory=list)
    """Requests admitted this step (new, or resumed after preemption); their KV slots
    for every token in ``token_ids`` were allocated."""
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted this step (now at the front of the waiting queue)."""

    @property
    def num_reqs(self) -> int:
        return len(self.decode) + len(self.prefill)


class PagedScheduler:
    """Waiting queue, running batch and KV blocks of the GPU engine.

    Args:
        block_manager: the KV block pool (keyed by request id).
        max_num_seqs: most running requests.
        max_num_batched_tokens: most prompt tokens prefilled in one step (a request
            longer than this is still admitted alone, so that it is not stuck).
        lookahead_slots: most slots a request grows by at the end of a step
            (``max_num_speculative_tokens + 1``).

    Raises:
        ValueError: a non-positive limit.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead_slots: int,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, lookahead_slots) < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens="
                f"{max_num_batched_tokens} and lookahead_slots={lookahead_slots} must be >= 1"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead_slots = lookahead_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self.num_preemptions = 0
        """Preemptions since start (a counter)."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._by_id[request.request_id] = request

    def max_request_tokens(self) -> int:
        """Most tokens (context plus lookahead) a request can ever hold: the whole pool
        minus the watermark."""
        bm = self.block_manager
        return (bm.num_blocks - bm.watermark_blocks) * bm.block_size - self.lookahead_slots

    # -- scheduling ------------------------------------------------------------------

    def _reserve(self, request: Request) -> int:
        """Blocks ``request`` may still need for the end-of-step growth."""
        return self.block_manager.num_new_blocks(request.request_id, self.lookahead_slots)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests (see the module docstring).

        Returns:
            the running requests to decode or verify, then the admitted requests (now
            running too, with blocks for all their tokens), and the preempted ones.
        """
        bm = self.block_manager
        out = SchedulerOutput()
        reserved = sum(self._reserve(r) for r in self.running)
        while self.running and reserved > bm.num_free_blocks:
            victim = self.running[-1]
            reserved -= self._reserve(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        out.decode = list(self.running)
        if out.preempted:
            return out
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = len(request.token_ids)
            if n > budget and (out.prefill or out.decode):
                break
            needed = bm.num_blocks_needed(n + self.lookahead_slots)
            if bm.num_free_blocks - reserved - needed < bm.watermark_blocks:
                break
            self.waiting.popleft()
            bm.allocate(request.request_id, n)
            reserved += needed - bm.num_blocks_needed(n)
            self.running.append(request)
            out.prefill.append(request)
            budget -= n
        return out

    def finish_step(self, request: Request, num_next_tokens: int) -> None:
        """After a step that emitted tokens to a still-running ``request``: keep the KV
        slots of its context (all tokens but the last emitted one) and take the slots
        of its next forward (``num_next_tokens``: 1 to decode, ``k + 1`` to verify).

        Raises:
            ValueError: ``num_next_tokens`` outside ``[1, lookahead_slots]``.
        """
        if not 1 <= num_next_tokens <= self.lookahead_slots:
            raise ValueError(
                f"num_next_tokens={num_next_tokens} outside [1, {self.lookahead_slots}]"
            )
        context = len(request.token_ids) - 1
        request.num_computed_tokens = context
        # The step wrote every token it verified; those past the accepted ones go.
        self.block_manager.truncate(request.request_id, context)
        self.block_manager.append_slots(request.request_id, num_next_tokens)

    # -- removal ---------------------------------------------------------------------

    def remove(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks; ``None`` if unknown."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
            self.block_manager.free(request_id)
        else:
            self.waiting.remove(request)
        return request

    def remove_finished(self) -> None:
        for request in [r for r in self.running if r.finished]:
            self.remove(request.request_id)
