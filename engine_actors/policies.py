"""Batch selection policies: which requests run in the next iteration, and how many tokens.

A policy only orders and chooses. It reads the KV manager's counts, plans on its own copy of
them, and returns the batch (each request with its number of new tokens: a prompt chunk, or
1 for a decode) and the admitted requests to preempt to make room. `Scheduler` applies the
plan: it is the only caller of the KV manager's mutating methods. The engine has no
policy-specific code.

Policies differ in four choices:
- `key`: which requests come first (the scheduler keeps its waiting list in this order);
- `reservation`: ORCA's reservation of prompt + max_tokens at admission (no preemption
  ever), or none: KV grown as needed, with preemption when it runs out;
- `victim`: which admitted request yields its KV (and is recomputed later);
- `outranks`: never preempt a request the policy prefers to the one that needs room.
"""
from __future__ import annotations

import abc
import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from engine_actors.kv_cache import KVCacheManager
from engine_actors.lora import LoRASlots
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
    hits: list[int] = field(default_factory=list)  # cached prefix blocks it starts from


@dataclass(slots=True)
class Selection:
    batch: list[Scheduled]
    preempt: list[Request]  # to free now, before the batch is admitted; recomputed later


class _Plan:
    """The policy's copy of the free KV blocks and rows while it picks a batch. Reused
    cached blocks count too: taking an unreferenced one uses up an available block."""

    def __init__(self, kv: KVCacheManager, loras: LoRASlots | None = None):
        self.kv = kv
        self.blocks = kv.num_unreserved_blocks
        self.rows = kv.num_free_rows
        self.pinned: set[int] = set()  # cached blocks that earlier picks reuse
        self.loras = loras
        self.adapters: set[int] = set()  # LoRA adapters (ids) that earlier picks start

    def has_adapter_slot(self, req: Request) -> bool:
        """A new request of a LoRA adapter needs its adapter in a slot (or a slot to load
        it into); one that cannot have it waits, without holding the others up."""
        return req.lora is None or req.is_admitted or self.loras.has_room_for(req.lora,
                                                                           self.adapters)

    def extra_blocks(self, item: Scheduled, reserve_tokens: int, gone: list[Request]) -> int:
        """Available blocks `item` takes (its reservation included) if `gone` are
        preempted first."""
        req, kv = item.request, self.kv
        if not req.is_admitted:
            end = len(item.hits) * kv.block_size + item.num_tokens
            new = max(kv.blocks_for(reserve_tokens), kv.blocks_for(end)) - len(item.hits)
            return new + kv.num_taken(item.hits, gone, self.pinned)
        need = kv.num_new_blocks(req, req.num_computed_tokens + item.num_tokens)
        return max(0, need - req.num_reserved_blocks)


class Policy(abc.ABC):
    """Greedy selection in `key` order, within the request and token budgets."""

    stop_at_first_misfit = False  # FCFS never lets a later request start before an earlier one

    @abc.abstractmethod
    def key(self, req: Request):
        """Sort key: smaller runs first. Must not change while a request waits."""

    def reservation(self, req: Request) -> int:
        """Tokens of KV to reserve when `req` is admitted (0: grow as needed)."""
        return 0

    def order(self, ready: list[Request], waiting: Sequence[Request],
              budget: Budget) -> Iterator[Request]:
        """Candidates, most wanted first: the ready admitted requests merged with the waiting
        list, which the scheduler keeps sorted by `key` (so this never scans it)."""
        return heapq.merge(sorted(ready, key=self.key), waiting, key=self.key)

    def victim(self, admitted: list[Request]) -> Request | None:
        """Which admitted request gives up its KV (None: none may): by default the latest
        arrival."""
        return max(admitted, key=lambda r: r.arrival)

    def outranks(self, a: Request, b: Request) -> bool:
        """Does the policy prefer `a` to `b`? Earlier arrivals win by default."""
        return a.arrival < b.arrival

    def select(self, ready: list[Request], waiting: Sequence[Request],
               admitted: Iterable[Request], kv: KVCacheManager, budget: Budget,
               loras: LoRASlots | None = None) -> Selection:
        """ready: admitted requests that can run now; waiting: not admitted, in key order;
        admitted: every request holding KV (the possible victims); loras: the adapter slots."""
        batch: list[Scheduled] = []
        preempt: list[Request] = []
        plan = _Plan(kv, loras)
        tokens_left = budget.max_num_tokens
        misfits = 0
        for req in self.order(ready, waiting, budget):
            if len(batch) == budget.max_num_requests or tokens_left == 0:
                break
            if any(req is p for p in preempt):
                continue  # gave its KV to an earlier pick of this iteration
            if not plan.has_adapter_slot(req):
                misfits += 1
                if misfits == MAX_MISFITS:
                    break
                continue
            # a new request starts after its cached prefix: only the rest is computed
            hits = [] if req.is_admitted else kv.cached_prefix(req)
            item = Scheduled(req, min(req.num_new_tokens - len(hits) * kv.block_size,
                                      tokens_left), hits)
            victims = self._make_room(item, plan, batch, preempt, admitted)
            if victims is None:
                misfits += 1
                # a full KV pool makes every later pick a failed preemption plan too: bound
                # the scan, or a long queue costs more than a GPU step. A running request
                # that cannot grow now must not hold the others up (they free KV it needs).
                if (self.stop_at_first_misfit and not req.is_admitted) \
                        or misfits == MAX_MISFITS:
                    break
                continue
            preempt.extend(victims)
            plan.pinned.update(hits)
            if req.lora is not None:
                plan.adapters.add(req.lora.id)
            batch.append(item)
            tokens_left -= item.num_tokens
        return Selection(batch, preempt)

    def _make_room(self, item: Scheduled, plan: _Plan, batch, preempt,
                   admitted) -> list[Request] | None:
        """Take blocks (and a row) for `item` from the plan, naming the fewest victims, in
        victim order, that make room; None if even all it outranks would not do. A request
        that reserves never preempts (ORCA). Nothing is freed here, so a failed plan costs
        no one their work."""
        req = item.request
        reserve = self.reservation(req) if not req.is_admitted else 0
        need = plan.extra_blocks(item, reserve, preempt)
        need_row = not req.is_admitted
        victims: list[Request] = []
        if reserve == 0 and (need > plan.blocks or (need_row and plan.rows == 0)):
            chosen = {id(s.request) for s in batch} | {id(req)} | {id(p) for p in preempt}
            candidates = [r for r in admitted if id(r) not in chosen]
            blocks, rows = plan.blocks, plan.rows
            while need > blocks or (need_row and rows == 0):
                victim = self.victim(candidates) if candidates else None
                if victim is None or self.outranks(victim, req):
                    return None  # never preempt a request this policy prefers
                candidates.remove(victim)
                victims.append(victim)
                blocks += plan.kv.num_freed_by(victim, plan.pinned)
                rows += 1
                need = plan.extra_blocks(item, reserve, preempt + victims)
            plan.blocks, plan.rows = blocks, rows
        if need > plan.blocks or (need_row and plan.rows == 0):
            return None
        plan.blocks -= need
        plan.rows -= need_row
        return victims


