"""Scheduling policies on hand-built pools, and preemption on the real model."""
from __future__ import annotations

import random

import pytest

from engine_actors.kv_cache import KVCacheManager
from engine_actors.policies import Budget, DeadlineAware, make_policy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import Scheduler
from tests.engine_harness import InProcessEngine, hf_greedy
from tests.fake_runner import FakeRunner, expected_output


def make(policy, num_blocks=64, block_size=4, max_batch=4, max_tokens=64):
    kv = KVCacheManager(num_blocks, block_size, max_batch * 2)
    return Scheduler(kv, make_policy(policy), Budget(max_batch, max_tokens), 4096, {198})


BATCH = 1  # a background batch's priority; interactive requests have 0 (lower runs first)


def req(rid, prompt_len, max_tokens, t=0.0, priority=0, deadline=float("inf"), token=1):
    return Request(rid, [token] * prompt_len, SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True), t,
                   priority=priority, deadline=deadline)


def drain(sched, runner, outs, now=0.0, limit=10_000):
    for _ in range(limit):
        if not sched.pool:
            return
        step(sched, runner, outs, now)
    raise AssertionError("requests left over: no progress")


def step(sched, runner, outs, now=0.0):
    for out in sched.expire(now):
        outs[out.request_id + ":finish"] = out.finish_reason
    batch = sched.schedule()
    if batch is None:
        return None
    for out in sched.process(batch, runner.execute(batch.step)):
        outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finish_reason:
            outs[out.request_id + ":finish"] = out.finish_reason
    return batch


def order(policy, pool, budget):
    """The policy's order of `pool`, given as the scheduler gives it: the admitted requests,
    and the waiting ones sorted by the policy's key."""
    ready = [r for r in pool if r.is_admitted]
    waiting = sorted((r for r in pool if not r.is_admitted), key=policy.key)
    return [r.request_id for r in policy.order(ready, waiting, budget)]


def ids(batch):
    return [s.request.request_id for s in batch.scheduled]


def test_priority_arrival_takes_a_full_batch_at_the_next_iteration():
    sched, runner, outs = make("priority", max_batch=2), FakeRunner(4), {}
    sched.add(req("low1", 3, 30, t=0, priority=BATCH, token=2))
    sched.add(req("low2", 3, 30, t=1, priority=BATCH, token=3))
    assert ids(step(sched, runner, outs)) == ["low1", "low2"]
    sched.add(req("chat", 3, 5, t=2, token=4))
    assert ids(step(sched, runner, outs)) == ["chat", "low1"]  # low2 sits this one out
    drain(sched, runner, outs)
    for rid, n, tok in [("low1", 30, 2), ("low2", 30, 3), ("chat", 5, 4)]:
        assert outs[rid] == expected_output([tok] * 3, n)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_lower_priority_values_start_first_as_in_vllm(policy):
    """vLLM's convention: a lower `priority` runs first, arrival order within one value."""
    sched, runner, outs = make(policy, max_batch=1), FakeRunner(4), {}
    for rid, t, priority in [("batch", 0, BATCH), ("plain", 1, 0), ("urgent", 2, -5),
                             ("plain2", 3, 0)]:
        sched.add(req(rid, 3, 2, t=t, priority=priority))
    started = []
    while sched.pool:
        started += [r for r in ids(step(sched, runner, outs)) if r not in started]
    assert started == ["urgent", "plain", "plain2", "batch"]


