from __future__ import annotations

import random

import pytest

from engine_actors.kv_cache import KVCacheManager
from engine_actors.request import Request, SamplingParams


def make_req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def test_blocks_are_allocated_lazily_from_the_reservation():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_num_seqs=4)
    req = make_req("a", 5, 7)  # at most 12 tokens = 3 blocks
    kv.admit(req, req.max_num_tokens)
    assert (kv.num_reserved_blocks, kv.num_free_blocks, kv.num_unreserved_blocks) == (3, 10, 7)
    assert len(kv.grow(req, 5)) == 2  # 5 tokens need 2 blocks
    assert (kv.num_reserved_blocks, kv.num_free_blocks) == (1, 8)
    assert kv.grow(req, 8) == []  # still inside the second block
    assert len(kv.grow(req, 9)) == 1
    assert (kv.num_reserved_blocks, kv.num_free_blocks, len(req.blocks)) == (0, 7, 3)


def test_free_returns_blocks_reservation_and_row():
    kv = KVCacheManager(num_blocks=8, block_size=2, max_num_seqs=2)
    req = make_req("a", 3, 3)
    kv.admit(req, req.max_num_tokens)
    kv.grow(req, 3)
    kv.free(req)
    assert (kv.num_free_blocks, kv.num_reserved_blocks, kv.num_free_rows) == (8, 0, 2)
    assert req.blocks == [] and req.row == -1
    kv.free(req)  # idempotent
    assert (kv.num_free_blocks, kv.num_reserved_blocks, kv.num_free_rows) == (8, 0, 2)


def test_admission_refuses_to_overcommit():
    kv = KVCacheManager(num_blocks=4, block_size=4, max_num_seqs=8)
    a, b = make_req("a", 4, 8), make_req("b", 4, 1)
    kv.admit(a, a.max_num_tokens)  # 3 blocks
    with pytest.raises(RuntimeError):
        kv.admit(b, b.max_num_tokens)  # needs 2, only 1 unreserved
    assert not b.is_admitted and kv.num_reserved_blocks == 3


def test_rows_are_bounded():
    kv = KVCacheManager(num_blocks=100, block_size=1, max_num_seqs=2)
    reqs = [make_req(str(i), 1, 1) for i in range(3)]
    kv.admit(reqs[0], 2)
    kv.admit(reqs[1], 2)
    assert {reqs[0].row, reqs[1].row} == {0, 1}
    with pytest.raises(RuntimeError):
        kv.admit(reqs[2], 2)
    kv.free(reqs[0])
    kv.admit(reqs[2], 2)
    assert reqs[2].row in (0, 1) and reqs[2].row != reqs[1].row


def test_random_workload_keeps_blocks_disjoint_and_accounted():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=4, max_num_seqs=16)
    live: list[Request] = []
    for step in range(2000):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.5:
            req = make_req(str(step), rng.randint(1, 20), rng.randint(1, 20))
            need = kv.blocks_for(req.max_num_tokens)
            if kv.num_free_rows and need <= kv.num_unreserved_blocks:
                kv.admit(req, req.max_num_tokens)
                live.append(req)
        elif live:
            req = rng.choice(live)
            target = min(req.max_num_tokens, len(req.blocks) * 4 + rng.randint(1, 6))
            kv.grow(req, target)  # never fails: the reservation covers max_num_tokens
        owned = [b for r in live for b in r.blocks]
        assert len(owned) == len(set(owned))
        assert len(owned) + kv.num_free_blocks == 64
        assert kv.num_reserved_blocks == sum(r.num_reserved_blocks for r in live)
        assert kv.num_free_blocks >= kv.num_reserved_blocks


def test_lending_takes_unreferenced_blocks_from_the_end_only():
    kv = KVCacheManager(num_blocks=16, block_size=4, max_num_seqs=4)
    a = make_req("a", 8, 1)  # reserves 3 blocks
    kv.admit(a, a.max_num_tokens)
    kv.grow(a, 8)
    assert a.blocks == [0, 1]  # the lowest ids go first: the end of the pool stays free
    # units of 4 blocks, 3 lendable units (blocks 0..11; 12..15 stay out of reach)
    assert kv.lend(2, unit_blocks=4, lendable_units=3) == 2
    assert kv.num_lent_blocks == 8 and kv.num_free_blocks == 16 - 2 - 8
    b = make_req("b", 16, 1)
    kv.admit(b, b.max_num_tokens)
    kv.grow(b, 16)
    assert b.blocks == [2, 3, 12, 13]  # nobody gets a lent block
    kv.free(b)
    kv.take_back()
    assert kv.num_lent_blocks == 0 and kv.num_free_blocks == 14
    # a unit with a block in use stops the run: running requests keep their blocks
    c = make_req("c", 44, 1)
    kv.admit(c, c.max_num_tokens)
    kv.grow(c, 44)  # blocks 2..12: unit 2 (blocks 8..11) is in use
    assert kv.lend(3, unit_blocks=4, lendable_units=3) == 0
    kv.free(c)
    assert kv.lend(3, unit_blocks=4, lendable_units=3) == 2  # unit 0 holds a's blocks
    assert kv.lend(1, unit_blocks=4, lendable_units=3) == 2  # what is lent stays lent


def test_lending_respects_reservations_and_evicts_cached_blocks():
    kv = KVCacheManager(num_blocks=12, block_size=2, max_num_seqs=4)
    r = make_req("r", 2, 14)  # reserves 8 blocks, holds 1 once grown
    kv.admit(r, r.max_num_tokens)
    kv.grow(r, 2)
    assert kv.num_unreserved_blocks == 4
    assert kv.lend(3, unit_blocks=2, lendable_units=6) == 2  # 4 unreserved blocks: 2 units
    kv.take_back()
    kv.free(r)
    p = make_req("p", 22, 1)  # 11 full blocks, all cached once it ends
    kv.admit(p, p.max_num_tokens)
    kv.grow(p, 22)
    kv.cache_blocks(p, 22)
    kv.free(p)
    assert len(kv.cached_prefix(make_req("q", 24, 1))) == 11
    assert kv.lend(1, unit_blocks=2, lendable_units=6) == 1  # blocks 10, 11: 10 evicted
    assert len(kv.cached_prefix(make_req("q", 24, 1))) == 10
