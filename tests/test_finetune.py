"""Fine-tuning on the worker: one training step's LoRA gradients equal transformers + peft's
on the same batch (fp32), the saved adapter is PEFT's, and the job runner's pieces (the
training file, micro-batches, FineInfer's deferral rule)."""
from __future__ import annotations

import json

import pytest
import torch

from engine_actors.checkpoint import save_random_llama
from engine_actors.finetune import Trainer
from tests.engine_harness import InProcessEngine

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ft") / "base")
    save_random_llama(path, seed=9)
    return path


def peft_model(base: str, rank: int, alpha: int, targets: list[str]):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=False)  # B random too: A gets gradients
    return peft.get_peft_model(model, cfg)


def peft_params(model) -> dict[tuple[str, str, str], torch.nn.Parameter]:
    """(layer, target, "A"/"B") -> peft's parameter."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            parts = name.split(".")
            layer = parts[parts.index("layers") + 1]
            kind = "A" if "lora_A" in name else "B"
            target = parts[parts.index(f"lora_{kind}") - 1]
            out[layer, target, kind] = p
    return out


# two ragged examples; the loss is on the completion tokens only
SEQS = [[5, 17, 99, 3, 250, 41, 7, 7, 80], [12, 200, 13, 64, 9]]
MASKS = [[False] * 5 + [True] * 4, [False] * 2 + [True] * 3]


def peft_backward(base: str, rank: int, alpha: int, targets: list[str]):
    """peft's model after one backward pass over SEQS (its LoRA gradients set)."""
    ref = peft_model(base, rank, alpha, targets)
    width = max(map(len, SEQS))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in SEQS])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in SEQS])
    labels = torch.tensor([[t if m else -100 for t, m in zip(s, mask)] + [-100] * (width - len(s))
                           for s, mask in zip(SEQS, MASKS)])
    ref(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
    return ref


@pytest.mark.parametrize("targets,device", [
    (TARGETS, "cpu"), (["q_proj", "v_proj", "down_proj"], "cpu"),
    pytest.param(TARGETS, "cuda", marks=pytest.mark.gpu)])
def test_one_step_gradients_equal_transformers_peft(base, targets, device):
    rank, alpha = 4, 8
    ref = peft_backward(base, rank, alpha, targets)
    seqs, masks = SEQS, MASKS
    engine = InProcessEngine(device, model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, rank, alpha, targets, lr=1e-3)
    params = peft_params(ref)
    with torch.no_grad():
        for (layer, target), (a, b) in trainer.params.items():
            a.copy_(params[layer, target, "A"])
            b.copy_(params[layer, target, "B"])
    out = trainer.micro_step(seqs, masks, batch_loss_tokens=7, last=False)
    assert out["loss_tokens"] == 7 and out["tokens"] == 14
    for (layer, target), (a, b) in trainer.params.items():
        for kind, ours in (("A", a), ("B", b)):
            theirs = params[layer, target, kind].grad
            assert theirs.abs().max() > 0, (layer, target, kind)  # the test can fail
            # relative to the gradient's norm: fp32 sums in another order differ by ~1e-7
            error = (ours.grad.cpu() - theirs).norm() / theirs.norm()
            assert error < 1e-5, (layer, target, kind, float(error))


def _tp_rank(rank: int, base: str, address: str, targets: list[str], ref_path: str,
             out_path: str) -> None:
    """One of two tensor-parallel ranks (gloo): set the reference's LoRA weights, shard by
    shard, run one micro-batch, sum the whole tensors' gradients, gather the shards."""
    from engine_actors.layers.lora import MODULES
    from engine_actors.model_runner import ModelRunner
    from engine_actors.parallel import init_parallel
    parallel = init_parallel(address, rank, 2, 1, "cpu", 60)
    model = ModelRunner(base, "cpu", torch.float32, 64, 16, 4, 0, parallel=parallel).model
    trainer = Trainer(model, 4, 8, targets, lr=1e-3)
    ref = torch.load(ref_path)
    modules = {(layer, target): (model.layers[layer].get_submodule(MODULES[target][0]),
                                 MODULES[target][1]) for layer, target in trainer.params}
    with torch.no_grad():
        for key, (a, b) in trainer.params.items():
            module, part = modules[key]
            full_a, full_b = ref[key + ("A",)], ref[key + ("B",)]
            if hasattr(module, "local_columns"):  # row-parallel: A's input columns
                a.copy_(module.local_columns(full_a))
                b.copy_(full_b)
            else:  # column-parallel: B's output rows of this rank's heads
                a.copy_(full_a)
                b.copy_(module.local_rows(full_b, part)[1])
    out = trainer.micro_step(SEQS, MASKS, batch_loss_tokens=7, last=False)
    trainer.sum_gradients()
    grads = {}
    for key, (a, b) in trainer.params.items():
        module, _ = modules[key]
        if hasattr(module, "local_columns"):
            grads[key] = (parallel.all_gather_last_dim(a.grad), b.grad)
        else:
            grads[key] = (a.grad, parallel.all_gather_last_dim(b.grad.T.contiguous()).T)
    trainer.save(out_path + ".adapter", base)  # collective: the shards are gathered
    if rank == 0:
        torch.save({"grads": grads, "loss_sum": out["loss_sum"]}, out_path)


def test_tensor_parallel_gradients_equal_transformers_peft(base, tmp_path):
    """T=2 (gloo): each rank trains its shards of the adapter; gathered, the gradients of
    one step equal transformers + peft's on the same batch, and the saved adapter holds
    the whole weights."""
    import torch.multiprocessing as mp

    from engine_actors.parallel import free_address
    targets = TARGETS
    params = peft_params(peft_backward(base, 4, 8, targets))
    torch.save({k: p.detach() for k, p in params.items()}, tmp_path / "ref.pt")
    mp.spawn(_tp_rank, args=(base, free_address(), targets, str(tmp_path / "ref.pt"),
                             str(tmp_path / "out.pt")), nprocs=2)
    grads = torch.load(tmp_path / "out.pt")["grads"]
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "out.pt.adapter" / "adapter_model.safetensors"))
    for (layer, target, kind), p in params.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{kind}.weight"
        torch.testing.assert_close(saved[name], p.detach())  # no step ran: the set weights
    for (layer, target), (grad_a, grad_b) in grads.items():
        for kind, ours in (("A", grad_a), ("B", grad_b)):
            theirs = params[layer, target, kind].grad
            assert theirs.abs().max() > 0, (layer, target, kind)
            error = (ours - theirs).norm() / theirs.norm()
            assert error < 1e-5, (layer, target, kind, float(error))


