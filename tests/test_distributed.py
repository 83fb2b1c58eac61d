"""Tensor and pipeline parallelism on CPU (gloo): shards, and outputs equal to one worker's."""
from __future__ import annotations

import asyncio
import random
import re
import time

import pytest
import torch

from engine_actors.checkpoint import resolve_model_path, save_random_llama
from engine_actors.config import DEFAULT_MODEL, EngineConfig
from engine_actors.messages import EngineRequest
from engine_actors.model_runner import ModelRunner
from engine_actors.output_stream import OutputStream
from engine_actors.parallel import ParallelGroup
from engine_actors.request import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")  # 4 heads, 2 KV heads, 4 layers, vocab 258
    save_random_llama(str(path), seed=9)
    return str(path)


def hf_weights(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}, model.config


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_each_rank_holds_exactly_its_shard(checkpoint, tp, pp):
    full, cfg = hf_weights(checkpoint)
    d, heads = 16, cfg.num_attention_heads
    inter, vocab = cfg.intermediate_size, cfg.vocab_size
    for pp_rank in range(pp):
        for r in range(tp):
            parallel = ParallelGroup(r, tp, pp_rank, pp)
            runner = ModelRunner(checkpoint, "cpu", torch.float32, 256, 16, 4, 0, parallel=parallel)
            got = dict(runner.model.named_parameters())
            per = cfg.num_hidden_layers // pp
            layers = list(range(pp_rank * per, (pp_rank + 1) * per))
            assert sorted(int(k) for k in runner.model.layers) == layers
            q_rows = slice(r * heads // tp * d, (r + 1) * heads // tp * d)
            i_rows = slice(r * inter // tp, (r + 1) * inter // tp)
            for i in layers:
                p, f = f"layers.{i}.", f"layers.{i}."
                # the query heads (KV heads replicated over more ranks than there are of
                # them are checked by behaviour: test_tp_with_more_ranks_than_kv_heads)
                q = got[p + "self_attn.qkv_proj.weight"][:q_rows.stop - q_rows.start]
                assert torch.equal(q, full[f + "self_attn.q_proj.weight"][q_rows])
                assert torch.equal(got[p + "self_attn.o_proj.weight"],
                                   full[f + "self_attn.o_proj.weight"][:, q_rows])
                gate_up = torch.cat([full[f + "mlp.gate_proj.weight"][i_rows],
                                     full[f + "mlp.up_proj.weight"][i_rows]])
                assert torch.equal(got[p + "mlp.gate_up_proj.weight"], gate_up)
                assert torch.equal(got[p + "mlp.down_proj.weight"],
                                   full[f + "mlp.down_proj.weight"][:, i_rows])
                assert torch.equal(got[p + "input_layernorm.weight"],
                                   full[f + "input_layernorm.weight"])
            rows = -(-vocab // tp)
            shard = full["embed_tokens.weight"][r * rows:(r + 1) * rows]
            if pp_rank == 0:
                assert torch.equal(got["embed_tokens.weight"][:len(shard)], shard)
                assert not got["embed_tokens.weight"][len(shard):].any()  # vocab padding
            else:
                assert "embed_tokens.weight" not in got
            if pp_rank == pp - 1:
                head = full["lm_head.weight"][r * rows:(r + 1) * rows]
                assert torch.equal(got["lm_head.weight"][:len(head)], head)
                assert torch.equal(got["norm.weight"], full["norm.weight"])
            else:
                assert "lm_head.weight" not in got and "norm.weight" not in got


# ---- through Ray: scheduler actor + a group of gloo workers ---------------------------------

def workload(seed=4, n=12):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(1, 50))],
             SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True))
            for i in range(n)]