def test_fcfs_starts_a_waiting_interactive_request_before_waiting_batch_requests():
    """A background batch (priority 1) queued ahead must not hold an interactive request
    (0) for as long as the batch runs: it takes the first free row. The batch's running
    requests go on (they hold their reservations)."""
    sched, runner, outs = make("fcfs", max_batch=2), FakeRunner(4), {}
    for i in range(4):
        sched.add(req(f"batch{i}", 3, 4 + i, t=i, priority=BATCH, token=2))
    assert ids(step(sched, runner, outs)) == ["batch0", "batch1"]
    sched.add(req("chat", 3, 5, t=9, token=4))
    started = []
    while "chat" not in started:
        started += [r for r in ids(step(sched, runner, outs)) if r not in started]
    assert started == ["batch0", "batch1", "chat"]  # the first row freed goes to it
    assert "batch0:finish" in outs and "batch2" not in outs
    drain(sched, runner, outs)
    assert outs["chat"] == expected_output([4] * 3, 5)


def test_fcfs_keeps_running_batch_requests_going_beside_an_interactive_prefill():
    """Once started, priority no longer orders: a long interactive prompt is prefilled in
    chunks beside the running batch requests' decodes, never instead of them."""
    sched, runner, outs = make("fcfs", num_blocks=512, max_batch=8, max_tokens=16), \
        FakeRunner(4), {}
    for i in range(3):
        sched.add(req(f"b{i}", 4, 200, t=i, priority=BATCH, token=2))
    for _ in range(3):
        step(sched, runner, outs)
    sched.add(req("chat", 160, 4, t=10, token=3))
    for _ in range(6):
        batch = step(sched, runner, outs)
        assert {"b0", "b1", "b2"} <= set(ids(batch)), ids(batch)
    assert "chat" in ids(batch)


def test_priority_arrival_preempts_the_latest_low_priority_request_when_kv_is_full():
    # 12 blocks of 4 tokens; two low-priority requests grow until the pool is full
    sched, runner, outs = make("priority", num_blocks=12, max_batch=4), FakeRunner(4), {}
    sched.add(req("low1", 8, 30, t=0, priority=BATCH, token=2))
    sched.add(req("low2", 8, 30, t=1, priority=BATCH, token=3))
    for _ in range(16):  # 8 + 16 tokens each: 6 blocks each, all 12 taken
        step(sched, runner, outs)
    assert sched.kv.num_free_blocks == 0
    sched.add(req("chat", 4, 3, t=2, token=4))
    batch = step(sched, runner, outs)
    assert "chat" in ids(batch) and "low2" not in ids(batch)
    assert sched.num_preemptions == 1 and sched.pool["low2"].num_computed_tokens == 0
    drain(sched, runner, outs)
    assert outs["chat"] == expected_output([4] * 4, 3)
    assert outs["low2"] == expected_output([3] * 8, 30)  # recomputed, same tokens
    assert outs["low1"] == expected_output([2] * 8, 30)
    assert sched.kv.num_free_blocks == 12


def test_das_splits_candidates_as_tcb_algorithm_1():
    """Lengths (prompt + max_tokens) give utilities; the budget fits the first s by utility.
    eta = q = 0.5: the first eta*s are taken by utility, then those with utility >=
    q * mean(first share) by deadline, then the rest."""
    das = DeadlineAware(eta=0.5)
    pool = [req("u1", 4, 1, deadline=90), req("u2", 5, 1, deadline=80),  # utility 1/5, 1/6
            req("d_late", 7, 1, deadline=50), req("d_early", 8, 1, deadline=10),  # 1/8, 1/9
            req("low", 30, 1, deadline=1)]  # 1/31: below q * mean, despite its deadline
    # budget 4+5+7+8 = 24 fits the first s = 4 by utility; p = eta * s = 2 -> u1, u2
    assert order(das, pool, Budget(8, 24)) == ["u1", "u2", "d_early", "d_late", "low"]
    # running requests continue first, whatever their utility
    started = req("running", 50, 10)
    started.row = 0
    assert order(das, pool + [started], Budget(8, 25))[0] == "running"


def test_das_takes_everything_when_it_all_fits():
    das = DeadlineAware()
    pool = [req("a", 10, 1, deadline=5), req("b", 2, 1, deadline=1)]
    assert set(order(das, pool, Budget(8, 100))) == {"a", "b"}


