"""Speculative decoding with n-gram drafts: the drafts, their verification by the scheduler
(against a stand-in model), and the engine's greedy tokens against transformers'."""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from engine_actors.checkpoint import save_random_llama
from engine_actors.config import ConfigError, EngineConfig, SpeculativeConfig
from engine_actors.kv_cache import KVCacheManager
from engine_actors.messages import StepResult
from engine_actors.metrics import EngineMetrics
from engine_actors.policies import Budget, make_policy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import Scheduler
from engine_actors.speculative import Speculator
from tests.engine_harness import InProcessEngine, hf_greedy
from tests.fake_runner import FakeRunner, next_token

EOS = 198


def spec(k=4, lo=1, hi=3, **kw) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                                        prompt_lookup_max=hi, **kw))


def req(tokens, max_tokens=16, **sampling) -> Request:
    sampling.setdefault("ignore_eos", True)
    return Request("r", list(tokens), SamplingParams(max_tokens=max_tokens, **sampling), 0.0)


@pytest.mark.parametrize("tokens,expected", [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], [4, 9, 9]),  # the longest suffix, 3 tokens
    ([5, 6, 7, 5, 6, 8, 5, 6], [8, 5, 6]),  # the latest occurrence of it
    ([1, 2, 7, 3, 2, 8, 1, 2], [7, 3, 2]),  # a longer match before a later shorter one
    ([5, 256, 0, 9, 1], []),  # token 1's bytes inside 256, 0: not a match of whole tokens
    ([1, 7, 256, 0, 9, 1], [7, 256, 0]),  # ... the whole-token match before it is
    ([1, 2, 3, 4], []),  # nothing repeats
    ([3, 3], [3]),  # the draft stops at the last token
])
def test_draft_follows_latest_longest_match(tokens, expected):
    assert spec().propose(req(tokens), 3) == expected


def test_draft_length_and_lookup_bounds():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert spec().propose(req(tokens), 2) == [3, 4]
    assert spec(lo=3, hi=3).propose(req(tokens), 4) == []  # [7, 1, 2] does not repeat
    # the index of a request's tokens follows them as they grow
    r = req(tokens)
    s = spec()
    assert s.propose(r, 3) == [3, 4, 5]
    r.token_ids += [9, 1]
    assert s.propose(r, 3) == [2, 9, 1]


def test_requests_whose_state_moves_one_token_at_a_time_are_not_speculated():
    assert Speculator.can_speculate(req([1], temperature=0.7))
    assert Speculator.can_speculate(req([1], temperature=0.0, seed=3))
    assert Speculator.can_speculate(req([1], logprobs=2))
    for sampling in [dict(temperature=0.7, seed=3), dict(presence_penalty=0.5),
                     dict(min_tokens=2), dict(logit_bias=((3, 1.0),)),
                     dict(grammar=("json_object", ""))]:
        assert not Speculator.can_speculate(req([1], **sampling)), sampling


def test_acceptance_takes_the_samples_up_to_the_first_miss():
    s = spec(k=3)
    assert s.accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert s.accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert s.accept([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert (s.num_accepted_tokens, s.accepted_per_position) == (4, [2, 1, 1])


# ---- the scheduler against a stand-in model ------------------------------------------------

def repeating(seq):
    """Repeats the last 5 tokens: drafts are always right."""
    return seq[-5]


def mostly_repeating(seq):
    """Repeats, but every 7th position breaks the pattern: drafts are partly right."""
    return (seq[-1] + 1) % 199 if len(seq) % 7 == 0 else seq[-5]


def reference(model, prompt, max_tokens, stop=()):
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(model(seq))
        seq.append(out[-1])
        if out[-1] in stop:
            break
    return out


def run(sched, runner, requests):
    """Steps until every request ends: with continuation, two in flight (the next one is
    scheduled before the previous one's tokens are back), as in the engine loop."""
    for r in requests:
        sched.add(r)
    outputs, finish, steps = {r.request_id: [] for r in requests}, {}, 0
    in_flight = collections.deque()
    while sched.pool:
        while len(in_flight) < (2 if sched.allow_continuation else 1):
            batch = sched.schedule()
            if batch is None:
                break
            steps += 1
            in_flight.append((batch, runner.execute(batch.step)))
        assert steps < 1000, "no progress"
        batch, result = in_flight.popleft()
        for out in sched.process(batch, result):
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
    return outputs, finish, steps


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def continuation(request):
    return request.param


def make_scheduler(speculator=None, num_blocks=256, policy="fcfs", prefix_caching=False,
                   max_tokens=64, continuation=False):
    kv = KVCacheManager(num_blocks, 4, 16, prefix_caching)
    return Scheduler(kv, make_policy(policy), Budget(8, max_tokens), 1024, {EOS},
                     allow_continuation=continuation, speculator=speculator)


def workload(seed, n=8):
    """Requests with arrival times 0, 1, 2, ..."""
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(190) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True), float(i))
            for i in range(n)]


