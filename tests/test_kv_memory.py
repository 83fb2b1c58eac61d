"""KV pool memory that fine-tuning borrows: unmapped while lent, the same addresses after."""
import pytest
import torch

from engine_actors.kv_memory import KVMemory

SHAPE = ((1024 + 1) * 16, 8, 128)  # 1024 blocks of 16 tokens and the scratch block


def test_cpu_pool_lends_by_bookkeeping_only():
    mem = KVMemory(2, SHAPE, 16, torch.float32, "cpu")
    unit_blocks, units, unit_bytes = mem.lendable()
    assert unit_blocks == 1024 // 64 and units == 64 and unit_bytes == 0
    mem.tensors[0][0].fill_(1.0)
    mem.lend(3)
    assert mem.num_lent == 3 and mem.lent_bytes == 0
    mem.take_back()
    assert mem.num_lent == 0
    assert bool((mem.tensors[0][0] == 1.0).all())  # nothing moved, nothing zeroed


@pytest.mark.gpu
def test_lent_blocks_free_device_memory_and_come_back_zeroed():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    mem = KVMemory(4, SHAPE, 16, torch.bfloat16, "cuda")
    assert mem.driver is not None, "virtual memory was refused"
    unit_blocks, units, unit_bytes = mem.lendable()
    assert units >= 1 and unit_blocks * units <= 1024
    k = mem.tensors[3][1]
    ptr = k.data_ptr()
    k.fill_(2.0)
    # a captured graph that writes into the kept blocks, replayed after lending
    keep = slice(0, (units - 2) * unit_blocks * 16)
    graph, src = torch.cuda.CUDAGraph(), torch.full_like(k[keep], 3.0)
    with torch.cuda.graph(graph):
        k[keep].copy_(src)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    mem.lend(1)
    mem.lend(2)  # one more unit
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] - free_before >= 2 * unit_bytes * 0.99
    hog = torch.empty(2 * unit_bytes - (1 << 20), dtype=torch.uint8, device="cuda")
    hog.fill_(7)  # the lent memory is usable by the allocator
    graph.replay()
    torch.cuda.synchronize()
    del hog
    mem.take_back()
    assert k.data_ptr() == ptr
    lent = slice((units - 2) * unit_blocks * 16, units * unit_blocks * 16)
    assert bool((k[keep] == 3.0).all()) and bool((k[lent] == 0).all())
    assert bool((k[units * unit_blocks * 16:] == 2.0).all())  # past the lendable range
    mem.free()


@pytest.mark.gpu
def test_training_borrows_kv_blocks_and_serving_resumes_exactly(tmp_path):
    """A training step runs in memory lent by the KV pool's free blocks; afterwards cached
    prefixes are still hit, new requests get blocks of the lent range back, and greedy
    outputs equal transformers' (fp32, CUDA graphs captured before the lending)."""
    import random

    from engine_actors.checkpoint import save_random_llama
    from engine_actors.request import SamplingParams
    from tests.engine_harness import InProcessEngine, hf_greedy
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = str(tmp_path)
    save_random_llama(path, seed=5, num_key_value_heads=4, head_dim=64)  # 16 KB blocks
    engine = InProcessEngine(device="cuda", model=path, dtype="float32", max_batch_size=8,
                             max_num_tokens=8192)  # 512 blocks: 4 units of 128 (2 MB chunks)
    kv, worker = engine.scheduler.kv, engine.worker
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(256) for _ in range(300)] for _ in range(3)]

    def run_and_check(reqs):
        outputs = engine.run({0: [(rid, p, greedy) for rid, p in reqs]})
        for rid, p in reqs:
            assert outputs[rid] == hf_greedy(path, p, 8, "cuda"), rid

    run_and_check([(f"a{i}", p) for i, p in enumerate(prompts)])
    memory = worker._finetune("start", "job", 8, 16, ["q_proj", "v_proj", "down_proj"],
                              1e-3, 0)
    assert (memory["lend_unit_blocks"], memory["lendable_units"]) == (128, 4)
    assert kv.lend(2, 128, 4) == 2
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    seq = [rng.randrange(256) for _ in range(200)]
    out = worker._finetune("micro_step", "job", 1, -1, 2, [seq], [[False] * 100 + [True] * 100],
                           100, True)
    assert out["tokens"] == 200 and out["peak_bytes"] > 0
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    freed = torch.cuda.mem_get_info()[0] + cached - free_before
    assert freed >= 2 * memory["lend_unit_bytes"] * 0.9
    worker._finetune("take_back", "")  # as the engine loop does before inference resumes
    kv.take_back()
    replays = worker.runner.num_graph_replays
    hits = kv.num_hit_tokens
    # longer prompts (one starting with an earlier one's) reach into the lent blocks
    later = [(f"b{i}", (prompts[0] if i == 0 else []) + [rng.randrange(256) for _ in range(700)])
             for i in range(6)]
    run_and_check(later)
    assert kv.num_hit_tokens > hits  # the cached prefix outlived the lending
    assert max(b for s in engine.steps for b in s.table_blocks) >= 256
    assert worker.runner.num_graph_replays > replays