def test_sjf_and_edf_orders():
    pool = [req("long_early_deadline", 20, 1, t=0, deadline=5),
            req("short_late_deadline", 2, 1, t=1, deadline=50),
            req("mid_no_deadline", 8, 1, t=2)]
    sjf = order(make_policy("sjf"), pool, Budget(8, 100))
    edf = order(make_policy("edf"), pool, Budget(8, 100))
    assert sjf == ["short_late_deadline", "mid_no_deadline", "long_early_deadline"]
    assert edf == ["long_early_deadline", "short_late_deadline", "mid_no_deadline"]


@pytest.mark.parametrize("policy", ["fcfs", "das", "edf"])
def test_deadline_missed_before_start_finishes_it_and_frees_kv(policy):
    sched, runner, outs = make(policy, num_blocks=8, max_batch=1), FakeRunner(4), {}
    sched.add(req("running", 4, 20, t=0, deadline=1.0))  # started in time, runs past it
    step(sched, runner, outs, now=0.0)
    sched.add(req("late", 4, 5, t=0.5, deadline=2.0))  # cannot start: batch of one is full
    for now in [1.0, 1.5, 2.5]:
        step(sched, runner, outs, now)
    assert outs["late:finish"] == "deadline" and "late" not in sched.pool
    drain(sched, runner, outs, now=3.0)
    assert outs["running:finish"] == "length" and len(outs["running"]) == 20
    assert sched.kv.num_free_blocks == 8 and sched.kv.num_free_rows == sched.kv.max_num_seqs


@pytest.mark.parametrize("policy", ["fcfs", "priority", "das", "sjf", "edf"])
def test_chunked_prefill_keeps_decodes_going_within_the_token_budget(policy):
    sched, runner, outs = make(policy, max_tokens=8), FakeRunner(4), {}
    sched.add(req("dec", 3, 20, t=0))
    step(sched, runner, outs)
    sched.add(req("long", 29, 2, t=1, priority=BATCH))
    while "long" not in outs:
        batch = step(sched, runner, outs)
        assert batch.step.num_tokens <= 8 and "dec" in ids(batch)
    drain(sched, runner, outs)
    assert outs["long"] == expected_output([1] * 29, 2)


@pytest.mark.parametrize("policy", ["priority", "sjf", "das", "edf"])
def test_random_workloads_never_deadlock_and_keep_outputs(policy):
    rng = random.Random(3)
    sched, runner, outs = make(policy, num_blocks=30, max_batch=5, max_tokens=24), \
        FakeRunner(4), {}
    expected = {}
    for i in range(80):
        if rng.random() < 0.5:
            prompt = [rng.randint(1, 190) for _ in range(rng.randint(1, 40))]
            n = rng.randint(1, 30)
            sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                              float(i), priority=rng.randint(0, 2),
                              deadline=float(i) + rng.choice([5, 1e9])))
            expected[f"r{i}"] = expected_output(prompt, n)
        step(sched, runner, outs, now=float(i))
        assert sched.kv.num_free_blocks >= sched.kv.num_reserved_blocks
    drain(sched, runner, outs, now=100.0)
    for rid, tokens in expected.items():
        if outs.get(rid + ":finish") == "deadline":
            continue
        assert outs[rid] == tokens, rid
    assert sched.kv.num_free_blocks == 30