def test_saved_adapter_is_peft_format(base, tmp_path):
    """A trained adapter loads in peft and gives what our trainer's forward gives."""
    engine = InProcessEngine(model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, 4, 16, ["q_proj", "up_proj"], lr=1e-2)
    seq, mask = [7, 8, 9, 10, 11, 12], [False, False, True, True, True, True]
    for _ in range(3):
        trainer.micro_step([seq], [mask], 4, last=True)
    trainer.save(str(tmp_path / "adapter"), base)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16
    from transformers import AutoModelForCausalLM
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([seq])).logits[0, 1:-1]
        ours, _ = trainer.forward([seq], [mask])
    assert trainer.params["0", "q_proj"][1].abs().max() > 0  # training moved B off zero
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_fineinfer_deferral_rule():
    from engine_actors.finetune_jobs import may_defer
    assert may_defer([], None, 0.2)  # nobody waits: train back to back
    assert not may_defer([0.0], None, 0.2)  # step time not measured yet: serve first
    assert may_defer([0.05, 0.01], 0.1, 0.2)  # 50 ms waited + 100 ms step <= 200 ms
    assert not may_defer([0.15, 0.0], 0.1, 0.2)  # the oldest would wait 250 ms


def test_micro_batches_cover_each_epoch_once_within_the_token_cap():
    from engine_actors.finetune_job import Job
    lens = [5, 3, 7, 2, 6]
    examples = [([1] * n, [False] + [True] * (n - 1)) for n in lens]
    job = Job("j", "m", "f", examples, n_epochs=2, batch_size=2, learning_rate=1e-3,
              lora={}, suffix=None, seed=1)
    assert job.total_steps == 6
    seen, steps = [], 0
    while steps < job.total_steps:
        batch, batch_tokens = [], None
        while True:
            micro, loss_tokens, last = job.next_micro(max_tokens=8)
            assert sum(lens[i] for i in micro) <= 8 or len(micro) == 1
            batch += micro
            batch_tokens = loss_tokens
            if last:
                break
        assert batch_tokens == sum(lens[i] - 1 for i in batch) and len(batch) <= 2
        seen += batch
        steps += 1
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))


