"""The paged KV block allocator: block tables, slot ids, growth for decode and
(k + 1)-token verification, truncation after rejection, watermark admission, freeing."""

from __future__ import annotations

import pytest

from specula.runtime.engine.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_gives_blocks_for_the_prompt_and_slots_follow_the_table():
    m = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    table = m.allocate("a", 6)
    assert len(table) == 2 and len(set(table)) == 2
    assert m.num_free_blocks == 6 and m.num_tokens("a") == 6
    assert m.append_slots("a", 3) == [table[1] * 4 + i for i in range(2, 4)] + [
        m.block_table("a")[2] * 4
    ]


def test_append_slots_fills_the_last_block_before_taking_a_new_one():
    m = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    table = m.allocate("a", 3)
    assert m.append_slots("a", 1) == [table[0] * 4 + 3]
    assert m.num_free_blocks == 7
    # A verification step of k + 1 = 5 tokens spans into two new blocks.
    slots = m.append_slots("a", 5)
    new_table = m.block_table("a")
    assert len(new_table) == 3 and new_table[0] == table[0]
    assert slots == [new_table[1] * 4 + i for i in range(4)] + [new_table[2] * 4]
    assert m.num_tokens("a") == 9 and m.num_free_blocks == 5


def test_resize_returns_the_blocks_of_rejected_tokens():
    m = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    m.allocate("a", 4)
    m.append_slots("a", 5)  # 9 tokens, 3 blocks
    m.resize("a", 5)  # 2 of the draft tokens accepted + bonus
    assert m.num_tokens("a") == 5 and len(m.block_table("a")) == 2
    assert m.num_free_blocks == 6


def test_free_returns_every_block_and_blocks_are_reused():
    m = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    a = m.allocate("a", 4)
    m.allocate("b", 4)
    assert m.num_free_blocks == 0
    m.free("a")
    assert m.num_free_blocks == 2
    with pytest.raises(KeyError):
        m.block_table("a")
    assert sorted(m.allocate("c", 3)) == sorted(a)
    with pytest.raises(KeyError):
        m.free("a")


def test_blocks_are_never_shared_between_requests():
    m = BlockManager(num_blocks=16, block_size=2, watermark=0.0)
    for r in range(5):
        m.allocate(r, 3)
    for r in range(5):
        m.append_slots(r, 2)
    m.resize(1, 1)
    m.free(3)
    m.allocate(9, 5)
    owned = [b for r in (0, 1, 2, 4, 9) for b in m.block_table(r)]
    assert len(owned) == len(set(owned))
    assert len(owned) + m.num_free_blocks == 16


def test_watermark_limits_admission_but_not_growth():
    m = BlockManager(num_blocks=100, block_size=1, watermark=0.1)
    assert m.watermark_blocks == 10
    assert m.can_allocate(90) and not m.can_allocate(91)
    m.allocate("a", 90)
    assert not m.can_allocate(1)
    # A running request may dip into the reserve.
    m.append_slots("a", 10)
    assert m.num_free_blocks == 0


def test_exhaustion_raises_and_leaves_state_unchanged():
    m = BlockManager(num_blocks=2, block_size=4, watermark=0.0)
    m.allocate("a", 8)
    with pytest.raises(NoFreeBlocksError):
        m.append_slots("a", 1)
    assert m.num_tokens("a") == 8 and len(m.block_table("a")) == 2
    with pytest.raises(NoFreeBlocksError):
        m.allocate("b", 1)
    assert m.num_free_blocks == 0


def test_invalid_arguments():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 16, watermark=1.0)
    m = BlockManager(4, 16)
    m.allocate("a", 1)
    with pytest.raises(ValueError):
        m.allocate("a", 1)
    with pytest.raises(ValueError):
        m.append_slots("a", -1)


def test_resize_grows_and_shrinks_and_reports_the_first_new_block():
    m = BlockManager(num_blocks=6, block_size=4, watermark=0.0)
    m.allocate("a", 5)  # 2 blocks
    assert m.resize("a", 13) == 2  # blocks 3 and 4 taken
    assert m.num_blocks_held("a") == 4 and m.num_tokens("a") == 13
    assert m.blocks_from("a", 2) == m.block_table("a")[2:]
    assert m.resize("a", 6) == 2  # shrinks to 2 blocks: none taken
    assert m.num_blocks_held("a") == 2 and m.num_free_blocks == 4
    with pytest.raises(NoFreeBlocksError):
        m.resize("a", 40)
    assert m.num_blocks_held("a") == 2 and m.num_tokens("a") == 6  # unchanged


