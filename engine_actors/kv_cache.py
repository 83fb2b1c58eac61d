"""KV cache bookkeeping on the scheduler: blocks of token slots, reservations, table rows.

Only `Scheduler` calls the mutating methods (admit, grow, free); policies read the counts.

The workers hold the actual key/value tensors, a pool of `num_blocks * block_size` token
slots per layer. This class only decides which block ids each request owns; the workers
mirror each request's block list in a block table (one row per admitted request), updated
by the deltas in every step message. With `block_size=1` this is a token-level pool
(FineInfer's TokenAttention); larger blocks make the per-step deltas smaller.

Blocks live in a BlockPool (block_pool.py): with prefix caching, full blocks of a prompt
that was computed before are reused instead of recomputed.

Invariants:
- every block is free, cached and unreferenced, or referenced by the admitted requests
  that hold it (several, for a shared cached prefix); only full blocks are shared;
- num_free_blocks >= num_reserved_blocks, so a reservation can always be honoured (ORCA's
  guarantee that the scheduler never deadlocks on KV space).
"""
from __future__ import annotations

import logging

from engine_actors.block_pool import BlockPool, block_hash
from engine_actors.request import Request

logger = logging.getLogger("orca_serve.scheduler")


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1 or max_num_seqs < 1:
            raise ValueError("num_blocks, block_size and max_num_seqs must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.pool = BlockPool(num_blocks, prefix_caching)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_reserved_blocks = 0  # ORCA's n_rsrv, in blocks not yet allocated
        self.num_queried_tokens = self.num_hit_tokens = 0  # prefix cache, at admissions

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be given out (cached ones nobody uses included)."""
        return self.pool.num_available

    @property
    def num_unreserved_blocks(self) -> int:
        """Free blocks that no reservation has claimed."""
        return self.pool.num_available - self.num_reserved_blocks

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def usage(self) -> float:
        """The share of blocks requests hold (lent and free ones are not in use)."""
        return 1.0 - (self.pool.num_available + self.pool.num_lent) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, req: Request) -> bool:
        return self.blocks_for(req.max_num_tokens) <= self.num_blocks

    # ---- prefix caching ------------------------------------------------------------------
    def cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding the start of `req`'s tokens, as far as a hit may cover
        (Request.num_cacheable_tokens)."""
        if not self.pool.caching or req.num_cacheable_tokens < self.block_size:
            return []
        n = req.num_cacheable_tokens // self.block_size
        return self.pool.lookup(self._hashes(req, n)[:n])

    def num_taken(self, hits: list[int], gone: list[Request], pinned: set[int]) -> int:
        """Available blocks that reusing `hits` takes once the `gone` requests are preempted:
        hits nobody else holds then (they were cached and unreferenced), except those the
        `pinned` hits of earlier picks took already. Conservative where it cannot tell."""
        held_by_gone: dict[int, int] = {}
        for r in gone:
            for b in r.blocks:
                held_by_gone[b] = held_by_gone.get(b, 0) + 1
        return sum(1 for b in hits if b not in pinned
                   and self.pool.refs[b] == held_by_gone.get(b, 0))

    def num_freed_by(self, req: Request, pinned: set[int]) -> int:
        """Blocks (and reservation) that preempting `req` gives back: not those it shares
        with others, nor the `pinned` hits of earlier picks."""
        return req.num_reserved_blocks + sum(
            1 for b in req.blocks if self.pool.refs[b] == 1 and b not in pinned)

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """The first num_tokens tokens of `req` are in the KV cache: register its full
        blocks among them for reuse."""
        full = min(num_tokens, req.num_tokens) // self.block_size
        if not self.pool.caching or full <= req.num_registered_blocks:
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_registered_blocks, min(full, len(req.blocks))):
            self.pool.register(req.blocks[i], hashes[i])
        req.num_registered_blocks = full

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of at least `req`'s first num_blocks full blocks (kept on the
        request: its tokens only grow)."""
        hashes, size = req.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else b"",
                                     req.token_ids[i * size:(i + 1) * size], req.cache_salt))
        return hashes

    # ---- admission, growth, release -----------------------------------------------------
    def admit(self, req: Request, num_reserved_tokens: int, cached: list[int] = ()) -> None:
        """Give `req` a table row, the cached blocks of its prefix, and a reservation for
        the rest of `num_reserved_tokens` tokens."""
        assert not req.is_admitted, req.request_id
        need = max(0, self.blocks_for(num_reserved_tokens) - len(cached))
        taken = self.pool.num_evictable(list(cached))
        if not self._free_rows or need + taken > self.num_unreserved_blocks:
            raise RuntimeError(f"cannot admit {req.request_id}: no row or blocks left")
        req.row = self._free_rows.pop()
        self.pool.acquire(list(cached))
        req.blocks = list(cached)
        req.num_registered_blocks = len(cached)
        req.num_reserved_blocks = need
        self.num_reserved_blocks += need
        if self.pool.caching:
            self.num_queried_tokens += req.num_tokens
            self.num_hit_tokens += len(cached) * self.block_size

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(req.blocks))

    def grow(self, req: Request, num_tokens: int) -> list[int]:
        """Allocate blocks so `req` can hold `num_tokens` tokens; returns the new block ids.

        Blocks come out of the request's own reservation first, then from unreserved ones.
        """
        assert req.is_admitted, req.request_id
        need = self.num_new_blocks(req, num_tokens)
        from_reservation = min(need, req.num_reserved_blocks)
        if need - from_reservation > self.num_unreserved_blocks:
            raise RuntimeError(f"out of KV blocks growing {req.request_id} to {num_tokens} tokens")
        req.num_reserved_blocks -= from_reservation
        self.num_reserved_blocks -= from_reservation
        new = self.pool.take(need)
        req.blocks.extend(new)
        return new

    def free(self, req: Request) -> None:
        """Return every block, reservation and the row of `req` (idempotent); its full
        blocks stay cached."""
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_blocks_sent = req.num_registered_blocks = 0
        self.num_reserved_blocks -= req.num_reserved_blocks
        req.num_reserved_blocks = 0
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1


    # ---- fine-tuning borrows memory -------------------------------------------------------
    def can_lend(self, units: int, unit_blocks: int, lendable_units: int) -> int:
        """How many of the last `lendable_units` units of `unit_blocks` blocks could be lent
        now, up to `units` in all (those lent already included): unreferenced from the end
        down and not promised to a reservation. Running requests keep every block."""
        have = self.pool.num_lent // unit_blocks
        spare = self.num_unreserved_blocks
        want = have
        while want < min(units, lendable_units):
            first = (lendable_units - want - 1) * unit_blocks
            if any(self.pool.refs[first:first + unit_blocks]) or spare < unit_blocks:
                break
            want += 1
            spare -= unit_blocks
        return want

    def lend(self, units: int, unit_blocks: int, lendable_units: int) -> int:
        """Lend fine-tuning as many as `can_lend` of those units (the workers free their
        memory, kv_memory.py; cached blocks among them are evicted). Returns the units
        lent in all."""
        have = self.pool.num_lent // unit_blocks
        want = self.can_lend(units, unit_blocks, lendable_units)
        if want > have:
            self.pool.lend((lendable_units - want) * unit_blocks,
                           (lendable_units - have) * unit_blocks)
        return want

    def take_back(self) -> None:
        """The lent blocks are free again (the workers map their memory before their next
        step)."""
        self.pool.take_back()

    @property
    def num_lent_blocks(self) -> int:
        return self.pool.num_lent


def context_len(model_len: int, explicit: int | None, kv_capacity: int) -> int:
    """The longest prompt + completion: a context longer than the KV pool could never be
    used, so it is capped (an explicit max_model_len over it is refused, as vLLM refuses to
    start in that case)."""
    if explicit is not None and explicit > kv_capacity:
        raise ValueError(f"max_model_len {explicit} exceeds the KV cache capacity of "
                         f"{kv_capacity} tokens; lower it or raise max_num_tokens")
    limit = explicit or model_len
    if kv_capacity < limit:
        logger.warning("max_model_len capped from %d to the KV cache capacity, %d tokens",
                       limit, kv_capacity)
    return min(limit, kv_capacity)