def test_training_file_masks_completions_and_assistant_turns():
    from deployments.protocol import APIError
    from deployments.training_data import parse_training_file
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path("tiny-random-llama"))
    lines = [json.dumps({"prompt": "ab", "completion": "cd"}),
             json.dumps({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "yo"},
                                      {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "ok"}]})]
    (ids, mask), (chat_ids, chat_mask) = parse_training_file("\n".join(lines).encode(), tok, 512)
    prompt = tok.encode("ab", add_special_tokens=True)
    assert ids == prompt + tok.encode("cd", add_special_tokens=False) + [tok.eos_token_id]
    assert mask == [False] * len(prompt) + [True] * 3
    trained = tok.decode([t for t, m in zip(chat_ids, chat_mask) if m])
    assert "yo" in trained and "ok" in trained and "hi" not in trained and "again" not in trained
    with pytest.raises(APIError, match="line 2: not valid JSON"):
        parse_training_file(b'{"prompt": "a", "completion": "b"}\n{oops', tok, 512)
    with pytest.raises(APIError, match="line 1: .* over the limit of 4"):
        parse_training_file(json.dumps({"prompt": "abcdef", "completion": "g"}).encode(), tok, 4)


@pytest.mark.gpu
def test_varlen_attention_gives_the_per_sequence_gradients(base):
    """bf16 on CUDA: one variable-length flash call per layer trains as the call per
    sequence does (same loss and LoRA gradients, within bf16 rounding)."""
    from engine_actors.finetune import VARLEN_ATTENTION
    if not torch.cuda.is_available() or VARLEN_ATTENTION is None:
        pytest.skip("needs a GPU and torch.nn.attention.varlen")
    engine = InProcessEngine("cuda", model=base, dtype="bfloat16", max_num_tokens=4096)
    results = []
    for varlen in (False, True):
        trainer = Trainer(engine.worker.runner.model, 4, 8, TARGETS, lr=1e-3)
        torch.manual_seed(0)
        with torch.no_grad():
            for _, b in trainer.params.values():
                b.normal_()  # so that A gets gradients too
        trainer.varlen = varlen
        out = trainer.micro_step(SEQS, MASKS, 7, last=False)
        results.append((out["loss_sum"], [p.grad.clone() for ab in trainer.params.values()
                                          for p in ab]))
    (loss, grads), (varlen_loss, varlen_grads) = results
    assert varlen_loss == pytest.approx(loss, rel=1e-2)
    for g, h in zip(grads, varlen_grads):
        assert float((h - g).norm() / g.norm()) < 3e-2


def test_training_state_exists_before_a_step_and_steps_as_a_fresh_adamw(base):
    """A step allocates no lasting state (what the KV pool lent it is all free after), and
    the optimizer's first step equals that of an AdamW whose state starts with it."""
    engine = InProcessEngine("cpu", model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, 4, 8, ["q_proj", "down_proj"], lr=1e-2)
    held = trainer.state_bytes()
    params = [p for ab in trainer.params.values() for p in ab]
    with torch.no_grad():
        for p in params:
            p.normal_()  # B starts at zero: random, so both A and B get gradients
    trainer.micro_step(SEQS, MASKS, 7, last=False)
    assert trainer.state_bytes() == held
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.0)
    reference.step()
    trainer.optimizer.step()
    for c, p in zip(copies, params):
        torch.testing.assert_close(p.detach(), c.detach(), rtol=0, atol=0)
    trainer.micro_step(SEQS, MASKS, 7, last=True)
    assert trainer.state_bytes() == held


def _planner(free_bytes, guess=8.0, max_tokens=1000):
    """FineTuning with a worker's memory report: `free_bytes` beside a pool of 64 one-token
    blocks, lent in 8 units of 8 blocks that free 500 bytes each."""
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    from engine_actors.kv_cache import KVCacheManager
    ft = FineTuning(EngineConfig(finetune_max_tokens=max_tokens), adapters=None)
    ft.memory = {"free_bytes": free_bytes, "lend_unit_blocks": 8, "lendable_units": 8,
                 "lend_unit_bytes": 500, "bytes_per_token_guess": guess}
    return ft, KVCacheManager(num_blocks=64, block_size=1, max_num_seqs=4)


def _job(lengths, batch_size=None):
    from engine_actors.finetune_job import Job
    examples = [([1] * n, [True] * n) for n in lengths]
    return Job("j", "m", "f", examples, n_epochs=1, batch_size=batch_size or len(lengths),
               learning_rate=1e-3, lora={}, suffix=None, seed=0, _plan=[list(range(len(lengths)))])