def test_preemption_keeps_greedy_and_seeded_outputs_identical():
    """A KV pool far too small for the load: requests are preempted and recomputed, and
    produce exactly what they produce with room to spare (greedy: transformers' tokens)."""
    rng = random.Random(11)
    requests = []
    for i in range(10):
        prompt = [rng.randrange(256) for _ in range(rng.randint(5, 40))]
        greedy = i % 2 == 0
        sampling = SamplingParams(max_tokens=rng.randint(10, 30),
                                  temperature=0.0 if greedy else 0.9,
                                  seed=None if greedy else 100 + i, ignore_eos=True)
        requests.append((f"r{i}", prompt, sampling))
    arrivals = {0: requests[:5], 3: requests[5:]}
    tight = InProcessEngine(model="tiny-random-llama", scheduling_policy="priority",
                            max_batch_size=6, max_num_tokens=192, block_size=4)
    roomy = InProcessEngine(model="tiny-random-llama", scheduling_policy="priority",
                            max_batch_size=6, max_num_tokens=4096, block_size=4)
    out_tight, out_roomy = tight.run(arrivals), roomy.run(arrivals)
    assert tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    assert out_tight == out_roomy
    from engine_actors.checkpoint import resolve_model_path
    path = resolve_model_path("tiny-random-llama")
    for rid, prompt, sampling in requests:
        if sampling.temperature == 0.0:
            assert out_tight[rid] == hf_greedy(path, prompt, sampling.max_tokens)


def test_das_split_applies_when_batch_slots_bind_before_tokens():
    """With two slots, the share by deadline takes the urgent request (not pure utility)."""
    pool = [req("u1", 10, 10, deadline=9.0), req("u2", 11, 11, deadline=9.0),
            req("urgent", 12, 12, deadline=0.1)]
    das = DeadlineAware(eta=0.5)
    sel = das.select([], sorted(pool, key=das.key), [], KVCacheManager(64, 4, 8), Budget(2, 256))
    assert [s.request.request_id for s in sel.batch] == ["u1", "urgent"]


def test_a_request_preempted_after_starting_is_not_expired():
    sched, runner, outs = make("priority", num_blocks=4, max_batch=4), FakeRunner(4), {}
    sched.add(req("low", 8, 8, t=0.0, priority=BATCH, deadline=1.0))  # must start by t=1
    step(sched, runner, outs, now=0.0)  # it starts
    sched.add(req("chat", 12, 4, t=0.5, token=2))
    step(sched, runner, outs, now=0.5)  # chat needs 3 blocks: low is preempted
    assert sched.num_preemptions == 1
    assert sched.expire(now=1.5) == []  # low started in time: it finishes normally
    drain(sched, runner, outs, now=2.0)
    assert outs["low:finish"] == "length" and outs["low"] == expected_output([1] * 8, 8)


def test_preemption_happens_only_when_it_makes_room():
    """h2 needs 5 blocks; l1's 2 plus the 2 free are not enough and h0 outranks h2: nobody
    is preempted (before, l1 lost its work every other iteration for nothing)."""
    sched, runner, outs = make("priority", num_blocks=8, max_batch=4), FakeRunner(4), {}
    sched.add(req("h0", 16, 8, t=0.0))
    sched.add(req("l1", 8, 8, t=1.0, priority=BATCH, token=2))
    step(sched, runner, outs, now=0.0)  # h0 holds 4 blocks, l1 2: 2 free
    sched.add(req("h2", 20, 4, t=2.0, token=3))
    batch = step(sched, runner, outs, now=2.0)
    assert ids(batch) == ["h0", "l1"] and sched.num_preemptions == 0
    assert not sched.pool["h2"].is_admitted
    drain(sched, runner, outs, now=10.0)
    assert outs["l1"] == expected_output([2] * 8, 8)
    assert outs["h2"] == expected_output([3] * 20, 4)


