"""Automatic prefix caching without a model: block hashing, reference counts and LRU
eviction in the block pool."""
from __future__ import annotations

from engine_actors.block_pool import BlockPool, block_hash

BS = 4


# ---- block hashing -------------------------------------------------------------------------
def test_block_hash_identifies_the_whole_prefix():
    a = block_hash(b"", [1, 2, 3, 4])
    assert a == block_hash(b"", [1, 2, 3, 4])
    assert a != block_hash(b"", [1, 2, 3, 5])
    assert a != block_hash(b"", [1, 2, 3, 4], salt="adapter-1")
    # equal tokens after different parents are different blocks
    assert block_hash(a, [9, 9, 9, 9]) != block_hash(block_hash(b"", [0, 2, 3, 4]), [9, 9, 9, 9])
    # token ids past 2**31 do not collide with small ones
    assert block_hash(b"", [2 ** 40]) != block_hash(b"", [0])


# ---- the pool ------------------------------------------------------------------------------
def full_blocks(pool: BlockPool, tokens: list[list[int]]) -> tuple[list[int], list[bytes]]:
    """Take one block per token list, register them as a chain; returns blocks, hashes."""
    blocks, hashes, parent = pool.take(len(tokens)), [], b""
    for block, toks in zip(blocks, tokens):
        parent = block_hash(parent, toks)
        hashes.append(parent)
        pool.register(block, parent)
    return blocks, hashes


def test_released_blocks_stay_cached_and_are_found_by_prefix():
    pool = BlockPool(8)
    blocks, hashes = full_blocks(pool, [[1] * 4, [2] * 4, [3] * 4])
    pool.release(blocks)
    assert pool.num_available == 8  # cached and unreferenced: still available
    assert pool.lookup(hashes) == blocks
    assert pool.lookup(hashes[:2] + [b"other"]) == blocks[:2]
    assert pool.lookup([b"other"] + hashes[1:]) == []  # a prefix, or nothing


def test_reference_counts_keep_shared_blocks():
    pool = BlockPool(4)
    blocks, hashes = full_blocks(pool, [[1] * 4, [2] * 4])
    pool.acquire(blocks[:1])  # a second request shares the first block
    assert pool.refs[blocks[0]] == 2
    pool.release(blocks)  # the first request ends
    assert pool.refs[blocks[0]] == 1 and pool.num_available == 3
    # the shared block is never given out while referenced, even when all else is taken
    taken = pool.take(3)
    assert blocks[0] not in taken
    assert pool.lookup(hashes) == blocks[:1]  # the second block was evicted for them


def test_least_recently_used_block_is_evicted_first():
    pool = BlockPool(4)
    old, old_hashes = full_blocks(pool, [[1] * 4, [2] * 4])
    new, new_hashes = full_blocks(pool, [[3] * 4, [4] * 4])
    pool.release(old)
    pool.release(new)
    pool.acquire(pool.lookup(old_hashes[:1]))  # touched again: now the most recent
    pool.release(old[:1])
    # eviction order: old[1] (released first), then new's tail before its head, then old[0]
    assert pool.take(1) == [old[1]]
    assert pool.take(1) == [new[1]]
    assert pool.lookup(new_hashes) == new[:1]
    assert pool.take(1) == [new[0]]
    assert pool.lookup(old_hashes) == old[:1]


def test_unhashed_blocks_are_free_at_once_and_duplicates_not_registered():
    pool = BlockPool(4)
    blocks, hashes = full_blocks(pool, [[1] * 4])
    twin = pool.take(1)  # a request that computed the same block concurrently
    pool.register(twin[0], hashes[0])
    assert pool.lookup(hashes) == blocks  # the first one stays the cached copy
    pool.release(twin)
    pool.release(blocks)
    assert pool.take(3) == [b for b in range(4) if b != blocks[0]]  # free ones first


def test_caching_off_registers_nothing():
    pool = BlockPool(4, caching=False)
    blocks, hashes = full_blocks(pool, [[1] * 4])
    pool.release(blocks)
    assert pool.lookup(hashes) == []