def test_micro_batch_shrinks_to_the_memory_the_kv_pool_can_lend():
    from engine_actors.request import Request, SamplingParams
    ft, kv = _planner(free_bytes=2000)
    job = _job([100] * 10)
    job.bytes_per_token = 8.0  # 10 bytes a token with the margin
    # wants 10,000 bytes for 1,000 tokens: the whole pool gives 4,000 more, 600 tokens
    assert ft.plan(job, kv) == (8, [0, 1, 2, 3, 4, 5])
    assert kv.num_lent_blocks == 64
    kv.take_back()
    held = Request("held", list(range(40)), SamplingParams(max_tokens=1), 0.0)
    kv.admit(held, held.max_num_tokens)  # 41 blocks promised
    kv.grow(held, 40)
    assert ft.plan(job, kv) == (2, [0, 1, 2])  # 23 blocks unpromised: two units
    kv.take_back()
    kv.free(held)
    ft.memory["free_bytes"] = 20000  # enough beside the pool: nothing lent
    assert ft.plan(job, kv) == (0, list(range(10))) and kv.num_lent_blocks == 0
    ft.memory["free_bytes"] = None  # CPU: not bounded
    assert ft.plan(job, kv) == (0, list(range(10))) and kv.num_lent_blocks == 0


def test_until_measured_a_micro_batch_is_one_example_and_lends_only_what_it_needs():
    ft, kv = _planner(free_bytes=1000, guess=40.0)  # 50 bytes a token with the margin
    job = _job([30, 30, 30])
    assert ft.plan(job, kv) == (1, [0])  # 1,500 bytes: 500 short, one unit, not the cap's
    assert kv.num_lent_blocks == 8
    job.take_micro([0])
    job.bytes_per_token = 40.0  # measured: now as many examples as fit
    # 3,000 bytes: 1,000 free and the unit lent already leave 1,500: 3 units more
    assert ft.plan(job, kv) == (4, [1, 2])
    assert kv.num_lent_blocks == 32


def test_an_example_that_cannot_fit_now_waits_without_evicting_cached_blocks():
    from engine_actors.request import Request, SamplingParams
    ft, kv = _planner(free_bytes=0, guess=8.0)  # 10 bytes a token; the pool can give 4,000
    job = _job([300])
    running = Request("r", list(range(64)), SamplingParams(max_tokens=1), 0.0)
    kv.admit(running, 64)
    kv.grow(running, 64)  # every block held: none can be lent now
    evictable = kv.pool.num_available
    assert ft.plan(job, kv) is None
    assert kv.num_lent_blocks == 0 and kv.pool.num_available == evictable


def test_an_example_that_could_never_fit_fails_its_job_with_the_sizes():
    ft, kv = _planner(free_bytes=1000, guess=8.0)  # 10 bytes a token; at most 5,000 bytes
    with pytest.raises(ValueError, match="example of 600 tokens needs .* at most"):
        ft.plan(_job([600]), kv)
    assert kv.num_lent_blocks == 0


def test_lent_blocks_are_not_counted_as_kv_usage():
    ft, kv = _planner(free_bytes=0)
    assert kv.lend(2, 8, 8) == 2
    assert kv.usage == 0.0 and kv.num_lent_blocks == 16


def test_a_micro_batch_takes_the_examples_that_fit_in_order():
    from engine_actors.finetune_job import Job
    examples = [([1] * n, [True] * n) for n in (300, 200, 500)]
    job = Job("j", "m", "f", examples, n_epochs=1, batch_size=3, learning_rate=1e-3,
              lora={}, suffix=None, seed=0)
    job._plan = [[0, 1, 2]]
    assert job.next_micro(250) is None  # the next example alone is over the cap
    assert job.next_micro(600) == ([0, 1], 1000, False)
    assert job.next_micro(400) is None
    assert job.next_micro(500) == ([2], 1000, True)


class _Executor:
    """The workers' side of take_back: fails `failures` times, then maps."""

    def __init__(self, failures):
        import ray
        self.failures, self.calls, self.error = failures, [], ray.exceptions.RayError

    async def finetune(self, method, job_id, *args):
        self.calls.append(method)
        if method == "take_back" and self.failures:
            self.failures -= 1
            raise self.error("cuMemCreate failed with error 2")