@pytest.mark.parametrize("model", [repeating, mostly_repeating, next_token])
def test_speculated_outputs_are_the_model_outputs(model, continuation):
    """Every request gets exactly the model's tokens, whether its drafts are all right
    (fewer steps), partly right or all wrong; the KV is all given back."""
    s = spec()
    sched = make_scheduler(s, continuation=continuation)
    outputs, finish, steps = run(sched, FakeRunner(4, model), workload(1))
    for r in workload(1):
        assert outputs[r.request_id] == reference(model, r.prompt_token_ids,
                                                  r.sampling.max_tokens), r.request_id
        assert finish[r.request_id] == "length"
    assert s.num_draft_tokens > 0
    _, _, plain_steps = run(make_scheduler(continuation=continuation), FakeRunner(4, model),
                            workload(1))
    if model is repeating:
        assert s.num_accepted_tokens == s.num_draft_tokens and steps < plain_steps / 2
    elif model is mostly_repeating:
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens and steps < plain_steps
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.kv.num_reserved_blocks == 0


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(continuation):
    prompt = [10, 11, EOS, 12, 13]  # repeated: EOS comes back as the 3rd token
    sched = make_scheduler(spec(), continuation=continuation)
    r = Request("r", prompt, SamplingParams(max_tokens=30), 0.0)
    stop = Request("s", [20, 21, 22, 23, 24], SamplingParams(max_tokens=30, stop_token_ids=(22,)),
                   0.0)
    outputs, finish, _ = run(sched, FakeRunner(4, repeating), [r, stop])
    assert outputs["r"] == [10, 11, EOS] and finish["r"] == "stop"
    assert outputs["s"] == [20, 21, 22] and finish["s"] == "stop"


def test_drafts_never_pass_max_tokens_or_the_token_budget():
    s = spec(k=8)
    sched = make_scheduler(s, max_tokens=12)
    requests = [Request(f"r{i}", [1, 2, 3, 4, 5] * 3, SamplingParams(max_tokens=m, ignore_eos=True),
                        0.0) for i, m in enumerate([1, 2, 3, 9])]
    for r in requests:
        sched.add(r)
    runner, outputs = FakeRunner(4, repeating), {r.request_id: [] for r in requests}
    while sched.pool:
        batch = sched.schedule()
        assert batch.step.num_tokens <= 12
        for item, q in zip(batch.scheduled, batch.step.query_lens):
            r = item.request
            assert r.num_computed_tokens <= r.max_num_tokens - 1
        for out in sched.process(batch, runner.execute(batch.step)):
            outputs[out.request_id] += out.new_token_ids
    for r in requests:
        assert outputs[r.request_id] == reference(repeating, r.prompt_token_ids,
                                                  r.sampling.max_tokens)
    assert s.num_draft_tokens > 0


