"""Automatic prefix caching in the KV manager and the scheduler, checked by a fake worker
that reads every token back from its KV slots (a wrong reused block gives a wrong answer).
The block pool alone: tests/test_block_pool.py."""
from __future__ import annotations

import random

import pytest

from engine_actors.kv_cache import KVCacheManager
from engine_actors.policies import FCFS, Budget, PriorityPolicy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import Scheduler
from tests.fake_runner import FakeRunner, expected_output

BS = 4


# ---- the KV manager ------------------------------------------------------------------------
def req(rid, prompt, max_tokens=4, t=0.0, **sampling):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     **sampling), t)


@pytest.mark.parametrize("prompt_len,expected_blocks", [(8, 1), (9, 2), (10, 2), (3, 0)])
def test_a_hit_never_covers_the_last_token(prompt_len, expected_blocks):
    kv = KVCacheManager(16, BS, 4)
    first = req("a", range(prompt_len + 4))
    kv.admit(first, 0)
    kv.grow(first, first.num_tokens)
    kv.cache_blocks(first, first.num_tokens)
    kv.free(first)
    assert len(kv.cached_prefix(req("b", range(prompt_len)))) == expected_blocks


def test_only_computed_full_blocks_are_registered():
    kv = KVCacheManager(16, BS, 4)
    a = req("a", range(11))
    kv.admit(a, 0)
    kv.grow(a, 11)
    kv.cache_blocks(a, 6)  # a first chunk of 6 tokens: one full block
    assert len(kv.cached_prefix(req("b", range(20)))) == 1
    kv.cache_blocks(a, 11)
    assert len(kv.cached_prefix(req("b", range(20)))) == 2


def test_prompt_logprobs_and_repetition_penalty_get_no_hits():
    kv = KVCacheManager(16, BS, 4)
    a = req("a", range(12))
    kv.admit(a, 0)
    kv.grow(a, 12)
    kv.cache_blocks(a, 12)
    assert len(kv.cached_prefix(req("b", range(12)))) == 2
    assert kv.cached_prefix(req("c", range(12), prompt_logprobs=0)) == []
    assert kv.cached_prefix(req("d", range(12), repetition_penalty=1.2)) == []
    # penalties on generated tokens: hits stop within the prompt
    grown = req("e", range(6), presence_penalty=0.5)
    grown.token_ids.extend(range(6, 12))  # 6 generated tokens (recomputed after preemption)
    assert len(kv.cached_prefix(grown)) == 1


# ---- the scheduler -------------------------------------------------------------------------
def make_scheduler(num_blocks=64, max_batch=4, budget=64, policy=None, caching=True):
    kv = KVCacheManager(num_blocks, BS, max_batch, prefix_caching=caching)
    return Scheduler(kv, policy or FCFS(), Budget(max_batch, budget), 512, set())


class Driver:
    """Runs the scheduler against the fake worker, collecting outputs."""

    def __init__(self, sched: Scheduler):
        self.sched, self.runner = sched, FakeRunner(BS)
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.batches = []
        self.admissions: list[tuple[str, int, int]] = []  # id, preemptions so far, context

    def step(self) -> bool:
        admitted = set(self.sched.admitted)
        batch = self.sched.schedule()
        if batch is None:
            return False
        self.batches.append(batch)
        self.admissions += [(s.request.request_id, epoch, ctx) for s, epoch, ctx in
                            zip(batch.scheduled, batch.epochs, batch.step.context_lens)
                            if s.request.request_id not in admitted]
        for out in self.sched.process(batch, self.runner.execute(batch.step)):
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                self.cached[out.request_id] = out.num_cached_tokens
        return True

    def drain(self) -> None:
        while self.step():
            pass

    def first_step_of(self, rid: str) -> tuple[int, int]:
        """(context, new tokens) of the first step that ran `rid`."""
        for b in self.batches:
            for i, s in enumerate(b.scheduled):
                if s.request.request_id == rid:
                    return b.step.context_lens[i], b.step.query_lens[i]
        raise AssertionError(f"{rid} never ran")


def test_shared_prefix_is_not_recomputed():
    d = Driver(make_scheduler())
    system = list(range(100, 117))  # 17 tokens: 4 full blocks and one token
    d.sched.add(req("a", system + [1, 2, 3], max_tokens=5))
    d.drain()
    d.sched.add(req("b", system + [4, 5, 6, 7, 8], max_tokens=5, t=1.0))
    d.sched.add(req("c", [9] + system, max_tokens=5, t=2.0))  # no common prefix
    d.drain()
    assert d.first_step_of("b") == (16, 6)  # only what follows the 4 cached blocks
    assert d.first_step_of("c") == (0, 18)
    assert d.cached == {"a": 0, "b": 16, "c": 0}
    for rid, prompt in [("a", system + [1, 2, 3]), ("b", system + [4, 5, 6, 7, 8]),
                        ("c", [9] + system)]:
        assert d.tokens[rid] == expected_output(prompt, 5), rid
    kv = d.sched.kv
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (20 + 22 + 18, 16)


def test_running_requests_share_blocks_and_each_keeps_its_own_tail():
    d = Driver(make_scheduler())
    prompt = list(range(1, 13))  # 3 full blocks
    d.sched.add(req("a", prompt, max_tokens=10))
    d.step()  # a's prompt is computed; its blocks are registered when the step returns
    d.sched.add(req("b", prompt, max_tokens=10, t=1.0))
    d.step()
    assert d.first_step_of("b") == (8, 4)  # the whole prompt but its last block
    a, b = (d.sched.pool[r] for r in "ab")
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert all(d.sched.kv.pool.refs[x] == 2 for x in a.blocks[:2])
    d.drain()
    assert d.tokens["a"] == d.tokens["b"] == expected_output(prompt, 10)
    assert d.sched.kv.num_free_blocks == d.sched.kv.num_blocks