@pytest.mark.parametrize("failures,ok", [(0, True), (1, True), (2, False)])
def test_lent_blocks_that_cannot_be_mapped_again_fail_the_job_not_serving(failures, ok):
    import asyncio
    ft, kv = _planner(free_bytes=0)
    job = _job([10])
    job.started, job.status = True, "running"
    ft.jobs[job.id], ft.queue = job, [job]
    kv.lend(2, 8, 8)
    executor = _Executor(failures)
    assert asyncio.run(ft.take_back(executor, kv)) is ok
    assert kv.num_lent_blocks == (0 if ok else 16)  # the pool has them back once mapped
    if failures:  # the running job's trainer held the memory: the job fails, it is freed
        assert job.status == "failed" and "could not be returned" in job.error["message"]
        assert executor.calls[:3] == ["take_back", "drop", "take_back"]
    else:
        assert job.status == "running" and executor.calls == ["take_back"]


def test_a_job_waiting_for_memory_wakes_the_loop_when_it_may_try_again():
    ft, kv = _planner(free_bytes=0)
    assert ft.wake_in(100.0) is None
    ft.queue = [_job([10])]
    ft.retry_at = 100.1
    assert ft.wake_in(100.0) == pytest.approx(0.1)
    assert ft.wake_in(100.2) is None


def test_new_requests_are_held_only_while_a_step_fits_in_their_deferral_bound():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    assert ft.hold_from(10.0, 0.0) is None  # no job
    ft.queue = [_job([10])]
    assert ft.hold_from(10.0, 0.0) is None  # its step time not measured yet
    ft.step_s = 0.05
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.85)  # held while wait + 50 ms <= 200
    # the running batch needs 100 ms to drain: a request may wait 50 ms more at most
    assert ft.hold_from(10.0, 0.1) == pytest.approx(9.95)
    assert ft.hold_from(10.0, 0.2) is None  # it could not drain in time: nothing held
    ft.retry_at = 10.5  # waiting for memory: no step could run
    assert ft.hold_from(10.0, 0.0) is None
    ft.retry_at, ft.step_s = 0.0, 0.3  # a step longer than the bound: never deferred
    assert ft.hold_from(10.0, 0.0) is None


def test_mapping_memory_back_counts_in_the_time_a_step_defers_requests():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    ft.queue = [_job([10])]
    ft.step_s = 0.05
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.85)
    ft.take_back_s = 0.1  # measured: inference resumes 150 ms after a step starts
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.95)
    assert ft.hold_from(10.0, 0.1) is None


def test_a_batch_loss_is_right_when_the_next_batch_was_taken_before_it_was_recorded():
    from engine_actors.finetune_job import Job
    examples = [([1] * 4, [True] * k) for k in (1, 3, 2, 6)]  # trained tokens 1, 3, 2, 6
    job = Job("j", "m", "f", examples, n_epochs=1, batch_size=2, learning_rate=1e-3,
              lora={}, suffix=None, seed=0)
    job._plan = [[0, 1], [2, 3]]
    first = job.next_micro(8)  # the whole first batch (4 trained tokens)
    second = job.next_micro(4)  # sent ahead: the second batch's first example (of 8)
    assert first[1:] == (4, True) and second[1:] == (8, False)
    assert job.record(8, 2.0, *first[1:]) == pytest.approx(0.5)  # 2.0 over 4 tokens
    assert job.record(4, 1.0, *second[1:]) is None
    third = job.next_micro(4)
    assert job.record(4, 3.0, *third[1:]) == pytest.approx(0.5)  # (1.0 + 3.0) over 8
    assert job.steps_done == 2 and job.trained_tokens == 16 and not job.has_next()


def test_memory_per_token_comes_from_the_largest_micro_batch_measured():
    job = _job([10])
    job.measure_memory(3000, 10)  # one short example: its fixed costs weigh 300 a token
    assert job.bytes_per_token == 300
    job.measure_memory(100_000, 1000)  # a full micro-batch: 100 a token
    assert job.bytes_per_token == 100
    job.measure_memory(2000, 10)  # smaller than the one measured: not used
    job.measure_memory(120_000, 1000)  # as large and worse: used
    assert job.bytes_per_token == 120