async def run_in_waves(actor, requests, waves=3):
    """Submit in waves, each once tokens of the previous one arrive (joins while batches are
    in flight); returns request id -> tokens."""
    stream = OutputStream(actor)
    outputs = {r[0]: [] for r in requests}
    size = -(-len(requests) // waves)
    pending = [[EngineRequest(*r[:3], lora_name=r[3] if len(r) > 3 else None)
                for r in requests[i:i + size]] for i in range(0, len(requests), size)]
    submitted = []

    def on_update(rid, update):
        assert update.error is None, update
        outputs[rid].extend(update.token_ids)
        if pending:
            submitted.append(asyncio.ensure_future(stream.submit(pending.pop(0))))
    try:
        await stream.submit(pending.pop(0))
        await stream.follow(set(outputs), on_update)
        await asyncio.gather(*submitted)
        return outputs
    finally:
        stream.close()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(address="local", num_cpus=max(2, torch.cuda.device_count()),
             include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def start_engine(model, tp, pp, device="cpu", **extra):
    import ray

    from engine_actors.scheduler_actor import SchedulerActor
    cpus = 2 / (tp * pp) if device == "cpu" else 1
    cfg = EngineConfig.from_args(dict(model=model, device=device, tensor_parallel_size=tp,
                                      pipeline_parallel_size=pp, max_batch_size=6,
                                      max_num_batched_tokens=40, max_num_tokens=2048,
                                      num_cpus_per_worker=cpus, **extra))
    actor = ray.remote(SchedulerActor).options(num_cpus=0, max_concurrency=1000).remote(cfg)
    ray.get(actor.ready.remote())
    return actor


def stop_engine(actor):
    import ray
    try:
        ray.get(actor.shutdown.remote())
    except ray.exceptions.RayActorError:
        pass  # it kills itself on the way out


def compare_configs(checkpoint, configs, **engine_args):
    requests = workload()
    results = {}
    for tp, pp in configs:
        actor = start_engine(checkpoint, tp, pp, **engine_args)
        results[(tp, pp)] = asyncio.run(run_in_waves(actor, requests))
        stop_engine(actor)
    return requests, results


def single_worker(model, requests, waves=3):
    """One worker's tokens, in-process (tests/engine_harness.py): the same scheduler and
    worker code as a (1, 1) engine over Ray, the same engine args as start_engine's."""
    from tests.engine_harness import InProcessEngine
    engine = InProcessEngine(model=model, max_batch_size=6, max_num_batched_tokens=40,
                             max_num_tokens=2048)
    size = -(-len(requests) // waves)
    return engine.run({2 * i: requests[i * size:(i + 1) * size] for i in range(waves)})


def seeded_workload(n=8):
    """Sampled with seeds and penalties: P=2 continues each batch from the last stage's
    samples returned over the device link, and the penalties count the continued tokens
    on the last stage."""
    rng = random.Random(8)
    return [(f"s{i}", [rng.randrange(256) for _ in range(rng.randint(1, 40))],
             SamplingParams(max_tokens=rng.randint(4, 20), temperature=0.9, seed=100 + i,
                            presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True))
            for i in range(n)]


@pytest.fixture(scope="module")
def one_worker(checkpoint):
    """(requests, one worker's tokens by request id): greedy, and seeded sampling with
    penalties."""
    requests = workload() + seeded_workload()
    return requests, single_worker(checkpoint, requests)


def test_tp_pp_outputs_equal_a_single_worker(ray_cluster, checkpoint, one_worker):
    """Every split gives one worker's tokens (T=2 x P=2: the LoRA test below, whose engine
    serves these requests too)."""
    requests, expected = one_worker
    assert all(len(expected[rid]) == s.max_tokens > 0 for rid, _, s in requests)
    for tp, pp in [(2, 1), (1, 2)]:
        actor = start_engine(checkpoint, tp, pp)
        outputs = asyncio.run(run_in_waves(actor, requests))
        stop_engine(actor)
        assert outputs == expected, (tp, pp)


def test_speculative_decoding_over_pipeline_stages_equals_a_single_worker(
        ray_cluster, checkpoint, one_worker):
    """n-gram drafts verified through the scheduler actor, over two tensor-parallel ranks
    (async scheduling: every rank finds the accepted drafts on its device) and two stages
    (steps wait for their drafts' verification); the seeded requests with penalties decode
    one token a step beside them."""
    import ray
    requests, expected = one_worker
    for tp, pp in [(2, 1), (1, 2)]:
        actor = start_engine(checkpoint, tp, pp, speculative_config={
            "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
        outputs = asyncio.run(run_in_waves(actor, requests))
        text = ray.get(actor.metrics_text.remote()).decode()
        stop_engine(actor)
        assert outputs == expected, (tp, pp)
        # (the random model seldom repeats itself: drafts are verified, few are accepted)
        drafts = re.search(r"^orca:spec_decode_num_draft_tokens_total\{.*\} (\S+)$", text,
                           re.M)
        assert float(drafts.group(1)) > 0, (tp, pp)


def test_worker_death_fails_in_flight_requests_and_recovers(ray_cluster):
    import ray
    actor = start_engine(resolve_model_path(DEFAULT_MODEL), 2, 1)

    async def scenario():
        stream = OutputStream(actor)
        await stream.submit([EngineRequest("long", [1, 2, 3],
                                           SamplingParams(max_tokens=2000, ignore_eos=True))])
        workers = await actor.executor_call.remote("workers")
        killed = False
        async for _, update in stream:
            if not killed:
                ray.kill(workers[1])  # a tensor-parallel peer dies mid-generation
                killed = True
            if update.finish_reason:
                stream.close()
                return update

    final = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert final.finish_reason == "abort" and "failed" in final.error
    after = asyncio.run(run_in_waves(actor, workload(seed=5, n=4), waves=1))
    assert all(len(v) > 0 for v in after.values())
    stop_engine(actor)


def test_phi3_fused_projections_are_sharded_part_by_part(tmp_path):
    """Phi-3's checkpoint holds q, k and v in one tensor, gate and up in another: each rank
    gets its heads of each part, as from Llama's separate tensors."""
    from engine_actors.checkpoint import save_random_checkpoint
    save_random_checkpoint(str(tmp_path), "phi3", seed=4)
    full, cfg = hf_weights(str(tmp_path))
    d, heads, kv, inter = 16, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    q, k, v = full["layers.1.self_attn.qkv_proj.weight"].split([heads * d, kv * d, kv * d])
    gate, up = full["layers.1.mlp.gate_up_proj.weight"].chunk(2)
    for r in range(2):
        runner = ModelRunner(str(tmp_path), "cpu", torch.float32, 256, 16, 4, 0,
                             parallel=ParallelGroup(r, 2, 0, 1))
        got = dict(runner.model.named_parameters())
        rows = lambda t, n: t[r * n // 2 * d:(r + 1) * n // 2 * d]  # noqa: E731
        assert torch.equal(got["layers.1.self_attn.qkv_proj.weight"],
                           torch.cat([rows(q, heads), rows(k, kv), rows(v, kv)]))
        half = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(got["layers.1.mlp.gate_up_proj.weight"],
                           torch.cat([gate[half], up[half]]))


@pytest.mark.parametrize("model_type,shape,configs", [
    ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True), [(2, 1), (1, 2)]),
    ("qwen2_moe", dict(shared_expert_intermediate_size=48), [(2, 1)])])
def test_a_mixture_of_experts_over_tp_and_pp_equals_one_worker(ray_cluster, tmp_path,
                                                               model_type, shape, configs):
    """Qwen3-MoE and Qwen2-MoE: each rank holds its share of every expert's intermediate
    features (the router replicated; Qwen2-MoE's shared expert sharded as a dense MLP, its
    gate replicated), each stage its layers' experts."""
    from engine_actors.checkpoint import save_random_checkpoint
    save_random_checkpoint(str(tmp_path), model_type, seed=4, moe_intermediate_size=32,
                           num_experts=8, num_experts_per_tok=2, **shape)
    requests, results = compare_configs(str(tmp_path), configs)
    expected = single_worker(str(tmp_path), requests)
    assert all(results[c] == expected for c in configs)


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                 reason="needs 2 GPUs")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_embeddings_over_tp_and_pp_equal_one_worker(ray_cluster, checkpoint, device):
    """runner pooling: the last stage's embeddings, from two stages (async scheduling, with
    no sampled token to send back: over NCCL, a receive left waiting for one would block the
    stages' link) and, on GPUs, from two ranks, equal one worker's."""
    import numpy as np

    from engine_actors.output_stream import run_requests
    from tests.engine_harness import InProcessEngine
    requests = [(f"e{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                for i, (_, prompt, _) in enumerate(workload(seed=5))]
    engine = InProcessEngine(device, model=checkpoint, runner="pooling", max_batch_size=6,
                             max_num_batched_tokens=40, max_num_tokens=2048, dtype="float32")
    engine.run({0: requests})
    for tp, pp in [(1, 2)] + ([(2, 1)] if device == "cuda" else []):  # (CPU: the stages)
        actor = start_engine(checkpoint, tp, pp, device, runner="pooling", dtype="float32")
        got = asyncio.run(run_requests(actor, [EngineRequest(*r) for r in requests]))
        stop_engine(actor)
        for rid, _, _ in requests:
            np.testing.assert_allclose(np.frombuffer(got[rid].embedding, np.float32),
                                       np.frombuffer(engine.embeddings[rid], np.float32),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_scores_over_tp_and_pp_equal_one_worker(ray_cluster, checkpoint, device):
    """A reranker (classifier_from_token): each rank keeps the LM head's rows of its tokens
    from the whole checkpoint, whichever vocabulary shard they fall in (of 258 rows over
    two ranks, "n" is 110 and the other 200); the logits from two ranks, and on GPUs from
    two stages, equal one worker's."""
    import numpy as np

    from engine_actors.checkpoint import load_tokenizer
    from engine_actors.output_stream import run_requests
    from tests.engine_harness import InProcessEngine
    tokens = ["n", load_tokenizer(checkpoint).convert_ids_to_tokens(200)]
    args = dict(runner="pooling", classifier_from_token=tokens, dtype="float32")
    requests = [(f"s{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                for i, (_, prompt, _) in enumerate(workload(seed=6))]
    engine = InProcessEngine(device, model=checkpoint, max_batch_size=6,
                             max_num_batched_tokens=40, max_num_tokens=2048, **args)
    engine.run({0: requests})
    want = [np.frombuffer(engine.embeddings[rid], np.float32)[0] for rid, _, _ in requests]
    assert len(set(np.round(want, 5))) > 1  # (logits that tell prompts apart)
    for tp, pp in [(2, 1)] + ([(1, 2)] if device == "cuda" else []):  # (CPU: the ranks)
        actor = start_engine(checkpoint, tp, pp, device, **args)
        got = asyncio.run(run_requests(actor, [EngineRequest(*r) for r in requests]))
        stop_engine(actor)
        np.testing.assert_allclose([np.frombuffer(got[rid].embedding, np.float32)[0]
                                    for rid, _, _ in requests], want, rtol=1e-5, atol=1e-5)


def test_tp_with_more_ranks_than_kv_heads(ray_cluster, tmp_path):
    """One KV head, two ranks: each rank holds the replicated head; outputs equal one
    worker's."""
    save_random_llama(str(tmp_path), seed=11, num_key_value_heads=1)
    requests, results = compare_configs(str(tmp_path), [(2, 1)])
    assert results[(2, 1)] == single_worker(str(tmp_path), requests)


def test_tp_that_cannot_split_the_kv_heads_is_refused_at_start(tmp_path):
    """6 query heads, 2 KV heads, 3 ranks: rank 1 would need half of each KV head."""
    from engine_actors.checkpoint import model_info
    save_random_llama(str(tmp_path), hidden_size=96, num_attention_heads=6,
                      num_key_value_heads=2)
    with pytest.raises(ValueError, match="multiple of the other"):
        model_info(EngineConfig.from_args({"model": str(tmp_path), "tensor_parallel_size": 3}))


def test_lora_adapters_sharded_over_tp_and_pp_equal_transformers_peft(ray_cluster, checkpoint,
                                                                      tmp_path, one_worker):
    """Two tensor-parallel ranks per stage shard A and B with their layer, two stages hold
    their layers' adapters: the tokens of each adapter (and the base model) equal peft's.
    Among them, the base model's requests of test_tp_pp_outputs_equal_a_single_worker give
    one worker's tokens."""
    pytest.importorskip("peft")
    from tests.test_lora import peft_greedy, save_adapter
    paths = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    save_adapter(checkpoint, paths["a"], 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    save_adapter(checkpoint, paths["b"], 8, 8, ["gate_proj", "up_proj", "down_proj", "v_proj"],
                 seed=2)
    requests = [(f"lora-{rid}", prompt, sampling, [None, "a", "b"][i % 3])
                for i, (rid, prompt, sampling) in enumerate(workload(seed=6, n=12))]
    base, expected = one_worker
    mixed = [r for pair in zip(requests, base) for r in pair] + base[len(requests):]
    actor = start_engine(checkpoint, 2, 2, lora_modules=paths, max_lora_rank=8)
    try:
        outputs = asyncio.run(run_in_waves(actor, mixed))
    finally:
        stop_engine(actor)
    assert {rid: outputs[rid] for rid in expected} == expected
    for rid, prompt, sampling, adapter in requests:
        expected = peft_greedy(checkpoint, paths.get(adapter), prompt, sampling.max_tokens)
        assert outputs[rid] == expected, (rid, adapter)


# how the job trains beside base requests: whole micro-batches in idle moments (FineInfer's
# rule); in pieces between requests, each run stopped by the next request (a bound that no
# whole micro-batch fits: finetune_busy.py); in pieces beside them with a share of the time.
# "beside" (busy share only while requests run) first trains a job with no request at all:
# whole micro-batches, sent ahead, as with the defaults.
MODES = {"between": {"finetune_deferral_ms": 0.001},
         "beside": {"finetune_busy_share": 0.5}}


@pytest.mark.parametrize("device,mode", [
    ("cpu", "between"), ("cpu", "beside"),
    *(pytest.param("cuda", mode, marks=TWO_GPUS) for mode in MODES)])
def test_finetuning_over_two_tensor_parallel_ranks(ray_cluster, checkpoint, device, mode):
    """A job trains over T=2 (every rank its shards), while the base model serves; its
    adapter, saved whole, then answers the trained prompt with the trained tokens. In
    pieces, base requests keep coming while it trains: every rank must run steps and
    pieces in one order, and stop a run after the same piece (their collectives match),
    and the base model's tokens stay the same. On CPU over gloo; on two GPUs over NCCL."""
    import ray

    from engine_actors.lora_files import TARGETS
    prompt, answer = [5, 6, 7, 8], [40, 41, 42, 43, 44]
    base = [("base", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]

    def train(suffix: str, with_requests: bool):
        """A job to its end, base requests in waves while it trains if asked; (the tuned
        and base tokens after it, the engine's fine-tuning stats, the waves' tokens)."""
        spec = {"model": "m", "training_file": "file-tp", "suffix": suffix, "seed": 0,
                "examples": [(prompt + answer, [False] * len(prompt) + [True] * len(answer))],
                "n_epochs": 40, "batch_size": 1, "learning_rate": 1e-2,
                "lora": {"r": 8, "alpha": 16, "target_modules": list(TARGETS)}}
        during = []
        job = ray.get(actor.finetune_call.remote("create", spec))
        for _ in range(600):
            job = ray.get(actor.finetune_call.remote("job", job["id"]))
            if job["status"] not in ("queued", "running"):
                break
            if with_requests and len(during) < 8:  # a wave of base requests
                long = [(f"d{suffix}{len(during)}-{i}", prompt, SamplingParams(
                    max_tokens=24, temperature=0.0, ignore_eos=True)) for i in range(3)]
                during.append(asyncio.run(run_in_waves(actor, long, waves=1)))
            else:
                time.sleep(0.1)
        assert job["status"] == "succeeded", job
        health = ray.get(actor.stats.remote())["finetuning"]
        tuned = [(f"tuned-{suffix}",) + base[0][1:] + (job["fine_tuned_model"],)]
        outputs = asyncio.run(run_in_waves(actor, base + tuned, waves=1))
        return outputs[tuned[0][0]], outputs["base"], health, during

    actor = start_engine(checkpoint, 2, 1, device=device, dtype="float32",
                         enable_finetuning=True, max_lora_rank=8, **MODES[mode])
    try:
        before = asyncio.run(run_in_waves(actor, base, waves=1))["base"]
        assert before != answer  # the test can fail
        if mode == "beside":  # idle: whole micro-batches, the next one sent ahead
            tuned, after, health, _ = train("idle", with_requests=False)
            assert tuned == answer and after == before
            assert health["micro_batches_sent_ahead"] > 0 and health["busy_pieces"] == 0
        tuned, after, health, during = train("tp", with_requests=True)
    finally:
        stop_engine(actor)
    assert tuned == answer and after == before
    if mode == "beside":
        assert health["busy_pieces"] > 0
    if mode == "between":  # runs of pieces that requests stopped, every rank after one piece
        assert health["in_pieces"] and health["stop_wait_ms"]["count"] > 0, health
    assert during and all(tokens[:5] == before for wave in during for tokens in wave.values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp_pp_on_gpus_equal_one_gpu_in_fp32(ray_cluster, checkpoint):
    """NCCL all-reduces (inside CUDA graphs) and send/recv: same greedy tokens as one GPU."""
    requests, results = compare_configs(checkpoint, [(1, 1), (2, 1), (1, 2), (2, 2)],
                                        device="cuda", dtype="float32")
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp_on_two_gpus_equals_one_gpu_in_fp32_with_either_all_reduce(ray_cluster, checkpoint):
    """T=2 through the one-shot all-reduce over peer memory (the default: every message of
    this small model fits) and through NCCL: the same greedy tokens as one GPU; P=2 too."""
    requests, results = compare_configs(checkpoint, [(1, 1), (2, 1), (1, 2)],
                                        device="cuda", dtype="float32")
    _, nccl = compare_configs(checkpoint, [(2, 1)], device="cuda", dtype="float32",
                              disable_custom_all_reduce=True)
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key
    assert nccl[(2, 1)] == results[(1, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp8_checkpoint_over_two_gpus_equals_one_gpu_in_fp32(ray_cluster, checkpoint,
                                                            tmp_path):
    """An FP8 checkpoint (compressed-tensors, a scale per output channel) over T=2 and P=2:
    each rank holds its rows' or columns' e4m3 weights with their scales; the same greedy
    tokens as one GPU (fp32 activations: the weight-only kernel on every rank)."""
    from tests.test_fp8 import FORMATS, write_fp8_checkpoint
    write_fp8_checkpoint(checkpoint, tmp_path / "fp8", tmp_path / "ref",
                         FORMATS["compressed-tensors-channel"])
    _, results = compare_configs(str(tmp_path / "fp8"), [(1, 1), (2, 1), (1, 2)],
                                 device="cuda", dtype="float32")
    _, unquantized = compare_configs(checkpoint, [(1, 1)], device="cuda", dtype="float32")
    assert results[(1, 1)] != unquantized[(1, 1)]  # the weights are the quantized ones
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("fmt", ["dense", "experts"])
def test_int4_checkpoint_over_two_gpus_equals_one_gpu_in_fp32(ray_cluster, tmp_path, fmt):
    """INT4 projections (groups of 16, tiled for the kernel on each rank) and INT4 experts
    with zero points over T=2 and P=2: the row-parallel all-reduce's buffer takes the
    layer's output features, not the tiled weight's shape; the same greedy tokens as one
    GPU."""
    from tests.test_int4 import write_int4_checkpoint
    from tests.test_int4_moe import write
    from tests.test_fp8_moe import moe_checkpoint
    base = tmp_path / "base"  # (192 intermediate features: 96 a rank, six groups)
    if fmt == "experts":
        moe_checkpoint(base, "qwen3-moe", intermediate_size=192)
        write(base, tmp_path / "q", tmp_path / "ref", "gptq-asymmetric")
    else:
        save_random_llama(str(base), seed=9, intermediate_size=192)
        write_int4_checkpoint(base, tmp_path / "q", tmp_path / "ref", 16)
    _, results = compare_configs(str(tmp_path / "q"), [(1, 1), (2, 1), (1, 2)],
                                 device="cuda", dtype="float32")
    _, unquantized = compare_configs(str(base), [(1, 1)], device="cuda", dtype="float32")
    assert results[(1, 1)] != unquantized[(1, 1)]  # the weights are the quantized ones
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key
