"""The engine's continuous-batching scheduler on its own (pure Python): admission by KV
blocks, batch and token limits, the slots a step may write (its query tokens plus the
speculator's lookahead), the return of rejected drafts' slots, preemption of the newest
requests by recompute, and block accounting."""

from __future__ import annotations

import pytest

from specula.runtime.engine.block_manager import BlockManager
from specula.runtime.engine.request import Request
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.engine.scheduler import PagedScheduler

BLOCK = 4
K = 3
"""Drafts verified per step in these tests: 4 query tokens per running request."""
LOOKAHEAD = 3


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(), frozenset(), seed=0)


def _scheduler(num_blocks: int, *, max_num_seqs=8, budget=1000, watermark=0.0):
    return PagedScheduler(BlockManager(num_blocks, BLOCK, watermark), max_num_seqs, budget)


def _step(sched: PagedScheduler, accepted: int):
    """Schedule a step of ``K + 1`` query tokens per running request, then commit what
    the engine would: ``accepted + 1`` tokens per running request, the prompt of a
    prefill (plus its first token)."""
    out = sched.schedule(K + 1, LOOKAHEAD)
    for r in out.decode:
        r.num_computed_tokens += accepted + 1
        r.token_ids.extend([7] * (accepted + 1))
    for r in out.prefill:
        r.num_computed_tokens = len(r.token_ids)
        r.token_ids.append(7)
    return out


def test_admission_takes_prompt_plus_lookahead():
    sched = _scheduler(6)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sched.add(_request(rid, n))
    out = sched.schedule(K + 1, LOOKAHEAD)
    # Each needs blocks(5 + 3) = 2: three fit in 6 blocks.
    assert [r.request_id for r in out.prefill] == ["a", "b", "c"]
    assert sched.block_manager.num_tokens("a") == 5 + LOOKAHEAD
    assert sched.block_manager.num_free_blocks == 0
    sched = _scheduler(5)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sched.add(_request(rid, n))
    assert [r.request_id for r in sched.schedule(K + 1, LOOKAHEAD).prefill] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_batch_and_token_limits():
    sched = _scheduler(100, max_num_seqs=2, budget=12)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sched.add(_request(rid, n))
    assert [r.request_id for r in sched.schedule(1, 0).prefill] == ["a", "b"]
    sched = _scheduler(100, budget=8)
    for rid, n in (("a", 5), ("b", 5)):
        sched.add(_request(rid, n))
    assert [r.request_id for r in sched.schedule(1, 0).prefill] == ["a"]
    # A prompt longer than the budget still runs, alone.
    sched = _scheduler(100, budget=8)
    sched.add(_request("long", 30))
    assert [r.request_id for r in sched.schedule(1, 0).prefill] == ["long"]


def test_running_requests_hold_the_step_and_return_rejected_slots():
    sched = _scheduler(20)
    sched.add(_request("a", 5))
    _step(sched, accepted=0)  # prefill: 5 tokens cached, the 6th sampled
    r = sched.running[0]
    assert r.num_computed_tokens == 5 and len(r.token_ids) == 6
    out = _step(sched, accepted=2)  # a verification of 4 tokens, 3 of them committed
    assert out.decode == [r] and not out.prefill
    # It held the 4 verification slots and the lookahead after them.
    assert r.num_computed_tokens == 8
    sched.schedule(K + 1, LOOKAHEAD)
    # The next step's hold starts from the committed tokens: the rejected ones' slots
    # beyond it went back to the pool.
    assert sched.block_manager.num_tokens("a") == 8 + K + 1 + LOOKAHEAD
    assert sched.block_manager.num_free_blocks == 20 - 4


def test_preempts_newest_first_and_admits_nothing_that_step():
    sched = _scheduler(8)
    for rid in ("a", "b"):
        sched.add(_request(rid, 4))
    _step(sched, accepted=0)
    preempted = 0
    for _ in range(6):
        out = _step(sched, accepted=3)
        if out.preempted:
            assert [r.request_id for r in out.preempted] == ["b"]
            assert not out.prefill
            preempted += 1
            break
    assert preempted == 1
    b = sched.waiting[0]
    assert b.request_id == "b" and b.num_computed_tokens == 0
    with pytest.raises(KeyError):
        sched.block_manager.block_table("b")
    assert sched.num_preemptions == 1
    # Readmitted later with all its tokens (prompt and output) as the prompt.
    sched.remove("a")
    out = sched.schedule(K + 1, LOOKAHEAD)
    assert b in out.prefill
    assert sched.block_manager.num_tokens("b") == len(b.token_ids) + LOOKAHEAD


def test_remove_frees_blocks_wherever_the_request_is():
    sched = _scheduler(10)
    sched.add(_request("a", 5))
    sched.add(_request("b", 40))  # does not fit: stays waiting
    sched.schedule(1, 0)
    assert sched.remove("b").request_id == "b"
    assert sched.remove("a").request_id == "a"
    assert sched.remove("a") is None
    assert sched.block_manager.num_free_blocks == 10
    assert not sched.running and not sched.waiting


def test_invalid_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        PagedScheduler(BlockManager(4, BLOCK), 0, 10)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PagedScheduler(BlockManager(4, BLOCK), 1, 0)


def test_a_cached_prefix_is_shared_and_only_the_rest_is_prefilled_and_budgeted():
    bm = BlockManager(20, BLOCK, 0.0, enable_prefix_caching=True)
    sched = PagedScheduler(bm, max_num_seqs=8, max_num_batched_tokens=12)
    sched.add(_request("a", 11))  # tokens 1..11: two full blocks, named at admission
    _step(sched, accepted=0)
    # b and c share a's first 9 tokens; 11 + 11 prompt tokens exceed the budget of 12,
    # but each prefills only 3 after its 8 cached ones.
    for rid in ("b", "c"):
        request = _request(rid, 9)
        request.token_ids += [50, 51]
        sched.add(request)
    out = _step(sched, accepted=0)
    assert [r.request_id for r in out.prefill] == ["b", "c"]
    a_blocks = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == a_blocks == bm.block_table("c")[:2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (11 + 11 + 11, 8 + 8)
    # Preempted and readmitted, a request finds its own blocks again.
    victim = sched.running[-1]
    sched._preempt(victim)
    bm_free = bm.num_free_blocks
    sched.schedule(K + 1, LOOKAHEAD)
    assert victim in sched.running and victim.num_computed_tokens == 8
    assert bm.num_free_blocks < bm_free


def test_prompts_admitted_in_one_step_share_their_common_blocks():
    bm = BlockManager(20, BLOCK, 0.0, enable_prefix_caching=True)
    sched = PagedScheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    for rid in ("a", "b"):
        sched.add(_request(rid, 10))
    out = sched.schedule(K + 1, LOOKAHEAD)
    assert [r.num_computed_tokens for r in out.prefill] == [0, 8]
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