def test_a_step_longer_than_the_bound_runs_only_after_a_lull():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning

    class Idle:  # the scheduler: nothing running or waiting
        num_running, waiting = 0, []

    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    ft.queue = [_job([10])]
    assert ft.wants_step(Idle, 10.0, last_arrival=9.99)  # step time unknown: FineInfer's rule
    ft.step_s = 0.15  # within the bound: whoever comes waits at most the bound
    assert ft.wants_step(Idle, 10.0, last_arrival=9.99)
    ft.step_s = 0.3  # longer: it would hold a request that comes during it past the bound
    assert not ft.wants_step(Idle, 10.0, last_arrival=9.5)
    assert ft.wants_step(Idle, 10.0, last_arrival=9.39)  # none for twice its time
    assert ft.wants_step(Idle, 10.0)  # none ever


def test_a_micro_batch_called_off_before_it_started_runs_next():
    import asyncio
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning

    class Executor:  # the workers: micro-batch 2 is called off before it starts
        def __init__(self):
            self.skipped, self.device = set(), asyncio.Lock()  # calls run in order

        def skip_training(self, seq):
            self.skipped.add(seq)

        async def finetune(self, method, job_id, seq, after, units, seqs, *rest):
            async with self.device:
                if seq in self.skipped:
                    return {"skipped": True, "free_bytes": None}
                await asyncio.sleep(0.05)
            return {"loss_sum": 1.0, "tokens": sum(map(len, seqs)), "peak_bytes": None,
                    "elapsed_s": 0.01, "free_bytes": None}

    ft = FineTuning(EngineConfig(finetune_max_tokens=10), adapters=None)
    ft.memory = {"free_bytes": None}  # CPU: micro-batches bounded by the token cap alone
    job = _job([10, 10, 10, 10])  # one example a micro-batch
    job.started, job.status = True, "running"
    ft.jobs[job.id], ft.queue = job, [job]
    executor = Executor()

    async def run():
        first = asyncio.create_task(ft.step(executor, None, pipeline=lambda: True))
        await asyncio.sleep(0.02)  # example 0 runs, 1 was sent ahead
        assert ft.ahead.micro == [1]
        ft.skip_ahead(executor)  # a request came
        await first
        assert job.trained_tokens == 10
        await ft.step(executor, None)  # the answer: skipped
        assert ft.ahead is None and job.trained_tokens == 10 and job._rest == [1, 2, 3]
        await ft.step(executor, None)  # example 1 now
        assert job.trained_tokens == 20 and job._rest == [2, 3]

    asyncio.run(run())


def test_a_worker_skips_a_micro_batch_called_off_before_it_starts(base):
    """The worker's side of `skip_ahead`: a called-off micro-batch changes nothing (its
    gradients are not accumulated), and the next one runs."""
    import asyncio
    engine = InProcessEngine(model=base, dtype="float32")
    worker = engine.worker
    worker._finetune("start", "job", 4, 16, ["q_proj"], 1e-2, 0)
    b = worker.trainers["job"].params["0", "q_proj"][1]  # A's gradient is 0 while B is
    seq, mask = [7, 8, 9, 10, 11, 12], [False, False, True, True, True, True]
    asyncio.run(worker.skip_training(1))
    out = worker._finetune("micro_step", "job", 1, -1, 0, [seq], [mask], 4, False)
    assert out["skipped"] and not b.grad.any()
    out = worker._finetune("micro_step", "job", 2, -1, 0, [seq], [mask], 4, False)
    assert out["tokens"] == 6 and b.grad.any()


def test_a_worker_runs_a_micro_batch_sent_ahead_after_the_one_it_follows(base):
    """An async actor may start calls out of order: the one sent ahead waits for its
    predecessor to reach the launch thread."""
    import asyncio
    worker = InProcessEngine(model=base, dtype="float32").worker
    ran = []
    worker._finetune = lambda method, job_id, seq, *rest: ran.append(seq)

    async def run():
        ahead = asyncio.create_task(worker.finetune("micro_step", "job", 8, 7))  # first here
        await asyncio.sleep(0.05)
        assert not ran  # it waits for 7
        await worker.finetune("micro_step", "job", 7, -1)
        await ahead

    asyncio.run(run())
    assert ran == [7, 8]


def test_the_loop_wakes_when_a_lull_is_long_enough_for_a_long_step():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    ft.queue = [_job([10])]
    ft.step_s = 0.3  # longer than the bound: it needs 0.6 s without arrivals
    assert ft.wake_in(10.0, last_arrival=9.9) == pytest.approx(0.5)
    assert ft.wake_in(10.0, last_arrival=9.0) is None
    ft.step_s = 0.1  # within the bound: no lull needed
    assert ft.wake_in(10.0, last_arrival=9.9) is None