class FCFS(Policy):
    """ORCA Algorithm 1: arrival order; KV for prompt + max_tokens reserved when a request
    first starts, so no request ever waits for KV once started (and none is preempted).

    Started requests always come before later arrivals, so an earlier request has run at
    least as many iterations as a later one (iteration-level FCFS). Selection stops at the
    first request that does not fit, never skipping ahead of it. A prompt larger than the
    token budget is prefilled in chunks over several iterations.

    A request that did not give max_tokens (a chat's default: the rest of the context) would
    reserve a whole context and shrink concurrency: it grows its KV as it goes instead, and
    when KV runs out the latest-arrived such request is preempted and recomputed later, as
    vLLM does. Requests with reservations are never preempted.

    Of the waiting requests, arrival order is kept within a `priority` class (lower first,
    as vLLM orders them): a waiting interactive request (0) starts before waiting
    background-batch requests (1), which would otherwise hold it for as long as the batch
    runs. With one class (ORCA's setting) this is
    arrival order. Started requests still come first, whatever their class."""

    stop_at_first_misfit = True

    def key(self, req):  # (a request's priority counts only while it waits)
        if req.is_admitted:
            return (False, 0, req.arrival)
        return (True, req.priority, req.arrival)

    def reservation(self, req):
        return req.max_num_tokens if req.sampling.max_tokens_given else 0

    def victim(self, admitted):
        growing = [r for r in admitted if not r.sampling.max_tokens_given]
        return max(growing, key=lambda r: r.arrival) if growing else None


class PriorityPolicy(Policy):
    """FineInfer: interactive requests (`priority` 0) before submitted batches (1); a lower
    value runs first, as in vLLM's priority scheduling. Ties in arrival order. An arrival
    of a lower value runs at the next iteration even when the batch or the KV is full of
    higher-valued work: the latest request of the highest value is preempted and
    recomputed later."""

    def key(self, req):
        return (req.priority, req.arrival)

    def victim(self, admitted):
        return max(admitted, key=lambda r: (r.priority, r.arrival))

    def outranks(self, a, b):
        return (a.priority, a.arrival) < (b.priority, b.arrival)


class ShortestJobFirst(Policy):
    """Baseline: shortest prompt first (running requests keep going first)."""

    def key(self, req):
        return (not req.is_admitted, req.num_prompt_tokens, req.arrival)


class EarliestDeadlineFirst(Policy):
    """Baseline: earliest deadline first; requests without one come last, in arrival order."""

    def key(self, req):
        return (not req.is_admitted, req.deadline, req.arrival)


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

    def key(self, req):
        return (-req.utility, req.arrival)

    def order(self, ready, waiting, budget):
        running = sorted(ready, key=lambda r: r.arrival)
        tokens = budget.max_num_tokens - sum(r.num_new_tokens for r in running)
        slots = budget.max_num_requests - len(running)
        return itertools.chain(running, self._das(waiting, tokens, slots))

    def _das(self, by_utility: Sequence[Request], tokens: int, slots: int) -> list[Request]:
        s, total = 0, 0  # the first s requests by utility fill the iteration (tokens or slots)
        for r in by_utility:
            if s == slots or total + r.num_new_tokens > tokens:
                break
            total += r.num_new_tokens
            s += 1
        if s == len(by_utility):  # everything fits: nothing to choose
            return list(by_utility)
        p = max(1, int(self.eta * s))
        dominant, rest = by_utility[:p], by_utility[p:]
        mean = sum(r.utility for r in dominant) / len(dominant)
        aware = sorted((r for r in rest if r.utility >= self.q * mean),
                       key=lambda r: (r.deadline, r.arrival))
        chosen = {id(r) for r in aware}
        return [*dominant, *aware, *(r for r in rest if id(r) not in chosen)]


POLICIES = {"fcfs": FCFS, "priority": PriorityPolicy, "das": DeadlineAware,
            "sjf": ShortestJobFirst, "edf": EarliestDeadlineFirst}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling_policy {name!r}; known: {sorted(POLICIES)}") from None