def test_rejected_drafts_never_reach_the_prefix_cache(continuation):
    """A later prompt that continues an earlier request reuses its cached blocks; the
    stand-in reads the tokens back from the KV slots, so a block registered with a
    rejected draft's KV in it would change the answer."""
    s = spec()
    sched = make_scheduler(s, prefix_caching=True, continuation=continuation)
    first = Request("a", [7, 8, 9, 10, 11, 1, 2], SamplingParams(max_tokens=40, ignore_eos=True),
                    0.0)
    runner = FakeRunner(4, mostly_repeating)
    outputs, _, _ = run(sched, runner, [first])
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    prompt = first.prompt_token_ids + outputs["a"] + [3]
    second = Request("b", prompt, SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    outputs, _, _ = run(sched, runner, [second])
    assert second.num_cached_tokens >= 32
    assert outputs["b"] == reference(mostly_repeating, prompt, 20)


def test_preempted_requests_with_drafts_recompute_the_same_tokens(continuation):
    s = spec()
    sched = make_scheduler(s, num_blocks=32, policy="priority", continuation=continuation)
    outputs, _, _ = run(sched, FakeRunner(4, mostly_repeating), workload(2, n=6))
    assert sched.num_preemptions > 0 and s.num_accepted_tokens > 0
    for r in workload(2, n=6):
        assert outputs[r.request_id] == reference(mostly_repeating, r.prompt_token_ids,
                                                  r.sampling.max_tokens)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "drafts"])
def test_requests_that_arrive_together_do_not_preempt_each_other_without_end(continuation,
                                                                            speculate):
    """Equal arrival times (several requests in one call, a coarse clock) under KV pressure:
    each preemption goes to the later request in a total order (time, then the order the
    scheduler got them), so none takes back the KV its victim just took from it."""
    requests = [dataclasses.replace(r, arrival_time=0.0) for r in workload(2, n=6)]
    sched = make_scheduler(spec() if speculate else None, num_blocks=24, policy="priority",
                           continuation=continuation)
    outputs, _, _ = run(sched, FakeRunner(4, mostly_repeating), requests)
    assert sched.num_preemptions > 0
    for r in requests:
        assert outputs[r.request_id] == reference(mostly_repeating, r.prompt_token_ids,
                                                  r.sampling.max_tokens)


def test_logprobs_follow_the_accepted_tokens():
    sched = make_scheduler(spec(k=3))
    r = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True),
                0.0)
    sched.add(r)
    batch = sched.schedule()
    sched.process(batch, StepResult([3], [(-0.5, [3], [-0.5], 0)]))
    batch = sched.schedule()
    assert batch.drafts == [[1, 2, 3]]  # the tokens that followed [1, 2, 3] before
    lps = [(-0.1, [1], [-0.1], 0), (-0.2, [9], [-0.2], 0), (-0.3, [4], [-0.3], 0),
           (-0.4, [5], [-0.4], 0)]
    (out,) = sched.process(batch, StepResult([1, 9, 4, 5], lps))
    assert out.new_token_ids == [1, 9] and [x[0] for x in out.logprobs] == [-0.1, -0.2]
    assert r.num_computed_tokens == 5 + 2  # the prompt, 3 and 1; 9 is not computed yet


# ---- configuration and metrics ---------------------------------------------------------------

