"""KV cache bookkeeping on the scheduler: blocks of token slots, reservations, table rows.

Only `Scheduler` calls the mutating methods (admit, grow, free); policies read the counts.

The workers hold the actual key/value tensors, a pool of `num_blocks * block_size` token
slots per layer. This class only decides which block ids each request owns; the workers
mirror each request's block list in a block table (one row per admitted request), updated
by the deltas in every step message. With `block_size=1` this is a token-level pool
(FineInfer's TokenAttention); larger blocks make the per-step deltas smaller.

Invariants:
- every block is either free or owned by exactly one admitted request;
- num_free_blocks >= num_reserved_blocks, so a reservation can always be honoured (ORCA's
  guarantee that the scheduler never deadlocks on KV space).
"""
from __future__ import annotations

import logging

from engine_actors.request import Request

logger = logging.getLogger("orca_serve.scheduler")


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int):
        if num_blocks < 1 or block_size < 1 or max_num_seqs < 1:
            raise ValueError("num_blocks, block_size and max_num_seqs must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0 first
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_reserved_blocks = 0  # ORCA's n_rsrv, in blocks not yet allocated

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_unreserved_blocks(self) -> int:
        """Free blocks that no reservation has claimed."""
        return len(self._free_blocks) - self.num_reserved_blocks

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free_blocks) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, req: Request) -> bool:
        return self.blocks_for(req.max_num_tokens) <= self.num_blocks

    def admit(self, req: Request, num_reserved_tokens: int) -> None:
        """Give `req` a table row and reserve blocks for `num_reserved_tokens` tokens."""
        assert not req.is_admitted, req.request_id
        need = self.blocks_for(num_reserved_tokens)
        if not self._free_rows or need > self.num_unreserved_blocks:
            raise RuntimeError(f"cannot admit {req.request_id}: no row or blocks left")
        req.row = self._free_rows.pop()
        req.num_reserved_blocks = need
        self.num_reserved_blocks += need

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
        new = [self._free_blocks.pop() for _ in range(need)]
        req.blocks.extend(new)
        return new

    def free(self, req: Request) -> None:
        """Return every block, reservation and the row of `req` (idempotent)."""
        self._free_blocks.extend(reversed(req.blocks))
        req.blocks = []
        req.num_blocks_sent = 0
        self.num_reserved_blocks -= req.num_reserved_blocks
        req.num_reserved_blocks = 0
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1


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
