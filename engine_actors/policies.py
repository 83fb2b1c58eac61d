"""Batch selection policies: which requests run in the next iteration, and how many tokens each.

A policy sees the requests that can run now, in arrival order, the KV manager and the
iteration's budget, and returns the batch. It admits the requests it starts (a table row
plus its KV reservation); the scheduler then allocates their blocks and builds the step
message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from engine_actors.kv_cache import KVCacheManager
from engine_actors.request import Request


@dataclass(slots=True)
class Budget:
    max_num_requests: int
    max_num_tokens: int


@dataclass(slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # new tokens this iteration: a prompt chunk, or 1 for a decode


class Policy(Protocol):
    def select(self, pool: Iterable[Request], kv: KVCacheManager, budget: Budget) -> list[Scheduled]:
        ...


class FCFS:
    """ORCA Algorithm 1: arrival order; KV for max_tokens reserved when a request first starts.

    Requests already started always come before later arrivals, so an earlier request has
    run at least as many iterations as a later one (iteration-level FCFS). Selection stops at
    the first request that does not fit, never skipping ahead of it. A prompt larger than
    the token budget is prefilled in chunks over several iterations.
    """

    def select(self, pool: Iterable[Request], kv: KVCacheManager, budget: Budget) -> list[Scheduled]:
        batch: list[Scheduled] = []
        tokens_left = budget.max_num_tokens
        for req in pool:
            if len(batch) == budget.max_num_requests or tokens_left == 0:
                break
            if not req.is_admitted:
                need = kv.blocks_for(req.max_num_tokens)
                if kv.num_free_rows == 0 or need > kv.num_unreserved_blocks:
                    break
                kv.admit(req, req.max_num_tokens)
            num_tokens = min(req.num_new_tokens, tokens_left)
            batch.append(Scheduled(req, num_tokens))
            tokens_left -= num_tokens
        return batch


POLICIES = {"fcfs": FCFS}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling_policy {name!r}; known: {sorted(POLICIES)}") from None
