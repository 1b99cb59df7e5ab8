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
