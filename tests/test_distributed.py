"""Tensor and pipeline parallelism on CPU (gloo): shards, and outputs equal to one worker's."""
from __future__ import annotations

import asyncio
import random
import uuid

import pytest
import torch

from engine_actors.checkpoint import resolve_model_path, save_random_llama
from engine_actors.config import DEFAULT_MODEL, EngineConfig
from engine_actors.model_runner import ModelRunner
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
    d, heads, kv_heads = 16, cfg.num_attention_heads, cfg.num_key_value_heads
    inter, vocab = cfg.intermediate_size, cfg.vocab_size
    for pp_rank in range(pp):
        for r in range(tp):
            pg = ParallelGroup(r, tp, pp_rank, pp)
            runner = ModelRunner(checkpoint, "cpu", torch.float32, 256, 16, 4, 0, pg=pg)
            got = dict(runner.model.named_parameters())
            per = cfg.num_hidden_layers // pp
            layers = list(range(pp_rank * per, (pp_rank + 1) * per))
            assert sorted(int(k) for k in runner.model.layers) == layers
            q_rows = slice(r * heads // tp * d, (r + 1) * heads // tp * d)
            kv_head = r * kv_heads // tp if tp > kv_heads else None
            kv_rows = slice(kv_head * d, (kv_head + 1) * d) if kv_head is not None \
                else slice(r * kv_heads // tp * d, (r + 1) * kv_heads // tp * d)
            i_rows = slice(r * inter // tp, (r + 1) * inter // tp)
            for i in layers:
                p, f = f"layers.{i}.", f"layers.{i}."
                qkv = torch.cat([full[f + "self_attn.q_proj.weight"][q_rows],
                                 full[f + "self_attn.k_proj.weight"][kv_rows],
                                 full[f + "self_attn.v_proj.weight"][kv_rows]])
                assert torch.equal(got[p + "self_attn.qkv_proj.weight"], qkv)
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

def workload(seed=4, n=18):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(1, 50))],
             SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True))
            for i in range(n)]


async def run_in_waves(actor, requests, waves=3):
    """Submit in waves, each after tokens of the previous arrived (joins while batches are
    in flight); returns request id -> tokens."""
    client = uuid.uuid4().hex
    outputs = {rid: [] for rid, _, _ in requests}
    unfinished = set(outputs)
    stream = actor.stream.remote(client)
    size = -(-len(requests) // waves)
    pending = [requests[i:i + size] for i in range(0, len(requests), size)]
    assert not any(await actor.add_requests.remote(client, pending.pop(0)))
    async for ref in stream:
        for rid, item in (await ref).items():
            outputs[rid].extend(item["token_ids"])
            assert "error" not in item, item
            if item["finish_reason"]:
                unfinished.discard(rid)
        if pending:
            assert not any(await actor.add_requests.remote(client, pending.pop(0)))
        if not unfinished and not pending:
            return outputs


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


def test_tp_pp_outputs_equal_a_single_worker(ray_cluster, checkpoint):
    requests, results = compare_configs(checkpoint, [(1, 1), (2, 1), (1, 2), (2, 2)])
    for _, _, sampling in requests:
        assert sampling.max_tokens > 0
    assert all(len(results[(1, 1)][rid]) == s.max_tokens for rid, _, s in requests)
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key


def test_worker_death_fails_in_flight_requests_and_recovers(ray_cluster):
    import ray
    actor = start_engine(resolve_model_path(DEFAULT_MODEL), 2, 1)

    async def scenario():
        client = uuid.uuid4().hex
        stream = actor.stream.remote(client)
        long = ("long", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))
        assert not any(await actor.add_requests.remote(client, [long]))
        workers = await actor.workers.remote()
        killed = False
        async for ref in stream:
            item = (await ref).get("long")
            if item and not killed:
                ray.kill(workers[1])  # a tensor-parallel peer dies mid-generation
                killed = True
            if item and item["finish_reason"]:
                return item

    final = asyncio.wait_for(scenario(), timeout=120)
    final = asyncio.run(final)
    assert final["finish_reason"] == "abort" and "failed" in final["error"]
    after = asyncio.run(run_in_waves(actor, workload(seed=5, n=4), waves=1))
    assert all(len(v) > 0 for v in after.values())
    stop_engine(actor)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp_pp_on_gpus_equal_one_gpu_in_fp32(ray_cluster, checkpoint):
    """NCCL all-reduces (inside CUDA graphs) and send/recv: same greedy tokens as one GPU."""
    requests, results = compare_configs(checkpoint, [(1, 1), (2, 1), (1, 2), (2, 2)],
                                        device="cuda", dtype="float32")
    for key, outputs in results.items():
        assert outputs == results[(1, 1)], key
