"""The GPU engine's continuous-batching scheduler on its own (pure Python): admission
by KV blocks, batch and token limits, the end-of-step lookahead reserve, preemption of
the newest requests by recompute, and block accounting."""

from __future__ import annotations

import pytest

from specula.runtime.engine.request import Request
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.block_manager import BlockManager
from specula.runtime.engine.scheduler import PagedScheduler

BLOCK = 4


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(), frozenset(), None)


def _scheduler(num_blocks: int, *, max_num_seqs=8, budget=1000, lookahead=4, watermark=0.0):
    bm = BlockManager(num_blocks, BLOCK, watermark)
    return PagedScheduler(bm, max_num_seqs, budget, lookahead)


def _step(sched: PagedScheduler, accepted: int, k_next: int):
    """Emit ``accepted + 1`` tokens to every running request (one to a prefill), then
    finish the step."""
    out = sched.schedule()
    for r in out.decode + out.prefill:
        r.token_ids.extend([7] * (1 if r in out.prefill else accepted + 1))
        sched.finish_step(r, k_next + 1)
    return out


def test_admission_reserves_prompt_plus_lookahead():
    sched = _scheduler(6)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sched.add(_request(rid, n))
    out = sched.schedule()
    # Each needs blocks(5 + 4) = 3: two fit in 6 blocks, the third waits.
    assert [r.request_id for r in out.prefill] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.block_manager.num_tokens("a") == 5
    assert sched.block_manager.num_free_blocks == 2


def test_batch_and_token_limits():
    sched = _scheduler(100, max_num_seqs=2, budget=12)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sched.add(_request(rid, n))
    assert [r.request_id for r in sched.schedule().prefill] == ["a", "b"]
    sched = _scheduler(100, budget=8)
    for rid, n in (("a", 5), ("b", 5)):
        sched.add(_request(rid, n))
    assert [r.request_id for r in sched.schedule().prefill] == ["a"]
    # A prompt longer than the budget still runs, alone.
    sched = _scheduler(100, budget=8)
    sched.add(_request("long", 30))
    assert [r.request_id for r in sched.schedule().prefill] == ["long"]


def test_finish_step_keeps_accepted_slots_and_takes_the_next_forwards():
    sched = _scheduler(20)
    sched.add(_request("a", 5))
    _step(sched, accepted=0, k_next=3)  # prefill: 1 token; next forward verifies 4
    r = sched.running[0]
    assert len(r.token_ids) == 6
    assert sched.block_manager.num_tokens("a") == 5 + 4
    out = _step(sched, accepted=2, k_next=3)  # 3 tokens emitted
    assert out.decode == [r] and not out.prefill
    assert len(r.token_ids) == 9
    assert r.num_computed_tokens == 8
    assert sched.block_manager.num_tokens("a") == 8 + 4
    with pytest.raises(ValueError):
        sched.finish_step(r, 5)  # more than the lookahead


def test_preempts_newest_first_and_admits_nothing_that_step():
    sched = _scheduler(8)
    for rid in ("a", "b"):
        sched.add(_request(rid, 4))
    _step(sched, accepted=0, k_next=3)
    preempted = 0
    for _ in range(6):
        out = _step(sched, accepted=3, k_next=3)
        if out.preempted:
            assert [r.request_id for r in out.preempted] == ["b"]
            assert not out.prefill
            preempted += 1
            break
    assert preempted == 1
    b = sched.waiting[0]
    assert b.request_id == "b" and b.num_computed_tokens == 0
    assert not sched.block_manager.has_request("b")
    assert sched.num_preemptions == 1
    # Readmitted later with all its tokens (prompt and output) as the prompt.
    sched.remove("a")
    out = sched.schedule()
    assert b in out.prefill
    assert sched.block_manager.num_tokens("b") == len(b.token_ids)


def test_remove_frees_blocks_wherever_the_request_is():
    sched = _scheduler(10)
    sched.add(_request("a", 5))
    sched.add(_request("b", 30))  # does not fit: stays waiting
    sched.schedule()
    assert sched.remove("b").request_id == "b"
    assert sched.remove("a").request_id == "a"
    assert sched.remove("a") is None
    assert sched.block_manager.num_free_blocks == 10
    assert not sched.running and not sched.waiting


def test_invalid_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        PagedScheduler(BlockManager(4, BLOCK), 0, 10, 1)
