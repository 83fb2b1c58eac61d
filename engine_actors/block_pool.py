"""KV blocks with reference counts and automatic prefix caching.

A full block is known by a hash chained over its token ids and its parent block's hash (and
a salt, e.g. a LoRA adapter), so equal prefixes have equal hashes. Blocks of finished (or
preempted) requests stay cached, unreferenced, in least-recently-used order; they are reused
by any request whose prompt starts with the same tokens, and evicted, oldest first, only
when a new block is needed. A cached block is full, so nobody writes it again.
"""
from __future__ import annotations

import collections
import hashlib
import heapq
from array import array


def block_hash(parent: bytes, tokens: list[int], salt: str = "") -> bytes:
    """128-bit hash of a full block (the chain makes it identify the whole prefix)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(salt.encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True):
        self.caching = caching
        # uncached blocks, a heap: the lowest ids go first, so the highest stay free for
        # fine-tuning to borrow (lend)
        self._free = list(range(num_blocks))
        self._lent: list[int] = []
        # unreferenced cached blocks, least recently used first: block -> hash
        self._evictable: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._cached: dict[bytes, int] = {}  # hash -> block
        self._hash: dict[int, bytes] = {}  # block -> hash
        self.refs = [0] * num_blocks  # holders of each block

    @property
    def num_available(self) -> int:
        """Blocks that can be given out: free, or cached and unreferenced (evicted then)."""
        return len(self._free) + len(self._evictable)

    def take(self, n: int) -> list[int]:
        """n blocks for new tokens (referenced once); evicts the least recently used
        cached blocks when the free ones run out."""
        out = []
        for _ in range(n):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, h = self._evictable.popitem(last=False)
                del self._cached[h], self._hash[block]
            self.refs[block] = 1
            out.append(block)
        return out

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (nothing is taken)."""
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def lend(self, first: int, end: int) -> None:
        """Blocks first..end-1, all unreferenced (cached ones are evicted), leave the pool
        until `take_back`."""
        assert not any(self.refs[first:end]), "lending a block in use"
        for b in range(first, end):
            h = self._evictable.pop(b, None)
            if h is not None:
                del self._cached[h], self._hash[b]
        self._free = [b for b in self._free if not first <= b < end]
        heapq.heapify(self._free)
        self._lent.extend(range(first, end))

    def take_back(self) -> None:
        for b in self._lent:
            heapq.heappush(self._free, b)
        self._lent = []

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` are unreferenced (they leave the evictable ones if taken)."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, blocks: list[int]) -> None:
        """One more reference to cached blocks (a request reuses them)."""
        for b in blocks:
            self.refs[b] += 1
            self._evictable.pop(b, None)

    def release(self, blocks: list[int]) -> None:
        """One reference less; unreferenced blocks stay cached (if hashed) or become free.
        The last block of a request goes first: its prefix is the likelier to be reused."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                h = self._hash.get(b)
                if h is None:
                    heapq.heappush(self._free, b)
                else:
                    self._evictable[b] = h

    def forget_cached(self) -> None:
        """The workers were replaced: no block's KV exists now, so none is cached (a block
        still referenced becomes free when released)."""
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()
        self._cached.clear()
        self._hash.clear()

    def register(self, block: int, h: bytes) -> None:
        """`block` is full and its KV written: later prompts may reuse it."""
        if self.caching and h not in self._cached and block not in self._hash:
            self._cached[h] = block
            self._hash[block] = h
