"""The paged cache's bookkeeping: allocate, share, free, evict, and the hash chain."""
from __future__ import annotations

import pytest

from worker.continuous.block_manager import BlockManager, BlockTable, chain_hash


def admitted(manager: BlockManager, tokens: list[int], margin: int = 0) -> tuple[BlockTable, int]:
    table = BlockTable()
    cached = manager.allocate(table, tokens, margin)
    assert cached is not None
    manager.computed(table, tokens, len(tokens))  # as if the step that prefilled it ran
    return table, cached


def test_allocate_takes_enough_blocks_and_release_gives_them_back():
    manager = BlockManager(num_blocks=10, block_size=4, prefix_caching=False)
    table, cached = admitted(manager, list(range(9)))
    assert (len(table.blocks), cached, manager.free) == (3, 0, 7)
    assert len(set(table.blocks)) == 3
    manager.release(table)
    assert manager.free == 10 and table.blocks == []


def test_no_room_takes_nothing_and_the_margin_counts():
    manager = BlockManager(num_blocks=4, block_size=4, prefix_caching=False)
    assert manager.allocate(BlockTable(), list(range(17))) is None  # 5 blocks
    assert manager.allocate(BlockTable(), list(range(16)), margin=1) is None  # 4 + 1
    assert manager.free == 4
    assert manager.allocate(BlockTable(), list(range(16))) == 0


def test_grow_adds_a_block_only_when_the_last_is_full():
    manager = BlockManager(num_blocks=3, block_size=4, prefix_caching=False)
    table, _ = admitted(manager, [1, 2, 3])
    assert manager.grow(table, 4) and len(table.blocks) == 1
    assert manager.grow(table, 5) and len(table.blocks) == 2
    assert manager.grow(table, 12) and len(table.blocks) == 3
    assert not manager.grow(table, 13) and len(table.blocks) == 3  # the pool is out


def test_a_shared_prefix_is_shared_with_reference_counts():
    manager = BlockManager(num_blocks=10, block_size=4)
    prefix = list(range(100, 108))  # two full blocks
    first, _ = admitted(manager, prefix + [1, 2, 3])
    second, cached = admitted(manager, prefix + [7, 8])
    assert cached == 8 and second.blocks[:2] == first.blocks[:2]
    assert second.blocks[2] != first.blocks[2]
    assert manager.free == 10 - 4
    manager.release(first)  # the shared blocks are still held by the second
    third, cached = admitted(manager, prefix + [9])
    assert cached == 8 and third.blocks[:2] == second.blocks[:2]


def test_the_last_token_is_always_computed_even_when_every_block_matches():
    manager = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(8))
    first, _ = admitted(manager, tokens)
    manager.release(first)
    again, cached = admitted(manager, tokens)
    assert cached == 4, "the second block holds the last token, whose logits are needed"


def test_the_hash_chains_over_the_whole_prefix():
    manager = BlockManager(num_blocks=10, block_size=2)
    first, _ = admitted(manager, [1, 2, 3, 4, 5])
    assert first.hashes == [chain_hash(None, (1, 2)), chain_hash(chain_hash(None, (1, 2)), (3, 4))]
    # The same second block after a different first one is not a match.
    other, cached = admitted(manager, [9, 9, 3, 4, 5])
    assert cached == 0 and other.blocks[1] != first.blocks[1]


def test_freed_blocks_stay_matchable_while_unnamed_ones_are_taken_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, _ = admitted(manager, [1, 2, 0])  # 2 blocks, the first named (1, 2)
    b, _ = admitted(manager, [3, 4, 0])  # 2 blocks, the first named (3, 4)
    named = {a.blocks[0], b.blocks[0]}
    manager.release(a)
    manager.release(b)
    assert manager.free == 4
    c, _ = admitted(manager, [7, 7, 8])  # 2 blocks: the unnamed ones, nothing evicted
    assert not set(c.blocks) & named
    d, cached = admitted(manager, [1, 2, 5])
    assert cached == 2 and d.blocks[0] in named


def test_eviction_takes_the_longest_unused_block_and_forgets_its_name():
    manager = BlockManager(num_blocks=2, block_size=2)
    a, _ = admitted(manager, [1, 2, 0])  # block a0 named (1, 2); a1 unnamed
    manager.release(a)
    b, _ = admitted(manager, [3, 4, 0])  # reuses the unnamed block first, then evicts a0
    assert manager.hits == 0
    manager.release(b)
    c, cached = admitted(manager, [1, 2, 9])
    assert cached == 0, "(1, 2) was evicted to make room for (3, 4)"
    manager.release(c)
    d, cached = admitted(manager, [1, 2, 9])
    assert cached == 2, "and is cached again once recomputed"


def test_without_prefix_caching_nothing_is_shared():
    manager = BlockManager(num_blocks=10, block_size=4, prefix_caching=False)
    first, _ = admitted(manager, list(range(9)))
    second, cached = admitted(manager, list(range(9)))
    assert cached == 0 and not set(first.blocks) & set(second.blocks)


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


def test_fresh_blocks_are_reused_last_freed_first_so_the_pool_stays_cold():
    manager = BlockManager(num_blocks=100, block_size=4, prefix_caching=False)
    used = set()
    for _ in range(50):  # one short request after another
        table, _ = admitted(manager, [1, 2, 3, 4, 5])
        used.update(table.blocks)
        manager.release(table)
    assert len(used) == 2, "the same two blocks every time: the rest of the pool is never touched"
