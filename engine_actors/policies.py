"""Batch selection policies: which requests run in the next iteration, and how many tokens.

A policy sees the requests that can run now, the KV manager, the iteration's budget and the
clock, and returns the batch: each request with its number of new tokens (a prompt chunk,
or 1 for a decode). It admits the requests it starts (a table row plus their KV, reserved in
full or grown step by step) and, when KV runs out, names the requests to preempt; the
scheduler applies all of it. The engine has no policy-specific code.

Policies differ in three choices:
- `order`: which requests come first;
- `reserve_full`: ORCA's reservation of prompt + max_tokens at admission (no preemption
  ever), or KV grown as needed, with preemption when it runs out;
- `victim`: which admitted request yields its KV (and is recomputed later).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable

from engine_actors.kv_cache import KVCacheManager
from engine_actors.request import Request


MAX_MISFITS = 16  # requests that do not fit, after which an iteration stops looking


@dataclass(slots=True)
class Budget:
    max_num_requests: int
    max_num_tokens: int


@dataclass(slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # new tokens this iteration: a prompt chunk, or 1 for a decode


@dataclass(slots=True)
class Selection:
    batch: list[Scheduled]
    preempt: list[Request]  # free their KV now; recomputed from scratch later


class Policy(abc.ABC):
    """Greedy selection in `order`, within the request and token budgets."""

    reserve_full = False
    stop_at_first_misfit = False  # FCFS never lets a later request pass an earlier one

    @abc.abstractmethod
    def order(self, ready: list[Request], now: float, budget: Budget) -> list[Request]:
        """The ready requests, most wanted first, for an iteration of this budget."""

    def victim(self, admitted: list[Request]) -> Request:
        """Which admitted request gives up its KV: by default the latest arrival."""
        return max(admitted, key=lambda r: r.arrival_time)

    def select(self, ready: Iterable[Request], kv: KVCacheManager, budget: Budget,
               now: float = 0.0, admitted: list[Request] | None = None) -> Selection:
        batch: list[Scheduled] = []
        preempt: list[Request] = []
        tokens_left = budget.max_num_tokens
        misfits = 0
        for req in self.order(list(ready), now, budget):
            if len(batch) == budget.max_num_requests or tokens_left == 0:
                break
            if any(req is p for p in preempt):
                continue  # gave its KV to an earlier pick of this iteration
            num_tokens = min(req.num_new_tokens, tokens_left)
            if not self._fit(req, num_tokens, kv, batch, preempt, admitted or []):
                misfits += 1
                # a full KV pool makes every later pick a failed preemption plan too: bound
                # the scan, or a long queue costs more than a GPU step
                if self.stop_at_first_misfit or misfits == MAX_MISFITS:
                    break
                continue
            batch.append(Scheduled(req, num_tokens))
            tokens_left -= num_tokens
        return Selection(batch, preempt)

    def _fit(self, req: Request, num_tokens: int, kv: KVCacheManager, batch: list[Scheduled],
             preempt: list[Request], admitted: list[Request]) -> bool:
        """Admit `req` if needed and make room for its next tokens, preempting if allowed."""
        if self.reserve_full:
            if req.is_admitted:
                return True
            if kv.num_free_rows == 0 or kv.blocks_for(req.max_num_tokens) > kv.num_unreserved_blocks:
                return False
            kv.admit(req, req.max_num_tokens)
            return True
        need = kv.num_new_blocks(req, req.num_computed_tokens + num_tokens)
        victims = self._plan_victims(req, need, kv, batch, preempt, admitted)
        if victims is None:
            return False  # not enough to take from requests it outranks: preempt nobody
        for victim in victims:
            preempt.append(victim)
            kv.free(victim)
        if not req.is_admitted:
            kv.admit(req, 0)
        kv.grow(req, req.num_computed_tokens + num_tokens)
        return True

    def _plan_victims(self, req, need, kv, batch, preempt, admitted) -> list[Request] | None:
        """The fewest requests, in victim order, whose KV makes room for `req` (blocks, and a
        row if it has none); None if even all it outranks would not do. Nothing is freed
        here, so a failed plan costs no one their work."""
        chosen = {id(s.request) for s in batch} | {id(req)}
        candidates = [r for r in admitted if id(r) not in chosen and r not in preempt]
        blocks, rows = kv.num_unreserved_blocks, kv.num_free_rows
        victims: list[Request] = []
        while (not req.is_admitted and rows == 0) or need > blocks:
            if not candidates:
                return None
            victim = self.victim(candidates)
            if self.outranks(victim, req):
                return None  # never preempt a request this policy prefers
            candidates.remove(victim)
            victims.append(victim)
            blocks += len(victim.blocks) + victim.num_reserved_blocks
            rows += 1
        return victims

    def outranks(self, a: Request, b: Request) -> bool:
        """Does the policy prefer `a` to `b`? Earlier arrivals win by default."""
        return a.arrival_time < b.arrival_time


class FCFS(Policy):
    """ORCA Algorithm 1: arrival order; KV for prompt + max_tokens reserved when a request
    first starts, so no request ever waits for KV once started (and none is preempted).

    Started requests always come before later arrivals, so an earlier request has run at
    least as many iterations as a later one (iteration-level FCFS). Selection stops at the
    first request that does not fit, never skipping ahead of it. A prompt larger than the
    token budget is prefilled in chunks over several iterations."""

    reserve_full = True
    stop_at_first_misfit = True

    def order(self, ready, now, budget):
        return sorted(ready, key=lambda r: r.arrival_time)


class PriorityPolicy(Policy):
    """FineInfer: interactive requests (high `priority`) before submitted batches (low).
    Ties in arrival order. A high-priority arrival runs at the next iteration even when the
    batch or the KV is full of low-priority work: the latest low-priority request is
    preempted and recomputed later."""

    def order(self, ready, now, budget):
        return sorted(ready, key=lambda r: (-r.priority, r.arrival_time))

    def victim(self, admitted):
        return min(admitted, key=lambda r: (r.priority, -r.arrival_time))

    def outranks(self, a, b):
        return (a.priority, -a.arrival_time) > (b.priority, -b.arrival_time)


class ShortestJobFirst(Policy):
    """Baseline: shortest prompt first (running requests keep going first)."""

    def order(self, ready, now, budget):
        return sorted(ready, key=lambda r: (not r.is_started, r.num_prompt_tokens,
                                            r.arrival_time))


class EarliestDeadlineFirst(Policy):
    """Baseline: earliest deadline first; requests without one come last, in arrival order."""

    def order(self, ready, now, budget):
        return sorted(ready, key=lambda r: (not r.is_started, r.deadline, r.arrival_time))


class DeadlineAware(Policy):
    """TCB's DAS (Algorithm 1), per iteration. Running requests continue first. The token
    budget left is filled from the waiting ones: sorted by utility 1/length (length = prompt
    + max_tokens), the s that fit the budget are split into a utility-dominant share (the
    first eta*s), then requests with utility >= q * (mean utility of that share) by earliest
    deadline, then the rest greedily. eta + q = 1."""

    def __init__(self, eta: float = 0.5):
        if not 0.0 < eta < 1.0:
            raise ValueError("DAS needs 0 < eta < 1")
        self.eta, self.q = eta, 1.0 - eta

    def order(self, ready, now, budget):
        running = sorted((r for r in ready if r.is_started), key=lambda r: r.arrival_time)
        waiting = sorted((r for r in ready if not r.is_started),
                         key=lambda r: (-r.utility, r.arrival_time))
        tokens = budget.max_num_tokens - sum(r.num_new_tokens for r in running)
        slots = budget.max_num_requests - len(running)
        return running + self._das(waiting, tokens, slots)

    def _das(self, by_utility: list[Request], tokens: int, slots: int) -> list[Request]:
        s, total = 0, 0  # the first s requests by utility fill the iteration (tokens or slots)
        for r in by_utility:
            if s == slots or total + r.num_new_tokens > tokens:
                break
            total += r.num_new_tokens
            s += 1
        if s == len(by_utility):  # everything fits: nothing to choose
            return by_utility
        p = max(1, int(self.eta * s))
        dominant, rest = by_utility[:p], by_utility[p:]
        mean = sum(r.utility for r in dominant) / len(dominant)
        aware = sorted((r for r in rest if r.utility >= self.q * mean),
                       key=lambda r: (r.deadline, r.arrival_time))
        chosen = {id(r) for r in aware}
        return dominant + aware + [r for r in rest if id(r) not in chosen]


POLICIES = {"fcfs": FCFS, "priority": PriorityPolicy, "das": DeadlineAware,
            "sjf": ShortestJobFirst, "edf": EarliestDeadlineFirst}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling_policy {name!r}; known: {sorted(POLICIES)}") from None
