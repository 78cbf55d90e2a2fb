"""``BlockManager``'s guarantees: allocation, reference counts, the prefix cache keyed by chained
hashes (a hit needs the same tokens too), and the LRU free list that keeps freed blocks cached
until they are reused, oldest first, a released table's tail before its head."""

import pytest

from jointrl.rl.rollout.block_manager import BlockManager, chain_hash


def test_a_pool_needs_a_block_and_a_slot():
    for num_blocks, block_size in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1"):
            BlockManager(num_blocks, block_size)


def test_blocks_for_rounds_up_to_whole_blocks():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocation_hands_out_each_block_once_until_the_pool_is_empty():
    bm = BlockManager(3, 4)
    blocks = [bm.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and bm.num_free == 0
    assert [bm.ref_count[b] for b in blocks] == [1, 1, 1]


def test_a_shared_block_is_freed_by_its_last_release_only():
    bm = BlockManager(2, 4)
    b = bm.allocate()
    bm.acquire(b)  # a second table shares it (a GRPO group's prompt)
    assert bm.ref_count[b] == 2
    bm.release([b])
    assert bm.ref_count[b] == 1 and bm.num_free == 1
    bm.release([b])
    assert bm.ref_count[b] == 0 and bm.num_free == 2
    with pytest.raises(AssertionError, match="released twice"):
        bm.release([b])


def test_a_prefix_cache_hit_needs_the_key_and_the_tokens():
    bm = BlockManager(4, 2)
    b = bm.allocate()
    bm.register(b, key=11, tokens=(5, 6))
    assert bm.is_cached(11) and bm.lookup(11, (5, 6)) == b
    assert bm.lookup(11, (5, 7)) is None  # a hash collision is a miss
    assert bm.lookup(12, (5, 6)) is None


def test_the_first_writer_of_a_key_wins_and_a_block_keeps_its_first_key():
    bm = BlockManager(4, 2)
    a, b = bm.allocate(), bm.allocate()
    bm.register(a, 11, (5, 6))
    bm.register(b, 11, (5, 6))  # the same prefix computed twice: the first copy stays the cached one
    bm.register(a, 12, (1, 2))  # a registered block is not re-keyed
    assert bm.lookup(11, (5, 6)) == a
    assert not bm.is_cached(12)


def test_a_freed_block_stays_a_hit_until_it_is_reused():
    bm = BlockManager(2, 2)
    a = bm.allocate()
    bm.register(a, 11, (5, 6))
    bm.release([a])
    assert bm.num_free == 2 and bm.lookup(11, (5, 6)) == a
    bm.acquire(a)  # re-admission takes it back from the free list, keys/values intact
    assert bm.ref_count[a] == 1 and bm.num_free == 1 and bm.lookup(11, (5, 6)) == a


def test_allocation_reuses_the_least_recently_freed_block_and_drops_its_cache_entry():
    bm = BlockManager(3, 2)
    a, b, c = (bm.allocate() for _ in range(3))
    for block, key in ((a, 1), (b, 2), (c, 3)):
        bm.register(block, key, (key, key))
    bm.release([b])
    bm.release([a])
    bm.release([c])  # LRU order of the free list: b, a, c
    assert bm.allocate() == b
    assert not bm.is_cached(2) and bm.lookup(2, (2, 2)) is None
    assert bm.lookup(1, (1, 1)) == a and bm.lookup(3, (3, 3)) == c  # not reused yet: still hits
    assert bm.allocate() == a
    assert bm.lookup(3, (3, 3)) == c


def test_a_released_table_frees_its_tail_first_so_its_head_is_reused_last():
    bm = BlockManager(3, 2)
    table = [bm.allocate() for _ in range(3)]
    bm.release(table)
    assert [bm.allocate() for _ in range(3)] == table[::-1]


def test_clear_cache_forgets_every_entry():
    bm = BlockManager(2, 2)
    a, b = bm.allocate(), bm.allocate()
    bm.register(a, 1, (1, 1))
    bm.register(b, 2, (2, 2))
    bm.release([b])
    bm.clear_cache()
    assert not bm.is_cached(1) and not bm.is_cached(2) and bm.lookup(1, (1, 1)) is None
    bm.register(a, 3, (3, 3))  # blocks can be registered again under the new weights' keys
    assert bm.lookup(3, (3, 3)) == a


def test_chain_hash_covers_the_whole_prefix():
    head = chain_hash(0, (1, 2))
    assert chain_hash(head, (3, 4)) == chain_hash(chain_hash(0, (1, 2)), (3, 4))
    assert chain_hash(head, (3, 4)) != chain_hash(chain_hash(0, (9, 2)), (3, 4))  # same block, other prefix
    assert chain_hash(head, (3, 4)) != chain_hash(head, (4, 3))