def test_fcfs_grows_requests_without_max_tokens_and_preempts_the_latest_of_them():
    """A request that gave max_tokens reserves it (ORCA); one that did not (a chat's
    default) grows, and is the one preempted when KV runs out."""
    sched, runner, outs = make("fcfs", num_blocks=16, block_size=4, max_batch=8), \
        FakeRunner(4), {}

    def chat(rid, t, token):
        return Request(rid, [token] * 8, SamplingParams(max_tokens=40, ignore_eos=True,
                                                         max_tokens_given=False), t)

    sched.add(req("given", 8, 8, t=0.0))  # reserves 4 blocks for 16 tokens
    for i in range(3):
        sched.add(chat(f"chat{i}", 1.0 + i, token=2 + i))
    step(sched, runner, outs)
    assert sched.num_running == 4  # a full reservation each would have fitted only 1 chat
    assert sched.pool["chat0"].num_reserved_blocks == 0
    drain(sched, runner, outs)
    assert sched.num_preemptions > 0
    assert sched.pool == {} and outs["given"] == expected_output([1] * 8, 8)
    for i in range(3):
        assert outs[f"chat{i}"] == expected_output([2 + i] * 8, 40)


def test_fcfs_running_request_that_cannot_grow_does_not_block_the_others():
    """The earliest chat needs a block while reserved requests hold the pool: they keep
    running (and free it), instead of the whole iteration stopping at the chat."""
    sched, runner, outs = make("fcfs", num_blocks=6, block_size=4, max_batch=4), \
        FakeRunner(4), {}
    sched.add(Request("chat", [5] * 4, SamplingParams(max_tokens=12, ignore_eos=True,
                                                      max_tokens_given=False), 0.0))
    sched.add(req("given", 4, 16, t=1.0, token=6))  # reserves 5 blocks: all but the chat's
    drain(sched, runner, outs)
    assert outs["chat"] == expected_output([5] * 4, 12)
    assert outs["given"] == expected_output([6] * 4, 16)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "das", "sjf", "edf"])
def test_a_policy_only_chooses_the_scheduler_alone_changes_kv(policy):
    """Policies plan on counts; the KV manager's state (free blocks, reservations, table
    rows, each request's blocks) is the same after select() as before, even when the plan
    admits, grows and preempts."""
    sched = make(policy, num_blocks=12, block_size=4, max_batch=3, max_tokens=16)
    runner = FakeRunner(4)
    for i in range(3):
        sched.add(req(f"old{i}", 6, 10, deadline=100.0))
    step(sched, runner, {})
    for i in range(3):
        sched.add(req(f"new{i}", 5, 4, t=1.0, priority=BATCH, deadline=1.5))
    kv = sched.kv

    def state():
        return (kv.num_free_blocks, kv.num_reserved_blocks, kv.num_free_rows,
                {r.request_id: (r.row, list(r.blocks), r.num_reserved_blocks)
                 for r in sched.pool.values()})

    before = state()
    ready = [r for r in sched.admitted.values() if sched.is_ready(r)]
    selection = sched.policy.select(ready, sched.waiting, list(sched.admitted.values()), kv,
                                    sched.budget, sched.loras)
    assert selection.batch  # it planned something
    assert state() == before


def test_requests_default_to_priority_0_and_background_batches_to_1():
    """vLLM's default for a request that gives none (0), and a batch after it (1)."""
    import asyncio
    import types

    from deployments.batch_protocol import BatchSubmit
    from deployments.completion_protocol import CompletionRequest
    from deployments.frontend import Frontend
    from deployments.openai_api import OpenAIRoutes
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL, EngineConfig

    class Client:  # what the routes submit to the engine
        sent = []

        async def submit(self, requests, wake_each_update):
            self.sent += requests
            return types.SimpleNamespace(close=lambda: None)
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    frontend.client = Client()
    info = types.SimpleNamespace(max_model_len=64, sampling_defaults={}, vocab_size=258,
                                 eos_token_ids=(1,))
    for fields in ({}, {"priority": None}, {"priority": -3}):
        req = CompletionRequest(prompt="ab", max_tokens=2, **fields)
        asyncio.run(OpenAIRoutes(frontend).submit("cmpl-x", req, [("ab", [97, 98])], 2, info,
                                                  False, 0.0))
    assert [r.priority for r in Client.sent] == [0, 0, -3]
    assert BatchSubmit.model_validate({"requests": [{"prompt": "x"}]}).priority == BATCH