@pytest.mark.gpu
def test_pieces_borrow_kv_blocks_requests_run_beside_and_a_call_off_frees_them(tmp_path):
    """A micro-batch in pieces lends itself KV blocks (its first piece); requests run
    between its pieces on the other blocks; called off midway, its activations are freed
    and the blocks map back, and serving resumes exactly (greedy, fp32, as transformers)."""
    import random

    from engine_actors.checkpoint import save_random_llama
    from engine_actors.request import SamplingParams
    from tests.engine_harness import InProcessEngine, hf_greedy
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = str(tmp_path)
    save_random_llama(path, seed=6, num_key_value_heads=4, head_dim=64)
    engine = InProcessEngine(device="cuda", model=path, dtype="float32", max_batch_size=8,
                             max_num_tokens=8192)  # 512 blocks: 4 units of 128
    kv, worker = engine.scheduler.kv, engine.worker
    rng = random.Random(1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run_and_check(reqs):
        outputs = engine.run({0: [(rid, p, greedy) for rid, p in reqs]})
        for rid, p in reqs:
            assert outputs[rid] == hf_greedy(path, p, 8, "cuda"), rid

    worker._finetune("start", "job", 8, 16, ["q_proj", "v_proj", "down_proj"], 1e-3, 0)
    assert kv.lend(2, 128, 4) == 2  # the scheduler's side (finetune_memory.py)
    seq = [rng.randrange(256) for _ in range(200)]
    worker._finetune("piece", "job", 1, 1, 2, [seq], [[False] * 100 + [True] * 100], 100, True)
    assert worker.runner.kv_memory.num_lent == 2 and worker.pieces is not None
    run_and_check([(f"a{i}", [rng.randrange(256) for _ in range(300)]) for i in range(3)])
    assert max(b for s in engine.steps for b in s.table_blocks) < 256  # not the lent ones
    worker._finetune("piece", "job", 2, 1)  # the micro-batch goes on after the requests
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    worker._finetune("call_off", "job")
    assert worker.pieces is None and torch.cuda.memory_allocated() < held
    worker._finetune("take_back", "")  # as the engine loop does once it is called off
    kv.take_back()
    later = [(f"b{i}", [rng.randrange(256) for _ in range(700)]) for i in range(6)]
    run_and_check(later)
    assert max(b for s in engine.steps for b in s.table_blocks) >= 256  # lent range reused


class _FlakyDriver:
    """Virtual memory calls that fail at the n-th unmap or map (counted from 1)."""

    def __init__(self, fail_unmap=0, fail_map=0):
        self.fail_unmap, self.fail_map, self.unmaps, self.maps = fail_unmap, fail_map, 0, 0

    def unmap(self, ptr, size, handle):
        self.unmaps += 1
        if self.unmaps == self.fail_unmap:
            raise RuntimeError("cuMemUnmap failed")

    def map(self, ptr, size):
        self.maps += 1
        if self.maps == self.fail_map:
            raise RuntimeError("cuMemCreate failed with error 2")
        return 1


def test_a_driver_failure_midway_leaves_nothing_unmapped_for_good(monkeypatch):
    """Lending or mapping back that fails partway: what was unmapped counts as lent, and a
    later take_back maps (and zeroes) every unit still unmapped."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    mem = KVMemory(2, SHAPE, 16, torch.float32, "cpu")  # 4 tensors, 64 units of 16 blocks
    mem.driver, mem.chunk = _FlakyDriver(fail_unmap=6), 1 << 20
    mem.ranges, mem.handles = [(0, 0)] * 4, [[1] * 65 for _ in range(4)]
    for k, v in mem.tensors:
        k.fill_(1.0)
        v.fill_(1.0)
    with pytest.raises(RuntimeError, match="cuMemUnmap"):
        mem.lend(3)  # the second unit fails at its second tensor
    assert mem.num_lent == 2  # the half-unmapped unit included
    assert [h[62] for h in mem.handles] == [None, 1, 1, 1]
    mem.driver.fail_map = 3
    with pytest.raises(RuntimeError, match="cuMemCreate"):
        mem.take_back()
    assert mem.num_lent == 2
    mem.take_back()
    assert mem.num_lent == 0 and all(h is not None for hs in mem.handles for h in hs)
    units = slice(62 * 16 * 16, 64 * 16 * 16)  # the two units' rows, zeroed
    assert all(bool((t[units] == 0).all()) for kv in mem.tensors for t in kv)
    assert bool((mem.tensors[0][0][:62 * 16 * 16] == 1.0).all())
