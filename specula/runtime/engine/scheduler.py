"""Continuous batching over a paged KV cache: admission by KV capacity, recompute
preemption (Orca, Yu et al., OSDI 2022; vLLM's scheduler, Kwon et al., arXiv 2309.06180).

Every step runs the *running* requests (each decodes one token, or verifies its ``k``
drafts: ``k + 1`` query tokens) together with *prefills* of newly admitted requests, in
one forward. Before the step, :meth:`PagedScheduler.schedule` gives every request the KV
slots the whole step may write, so nothing is allocated while the device works:

- a running request holds slots for ``num_computed_tokens + num_decode_tokens +
  num_lookahead_tokens``: this step's query tokens, then the draft tokens the speculator
  writes after the last accepted one (however many are accepted);
- an admitted request holds slots for its tokens plus ``num_lookahead_tokens``; the
  leading full blocks of a cached prefix are shared (:meth:`BlockManager.match_prefix`),
  its ``num_computed_tokens`` start after them and only the rest is prefilled; its own
  full prompt blocks are named at once, for prompts admitted after it.

Slots a request holds beyond that (those of rejected drafts) are returned at the next
schedule. When the running requests' growth does not fit, the newest running requests
are preempted: their blocks are freed and they go back to the front of the waiting queue
with all their tokens (prompt and output so far), which are prefilled again when
readmitted (vLLM's ``PreemptionMode.RECOMPUTE``). A step that preempted admits nothing.

Waiting requests are admitted oldest first while the requests fit ``max_num_seqs``, their prompt
tokens fit the step's ``max_num_batched_tokens`` budget, and their blocks fit above the watermark.

Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specula.runtime.engine.block_manager import BlockManager, cdiv
from specula.runtime.engine.request import Request


@dataclass
class SchedulerOutput:
    """The requests of one step, in the order of the forward's rows."""

    decode: list[Request] = field(default_factory=list)
    """Running requests: one decode token or ``k + 1`` verification tokens each."""
    prefill: list[Request] = field(default_factory=list)
    """Requests admitted this step (new, or resumed after preemption), prefilled from
    ``num_computed_tokens`` on (after a cached prefix)."""
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted this step (now at the front of the waiting queue)."""


class PagedScheduler:
    """Waiting queue, running batch and KV blocks of the engine.

    Args:
        block_manager: the KV block pool (keyed by request id).
        max_num_seqs: most running requests.
        max_num_batched_tokens: most prompt tokens prefilled in one step (a request
            longer than this is still admitted alone, so that it is not stuck).

    Raises:
        ValueError: a non-positive limit.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        if min(max_num_seqs, max_num_batched_tokens) < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                             f"{max_num_batched_tokens} must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
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

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self, num_decode_tokens: int, num_lookahead_tokens: int) -> SchedulerOutput:
        """Choose this step's requests and give them their slots (module docstring).

        Args:
            num_decode_tokens: query tokens of each running request this step (1, or
                ``k + 1`` to verify ``k`` drafts).
            num_lookahead_tokens: slots the speculator may write after a request's last
                accepted token (0 without one).
        """
        bm = self.block_manager
        out = SchedulerOutput()
        step = num_decode_tokens + num_lookahead_tokens
        growth = {r: cdiv(r.num_computed_tokens + step, bm.block_size)
                  - bm.num_blocks_held(r.request_id) for r in self.running}
        needed = sum(growth.values())
        while self.running and needed > bm.num_free_blocks:
            victim = self.running[-1]
            needed -= growth.pop(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        # Shrinking first returns the blocks the growing ones take.
        for request in sorted(self.running, key=growth.__getitem__):
            bm.resize(request.request_id, request.num_computed_tokens + step)
        out.decode = list(self.running)
        if out.preempted:
            return out
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = len(request.token_ids)
            cached = bm.match_prefix(request.token_ids) if request.reuses_prefix_cache else []
            num_new = n - len(cached) * bm.block_size
            too_long = num_new > budget and (out.prefill or out.decode)
            if too_long or not bm.can_allocate(n + num_lookahead_tokens, cached):
                break
            self.waiting.popleft()
            bm.allocate(request.request_id, n + num_lookahead_tokens, cached)
            # Named now, computed in this step: a prompt admitted after it in the same
            # step reuses them too (its attention reads the cache after every row of the
            # forward wrote its keys and values).
            bm.cache_blocks(request.request_id, request.token_ids, n)
            bm.record_prompt(n, n - num_new)
            request.num_computed_tokens = n - num_new
            self.running.append(request)
            out.prefill.append(request)
            budget -= num_new
        return out

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