# ---- automatic prefix caching ---------------------------------------------------------


def _cached_manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=4, watermark=0.0, enable_prefix_caching=True)


def test_full_computed_blocks_are_reused_by_a_later_prompt():
    m = _cached_manager()
    a = list(range(1, 11))  # 10 tokens: blocks [1-4], [5-8] full, [9, 10] partial
    table_a = m.allocate("a", len(a))
    m.cache_blocks("a", a, num_computed=10)
    assert m.num_cached_blocks == 2
    b = a[:8] + [99, 98, 97]
    cached = m.match_prefix(b)
    assert cached == table_a[:2]
    assert m.can_allocate(len(b), cached)
    table_b = m.allocate("b", len(b), cached)
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert m.num_free_blocks == 8 - 3 - 1  # one fresh block for b
    m.free("a")
    assert m.num_free_blocks == 8 - 3  # the shared blocks stay with b
    m.free("b")
    assert m.num_free_blocks == 8


def test_a_prompt_always_computes_its_last_token_and_partial_blocks_are_not_named():
    m = _cached_manager()
    a = list(range(1, 9))  # exactly two blocks
    m.allocate("a", 8)
    m.cache_blocks("a", a, num_computed=7)  # the second block is not computed whole
    assert m.num_cached_blocks == 1
    m.cache_blocks("a", a, num_computed=8)
    assert m.num_cached_blocks == 2
    # The same prompt again reuses one block only: its last token must be computed.
    assert len(m.match_prefix(a)) == 1
    assert len(m.match_prefix(a + [50])) == 2
    # A different first block breaks the chain, whatever follows.
    assert m.match_prefix([77] + a[1:] + [50]) == []


def test_counters_and_no_caching_when_disabled():
    m = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    m.allocate("a", 9)
    m.cache_blocks("a", list(range(9)), num_computed=9)
    assert m.match_prefix(list(range(9))) == [] and m.num_cached_blocks == 0
    m.record_prompt(9, 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)
    c = _cached_manager()
    c.record_prompt(9, 4)
    assert (c.prefix_cache_queries, c.prefix_cache_hits) == (9, 4)


def test_eviction_takes_unnamed_blocks_first_then_least_recently_freed_tail_first():
    m = _cached_manager(num_blocks=5)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15]
    table_a = m.allocate("a", 9)  # 3 blocks, 2 named
    m.cache_blocks("a", a, 9)
    table_b = m.allocate("b", 5)  # 2 blocks, 1 named
    m.cache_blocks("b", b, 5)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 5 and m.num_cached_blocks == 3
    # One unnamed block of each request is free: they go first, nothing is evicted.
    m.allocate("c", 8)
    assert m.num_cached_blocks == 3
    # Then a's blocks (freed first), its tail before its head.
    m.allocate("d", 4)
    assert m.match_prefix(a + [0]) == table_a[:1]
    m.allocate("e", 4)
    assert m.match_prefix(a + [0]) == []
    assert m.match_prefix(b + [0]) == table_b[:1]


def test_a_cached_free_block_counts_as_taken_when_reused():
    m = _cached_manager(num_blocks=3)
    a = [1, 2, 3, 4, 5]
    m.allocate("a", 5)
    m.cache_blocks("a", a, 5)
    m.free("a")
    cached = m.match_prefix(a)
    assert len(cached) == 1 and m.num_free_blocks == 3
    assert m.can_allocate(12, cached)  # the cached block plus the two others
    assert not m.can_allocate(13, cached)
    m.allocate("b", 12, cached)
    assert m.num_free_blocks == 0
    with pytest.raises(ValueError, match="not all cached"):
        m.allocate("c", 4, [2])


def test_equal_contents_keep_one_name_and_shrinking_returns_private_blocks():
    m = _cached_manager()
    a = [1, 2, 3, 4, 5]
    table_a = m.allocate("a", 5)
    table_b = m.allocate("b", 5)  # computed the same block before a's was named
    m.cache_blocks("a", a, 5)
    m.cache_blocks("b", a, 5)
    assert m.num_cached_blocks == 1 and m.match_prefix(a) == table_a[:1]
    m.resize("b", 4)  # rejected draft slots go back
    assert m.num_blocks_held("b") == 1
    m.free("b")
    assert table_b[0] not in m.match_prefix(a)