def test_config_follows_vllm_and_refuses_what_it_lacks():
    cfg = EngineConfig.from_args({"speculative_config": '{"method": "ngram", '
                                                        '"num_speculative_tokens": 3}'})
    assert cfg.async_scheduling is True
    assert (cfg.speculative_config.min_n, cfg.speculative_config.max_n) == (5, 5)
    # pipeline stages: the first stage would need the last one's accepted drafts
    assert EngineConfig.from_args({"speculative_config": {"num_speculative_tokens": 2},
                                   "pipeline_parallel_size": 2}).async_scheduling is False
    assert EngineConfig.from_args({"speculative_config": {
        "model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    }).speculative_config.min_n == 4
    for args, words in [
            ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported"),
            ({"num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
             "speculative_config.draft_tensor_parallel_size"),
            ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
             "exceeds prompt_lookup_max"),
            ({"method": "ngram"}, "num_speculative_tokens")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_args({"speculative_config": args})
    with pytest.raises(ConfigError, match="async_scheduling false"):
        EngineConfig.from_args({"speculative_config": {"num_speculative_tokens": 2},
                                "async_scheduling": True, "pipeline_parallel_size": 2})


def test_disable_by_batch_size():
    s = spec(disable_by_batch_size=2)
    sched = make_scheduler(s)
    run(sched, FakeRunner(4, repeating), workload(3, n=1))
    assert s.num_drafts > 0
    s = spec(disable_by_batch_size=2)
    run(make_scheduler(s), FakeRunner(4, repeating),
        [Request(f"r{i}", [1, 2, 3] * 4, SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
         for i in range(2)])
    assert s.num_drafts == 0


def test_metrics_count_drafts_as_vllm():
    metrics, s = EngineMetrics("m"), spec(k=3)
    s.accept([4, 5, 6], [4, 5, 0, 0])
    metrics.speculation(s)
    s.accept([4], [4, 0])
    metrics.speculation(s)
    text = metrics.render().decode()
    for line in ['orca:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0',
                 'orca:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 4.0',
                 'orca:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 3.0',
                 'orca:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="0"} 2.0',
                 'orca:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="1"} 1.0']:
        assert line in text, line


# ---- the engine against transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec")
    save_random_llama(str(path), seed=5)
    return str(path)


def repetitive_workload(seed, n=10):
    """Prompts that repeat a phrase, arriving over the first iterations (prompts beside
    speculated decodes)."""
    rng = random.Random(seed)
    arrivals = {}
    for i in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randint(2, 8))]
        prompt = phrase * rng.randint(1, 4) + [rng.randrange(256)] * rng.randint(0, 2)
        arrivals.setdefault(rng.randint(0, 12), []).append(
            (f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(8, 40), temperature=0.0,
                                             ignore_eos=True, logprobs=2)))
    return arrivals


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_tokens_and_logprobs_match_transformers(checkpoint, overlap):
    arrivals = repetitive_workload(4)
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, max_num_tokens=4096,
                             block_size=4, async_scheduling=overlap, speculative_config={
                                 "method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    outputs = engine.run(arrivals)
    for rid, prompt, sampling in (r for reqs in arrivals.values() for r in reqs):
        assert outputs[rid] == hf_greedy(checkpoint, prompt, sampling.max_tokens), rid
    s = engine.scheduler.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert any(s.num_drafts and max(s.query_lens) > 5 for s in engine.steps), \
        "no draft beside a prompt"
    # overlapped: the next step was scheduled before the drafts were verified
    assert any(s.shifted for s in engine.steps) == overlap
    # the log-probabilities at draft positions are those of plain decoding
    plain = InProcessEngine(model=checkpoint, max_batch_size=8, max_num_tokens=4096,
                            block_size=4)
    plain.run(arrivals)
    for rid, lps in engine.logprobs.items():
        assert len(lps) == len(plain.logprobs[rid])
        for (lp, ids, values, _), (plp, pids, pvalues, _) in zip(lps, plain.logprobs[rid]):
            assert ids == pids and lp == pytest.approx(plp, abs=1e-4)
            assert values == pytest.approx(pvalues, abs=1e-4)


def test_sampled_requests_speculate_and_end_at_max_tokens(checkpoint):
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, max_num_tokens=4096,
                             speculative_config={"num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1})
    arrivals = {0: [(f"r{i}", [5, 6, 7] * 6, SamplingParams(max_tokens=30, temperature=0.3,
                                                             ignore_eos=True))
                    for i in range(4)]}
    outputs = engine.run(arrivals)
    assert all(len(outputs[f"r{i}"]) == 30 for i in range(4))
    assert engine.scheduler.speculator.num_drafts > 0


SPEC_ARGS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}


def test_verifying_steps_in_mixed_step_graphs_match_transformers(checkpoint):
    """The mixed-step graphs' path on CPU (tests/test_parity.py's EagerReplay): a step's
    logits rows are its requests and their draft tokens, so the request bucket holds both."""
    from engine_actors.cuda_graphs import MixedGraphs
    from tests.test_parity import EagerReplay
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, max_num_tokens=4096,
                             block_size=4, speculative_config=SPEC_ARGS)
    runner = engine.worker.runner
    graphs = MixedGraphs(runner.model, runner.kv_caches, runner.block_table[runner.pad_row],
                         runner.block_size, 256, 8 * 5, runner.dtype)
    assert graphs.request_sizes == [8, 32, 40]  # up to 8 requests, each with 4 drafts
    for t in graphs.token_sizes:
        for r in graphs.request_sizes:
            replay = EagerReplay(graphs, t, r)
            graphs.graphs[t, r] = (replay, replay.out)
    runner.mixed = graphs
    arrivals = repetitive_workload(4)
    outputs = engine.run(arrivals)
    for rid, prompt, sampling in (r for reqs in arrivals.values() for r in reqs):
        assert outputs[rid] == hf_greedy(checkpoint, prompt, sampling.max_tokens), rid
    assert runner.num_mixed_replays > 0 and engine.scheduler.speculator.num_accepted_tokens
    # some step sampled more rows than it had requests, inside a graph
    assert any(len(s.rows) + sum(s.num_drafts) > 8 for s in engine.steps)


@pytest.mark.gpu
def test_greedy_matches_transformers_on_gpu_fp32(checkpoint):
    """Triton kernels, decode graphs for steps without drafts, mixed-step graphs for steps
    with them: exactly transformers' tokens."""
    arrivals = repetitive_workload(4)
    engine = InProcessEngine(device="cuda", model=checkpoint, dtype="float32",
                             max_batch_size=8, max_num_tokens=4096,
                             speculative_config=SPEC_ARGS)
    outputs = engine.run(arrivals)
    for rid, prompt, sampling in (r for reqs in arrivals.values() for r in reqs):
        assert outputs[rid] == hf_greedy(checkpoint, prompt, sampling.max_tokens, "cuda"), rid
    runner = engine.worker.runner
    assert runner.num_graph_replays > 0 and runner.num_mixed_replays > 0
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_a_step_replays_the_smallest_graph_that_holds_its_tokens_and_logits_rows():
    from engine_actors.cuda_graphs import MixedGraphs
    graphs = MixedGraphs.__new__(MixedGraphs)
    graphs.token_sizes, graphs.request_sizes = [16, 32, 64, 128], [8, 32, 40]
    graphs.graphs = {(t, r): None for t in graphs.token_sizes for r in graphs.request_sizes
                     if r <= t}
    assert graphs.bucket_for(5, 5) == (16, 8)
    assert graphs.bucket_for(9, 9) == (32, 32)  # (16, 32) has more rows than tokens
    assert graphs.bucket_for(33, 40) == (64, 40)
    assert graphs.bucket_for(129, 1) is None and graphs.bucket_for(8, 41) is None


def test_a_request_left_no_token_beside_drafts_ends_and_the_next_step_runs(checkpoint):
    """A request whose masks leave it no token (NO_TOKEN) in a step that verifies another
    request's drafts: the step already scheduled after it continues from a valid id."""
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, max_num_tokens=4096,
                             block_size=4, speculative_config=SPEC_ARGS)
    greedy = dict(temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", [5, 6, 7, 8] * 6, SamplingParams(max_tokens=40, **greedy)),
                    # 97 once, then the bad word [97, 97] leaves it nothing
                    ("b", [5, 80, 13], SamplingParams(max_tokens=5, allowed_token_ids=(97,),
                                                      bad_words=((97, 97),), **greedy))]}
    outputs = engine.run(arrivals)
    assert outputs["b"] == [97] and engine.finish_reasons["b"] == "stop"
    assert outputs["a"] == hf_greedy(checkpoint, [5, 6, 7, 8] * 6, 40)
    assert any(s.num_drafts and len(s.rows) == 2 for s in engine.steps)


def test_drafts_of_steps_whose_request_ended_before_are_not_counted():
    """With continuation, a request that ends at a stop token inside its drafts has a next
    step in flight whose drafts are never verified: the counters leave them out."""
    s = spec()
    sched = make_scheduler(s, continuation=True)
    requests = [Request(f"r{i}", [10 + i, 11, 12, 13, 14] * 2 + [10 + i, 11, EOS, 13, 14],
                        SamplingParams(max_tokens=40), float(i)) for i in range(4)]
    outputs, finish, _ = run(sched, FakeRunner(4, repeating), requests)
    assert all(finish[r.request_id] == "stop" for r in requests)
    # every verified draft of the repeating model is right
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