def test_reservation_and_token_budget_count_only_what_is_computed():
    d = Driver(make_scheduler(num_blocks=12, budget=8))
    prompt = list(range(1, 22))  # 21 tokens
    d.sched.add(req("a", prompt, max_tokens=3))
    d.drain()
    # b needs 24 tokens of KV = 6 blocks, 5 of them cached: FCFS reserves 1 block, and its
    # 1 uncomputed prompt token + 2 decodes fit the token budget of 8 at once
    b = req("b", prompt, max_tokens=3, t=1.0)
    d.sched.add(b)
    d.step()
    assert d.first_step_of("b") == (20, 1)
    assert len(b.blocks) == 6
    d.drain()
    assert d.tokens["b"] == expected_output(prompt, 3)


def test_small_pool_evicts_and_preempted_request_hits_its_own_blocks():
    """Interactive arrivals preempt batch work in a pool too small for all; every answer
    stays exact, and the recomputed requests start from their own cached blocks."""
    rng = random.Random(5)
    d = Driver(make_scheduler(num_blocks=24, max_batch=4, budget=16, policy=PriorityPolicy()))
    system = [rng.randrange(50) for _ in range(10)]
    prompts = {}
    for i in range(12):
        rid = f"r{i}"
        prompts[rid] = system[:rng.choice([4, 5, 8, 10])] + [rng.randrange(50)
                                                            for _ in range(rng.randint(1, 9))]
        r = req(rid, prompts[rid], max_tokens=rng.randint(6, 20), t=float(i))
        r.priority = 0 if i % 3 == 2 else 1  # (one in three interactive)
        d.sched.add(r)
        d.step()
        d.step()
    d.drain()
    for rid, prompt in prompts.items():
        assert d.tokens[rid] == expected_output(prompt, len(d.tokens[rid])), rid
    assert d.sched.num_preemptions > 0
    assert d.sched.kv.num_hit_tokens > 0
    resumed = [ctx for _, epoch, ctx in d.admissions if epoch > 0]
    assert resumed and any(resumed), "no recomputed request found its own blocks"
    assert d.sched.kv.num_free_blocks == d.sched.kv.num_blocks


def test_caching_off_recomputes_everything():
    d = Driver(make_scheduler(caching=False))
    prompt = list(range(1, 18))
    d.sched.add(req("a", prompt))
    d.drain()
    d.sched.add(req("b", prompt, t=1.0))
    d.drain()
    assert d.first_step_of("b") == (0, 17)
    assert d.cached["b"] == 0 and d.sched.kv.num_queried_tokens == 0
    assert d.tokens["b"] == expected_output(prompt, 4)


@pytest.mark.parametrize("policy,grow", [("fcfs", False), ("fcfs", True), ("priority", False),
                                         ("das", False), ("sjf", False)])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_shared_prefix_workloads_stay_exact(policy, grow, overlap):
    """Prompts drawn from a few shared system prompts and growing conversations, a KV pool
    far too small, two steps in flight with overlap: answers stay exact, the block
    reference counts match the holders after every step, and nothing deadlocks."""
    from engine_actors.policies import make_policy
    rng = random.Random(f"{policy}{grow}{overlap}")
    sched = make_scheduler(num_blocks=28, max_batch=5, budget=20, policy=make_policy(policy))
    sched.allow_continuation = overlap
    runner, tokens, in_flight = FakeRunner(BS), {}, []
    systems = [[rng.randrange(190) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    history: list[list[int]] = []  # earlier prompts + answers: a conversation goes on
    expected = {}

    def step():
        while len(in_flight) < (2 if overlap else 1):
            batch = sched.schedule()
            if batch is None:
                break
            in_flight.append((batch, runner.execute(batch.step)))
        if not in_flight:
            return False
        batch, sampled = in_flight.pop(0)
        for out in sched.process(batch, sampled):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None and not out.request_id.startswith("x"):
                history.append(expected[out.request_id][0] + tokens[out.request_id])
        holders = {}
        for r in sched.admitted.values():
            for b in r.blocks:
                holders[b] = holders.get(b, 0) + 1
        assert all(sched.kv.pool.refs[b] == holders.get(b, 0) for b in range(28))
        assert sched.kv.num_free_blocks >= sched.kv.num_reserved_blocks
        return True

    for i in range(70):
        if rng.random() < 0.5:
            if history and rng.random() < 0.4:
                prompt = rng.choice(history)[:40] + [rng.randrange(190)]
            else:
                prompt = rng.choice(systems) + [rng.randrange(190)
                                                for _ in range(rng.randint(1, 12))]
            n = rng.randint(1, 16)
            sampling = SamplingParams(max_tokens=n, ignore_eos=True, max_tokens_given=not grow)
            sched.add(Request(f"r{i}", prompt, sampling, float(i), priority=rng.randint(0, 1)))
            expected[f"r{i}"] = (prompt, n)
        step()
    while sched.pool or in_flight:
        assert step(), "deadlock: work left, none scheduled"
    for rid, (prompt, n) in expected.items():
        assert tokens[rid] == expected_output(prompt, n), rid
    assert sched.kv.num_hit_tokens > 0
    assert sched.kv.num_free_blocks == 28 and sched.kv.num_reserved_blocks == 0
