"""Where each ingress replica sent the prompts it routed, for data parallelism's routing
(deployments/engines.py): a prompt's prefix hashes, the same in every replica's process."""
from __future__ import annotations

import collections
import hashlib

from engine_actors.messages import EngineRequest

MAX_PREFIXES = 1 << 16  # prompts remembered, the oldest forgotten first


class PrefixOwners:
    """The engine each prompt went to last, by the chained hash of its whole blocks (one
    entry a prompt: a conversation's next turn holds the last turn's prompt whole), the
    least recently sent forgotten first. `recent`: what this replica routed since it last
    shared its routes with the others."""

    def __init__(self, block_size: int, capacity: int = MAX_PREFIXES):
        self.block_size, self.capacity = block_size, capacity
        self.owner: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.recent: list[tuple[int, int]] = []

    def hashes(self, r: EngineRequest) -> list[int]:
        """The prefix hash at each whole block (the same in every replica's process)."""
        ids, size = r.prompt_token_ids, self.block_size
        seed = hashlib.blake2b(f"{r.lora_name}\0{r.cache_salt}".encode(), digest_size=8)
        h, out = int.from_bytes(seed.digest(), "little"), []  # (their KV is cached apart)
        for start in range(0, len(ids) - size + 1, size):
            h = hash((h, *ids[start:start + size]))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> int | None:
        """The engine of the longest earlier prompt these hashes begin with (None: none)."""
        for h in reversed(hashes):
            rank = self.owner.get(h)
            if rank is not None:
                return rank
        return None

    def record(self, hashes: list[int], rank: int) -> None:
        if hashes:
            self.learn([(hashes[-1], rank)])
            self.recent.append((hashes[-1], rank))
            del self.recent[:-self.capacity]

    def learn(self, entries: list[tuple[int, int]]) -> None:
        for h, rank in entries:
            self.owner[h] = rank
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
