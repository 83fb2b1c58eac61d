"""LoRA adapters: greedy fp32 parity with transformers + peft for requests of three
adapters (different ranks and targets) and of the base model mixed in the same iterations;
the slot pool (LRU eviction, waiting for a slot); the Triton kernels against their torch
reference; adapters that cannot be served refused clearly."""
from __future__ import annotations

import asyncio
import json
import pathlib
import random
import types

import numpy as np
import pytest
import torch

from engine_actors.checkpoint import save_random_llama
from engine_actors.lora import LoRARegistry, LoRASlots
from engine_actors.lora_files import AdapterInfo, LoRAError
from engine_actors.request import SamplingParams
from kernels.lora import group_tokens, lora_ref, lora_triton, max_tiles
from tests.engine_harness import InProcessEngine, hf_greedy

peft = pytest.importorskip("peft")

# name -> (rank, alpha, targets)
ADAPTERS = {"sql": (2, 4, ["q_proj", "v_proj"]),
            "chat": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"]),
            "code": (4, 8, ["o_proj", "gate_proj", "down_proj"])}


def save_adapter(base_dir: str, out_dir: str, rank: int, alpha: int, targets: list[str],
                 seed: int) -> None:
    """A random PEFT LoRA adapter (B random too, so it changes the outputs)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # small updates: the adapted model stays a plausible LM
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    model.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    save_random_llama(base, seed=5)
    paths = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        save_adapter(base, paths[name], rank, alpha, targets, seed=10 + i)
    return base, paths


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """transformers + peft generate(), greedy, fp32 (the base model for adapter None)."""
    if adapter is None:
        return hf_greedy(base, prompt, n)
    key = ("peft", adapter)
    if key not in _peft_models:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        _peft_models[key] = peft.PeftModel.from_pretrained(model, adapter).eval()
    model = _peft_models[key]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_peft_models: dict = {}


def test_adapters_change_the_model(models):
    base, paths = models
    prompt = list(range(40, 60))
    outs = {name: peft_greedy(base, path, prompt, 8) for name, path in paths.items()}
    outs["base"] = peft_greedy(base, None, prompt, 8)
    assert len({tuple(o) for o in outs.values()}) == 4, outs  # the test can tell them apart


@pytest.mark.parametrize("device,overlap", [
    ("cpu", True), ("cpu", False),
    pytest.param("cuda", True, marks=pytest.mark.gpu)])  # Triton kernels, CUDA graphs
def test_mixed_adapters_match_transformers_peft(models, device, overlap, tmp_path):
    """Three adapters and the base model in the same iterations, ragged prompts arriving over
    time, two slots for three adapters (adapters are evicted and requests wait for a slot).
    The adapters' directories are gone once they are added: they are read once."""
    import shutil
    base, paths = models
    copies = {name: str(shutil.copytree(path, tmp_path / name)) for name, path in paths.items()}
    engine = InProcessEngine(device, model=base, dtype="float32", lora_modules=copies,
                             max_loras=2, max_lora_rank=8,
                             max_batch_size=8, block_size=4, max_num_batched_tokens=64,
                             max_num_tokens=2048, async_scheduling=overlap)
    shutil.rmtree(tmp_path)
    rng = random.Random(2)
    shared = [rng.randrange(256) for _ in range(12)]  # same tokens, different adapters
    arrivals, expected = {}, {}
    for i in range(18):
        adapter = [None, "sql", "chat", "code"][i % 4]
        prompt = (shared if i < 8 else []) + [rng.randrange(256)
                                               for _ in range(rng.randint(1, 30))]
        n = rng.randint(1, 16)
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        arrivals.setdefault(rng.randint(0, 12), []).append((f"r{i}", prompt, sampling, adapter))
        expected[f"r{i}"] = peft_greedy(base, paths.get(adapter), prompt, n)
    outputs = engine.run(arrivals)
    for rid, tokens in expected.items():
        assert outputs[rid] == tokens, rid
    # some iteration ran tokens of two adapters and the base model together
    slot_of_row: dict[int, int] = {}
    mixed = False
    for step in engine.steps:
        for r in step.new_requests:
            slot_of_row[r.row] = r.lora_slot
        slots = {slot_of_row[row] for row in step.rows}
        mixed |= len(slots) >= 3 and -1 in slots
    assert mixed, "no iteration mixed adapters with the base model"
    loads = [load for step in engine.steps for load in step.lora_loads]
    assert len(loads) > 2, "three adapters in two slots: some adapter was loaded again"
    s = engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks and sum(s.loras.refs) == 0
    if device == "cuda":
        assert engine.worker.runner.num_graph_replays > 0


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "granite"])
def test_an_adapter_on_other_layers_matches_transformers_peft(model_type, tmp_path):
    """Gemma's layers (four norms, GELU; Gemma 2's soft caps) and Granite's (scaled
    sublayers) with every projection adapted."""
    from engine_actors.checkpoint import save_random_checkpoint
    from tests.test_architectures import GEMMA2, GEMMA3, GRANITE
    base, adapter = str(tmp_path / "base"), str(tmp_path / "all")
    save_random_checkpoint(base, model_type, seed=4, **{
        "gemma2": GEMMA2, "gemma3_text": GEMMA3, "granite": GRANITE}[model_type])
    save_adapter(base, adapter, 8, 16, ADAPTERS["chat"][2], seed=6)
    check_against_peft(base, adapter)


@pytest.mark.parametrize("targets", [["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                                     ["qkv_proj"]], ids=["all", "qkv"])
def test_an_adapter_of_phi3s_fused_projections_matches_transformers_peft(targets, tmp_path):
    """Phi-3's only projections in transformers are fused (qkv_proj, gate_up_proj), and so
    are its adapters' A and B: served as one A per part and B split by part; with GQA (one
    KV head), the parts differ in size."""
    from engine_actors.checkpoint import save_random_checkpoint
    base, adapter = str(tmp_path / "base"), str(tmp_path / "fused")
    save_random_checkpoint(base, "phi3", seed=4, num_key_value_heads=1)
    save_adapter(base, adapter, 8, 16, targets, seed=6)
    check_against_peft(base, adapter)


def test_phi3s_fused_adapter_shards_over_two_ranks(tmp_path):
    """Each of two tensor-parallel ranks holds its heads' rows of every part's B (the fused
    B split by part, then sharded) and its columns of o/down's A: the ranks' low-rank
    updates, put together, are the one worker's (GQA with one KV head: replicated)."""
    from engine_actors.checkpoint import save_random_checkpoint
    from engine_actors.layers.lora import load_adapter
    from engine_actors.model_runner import ModelRunner
    from engine_actors.parallel import ParallelGroup
    base, adapter = str(tmp_path / "base"), str(tmp_path / "fused")
    save_random_checkpoint(base, "phi3", seed=4, num_key_value_heads=1)
    save_adapter(base, adapter, 8, 16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                 seed=6)
    data = (pathlib.Path(adapter) / "adapter_model.safetensors").read_bytes()
    layers = []
    for parallel in [None, ParallelGroup(0, 2, 0, 1), ParallelGroup(1, 2, 0, 1)]:
        runner = ModelRunner(base, "cpu", torch.float32, 256, 16, 4, 0, lora=(2, 8),
                             **({"parallel": parallel} if parallel else {}))
        load_adapter(runner.model, 1, data, 2.0)
        layers.append(runner.model.layers["1"])

    def update(module, x):  # slot 1's low-rank update of x
        return x @ module.lora.a[1].T @ module.lora.b[1].T
    x = torch.randn(3, 64)
    for path in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        whole, *ranks = (layer.get_submodule(path) for layer in layers)
        want = update(whole, x).split(whole.part_sizes, -1)
        got = [update(m, x).split(m.part_sizes, -1) for m in ranks]
        for p, expected in enumerate(want):
            if got[0][p].shape == expected.shape:  # (a replicated KV head: on both ranks)
                for rank in got:
                    torch.testing.assert_close(rank[p], expected)
            else:
                torch.testing.assert_close(torch.cat([rank[p] for rank in got], -1), expected)
    for path, width in (("self_attn.o_proj", 64), ("mlp.down_proj", 176)):
        whole, *ranks = (layer.get_submodule(path) for layer in layers)
        y = torch.randn(3, width)
        halves = [y[:, :width // 2], y[:, width // 2:]]
        torch.testing.assert_close(sum(update(m, h) for m, h in zip(ranks, halves)),
                                   update(whole, y))


def test_an_adapter_of_projections_the_model_lacks_is_refused(models, tmp_path):
    """A Phi-3 adapter (fused qkv_proj) offered to a Llama: refused when added."""
    from engine_actors.checkpoint import save_random_checkpoint
    phi3 = str(tmp_path / "phi3")
    save_random_checkpoint(phi3, "phi3", seed=4)
    save_adapter(phi3, str(tmp_path / "fused"), 8, 16, ["qkv_proj"], seed=6)
    with pytest.raises(LoRAError, match="adapts qkv_proj, which this model does not have"):
        LoRARegistry(max_rank=8, model=model_of(models[0])).read("fused", str(tmp_path / "fused"))


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
def test_an_adapter_of_a_mixture_of_experts_attention_matches_transformers_peft(name, tmp_path):
    """The attention projections adapted on every layer, sparse and dense (Qwen3-MoE's
    mlp_only_layers); an adapter of the MLPs is refused when added: peft adapts the experts'
    weights (target_parameters) and Qwen2-MoE's shared expert, which this engine does not."""
    from engine_actors.checkpoint import save_random_checkpoint
    from tests.test_architectures import CHECKPOINTS
    base, adapter = str(tmp_path / "base"), str(tmp_path / "attention")
    save_random_checkpoint(base, CHECKPOINTS[name][0], seed=4, **CHECKPOINTS[name][1])
    save_adapter(base, adapter, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=6)
    check_against_peft(base, adapter)
    save_adapter(base, str(tmp_path / "mlp"), 8, 16, ADAPTERS["chat"][2], seed=6)
    with pytest.raises(LoRAError, match="a mixture of experts' experts"):
        LoRARegistry(max_rank=8, model=model_of(base)).read("mlp", str(tmp_path / "mlp"))


def check_against_peft(base: str, adapter: str, served: str | None = None,
                       device: str = "cpu") -> None:
    """Eight requests, every other one with the adapter: transformers + peft's tokens (the
    engine serving `served`, if given: base's weights in another format)."""
    engine = InProcessEngine(device=device, model=served or base, dtype="float32",
                             lora_modules={"all": adapter},
                             max_lora_rank=8, max_batch_size=8, block_size=4,
                             max_num_batched_tokens=64, max_num_tokens=2048)
    rng = random.Random(5)
    arrivals, expected = {0: []}, {}
    for i in range(8):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        name = "all" if i % 2 else None
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        arrivals[0].append((f"r{i}", prompt, sampling, name))
        expected[f"r{i}"] = peft_greedy(base, adapter if name else None, prompt, 8)
    assert engine.run(arrivals) == expected
    assert len({tuple(v) for v in expected.values()}) == 8  # (the adapter changes outputs)


def model_of(base: str) -> tuple[dict, int, tuple[int, ...]]:
    from engine_actors.checkpoint import model_info
    from engine_actors.config import EngineConfig
    info = model_info(EngineConfig(model=base))
    return info.lora_shapes, info.num_layers, info.moe_layers


def test_adapter_over_max_rank_and_unsupported_ones_are_refused(models, tmp_path):
    base, paths = models
    registry = LoRARegistry(max_rank=4, model=model_of(base))
    with pytest.raises(LoRAError, match="rank 8, over max_lora_rank 4"):
        registry.add("chat", paths["chat"])
    registry.add("sql", paths["sql"])
    with pytest.raises(LoRAError, match="already loaded"):
        registry.add("sql", paths["code"])
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        registry.add("nothing", str(tmp_path))
    cfg = json.loads(open(f"{paths['code']}/adapter_config.json").read())
    for i, (change, message) in enumerate([
            ({"use_dora": True}, "use_dora"),
            ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
            ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
            ({"target_modules": [["q_proj"]]}, "must list module names"),
            ({"target_modules": 5}, "must list module names"),
            ({"r": True}, "bad rank"),
            ({"lora_alpha": "8"}, "lora_alpha must be a finite number"),
            ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
            ([1, 2], "not a JSON object")]):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        text = json.dumps({**cfg, **change} if isinstance(change, dict) else change)
        (bad / "adapter_config.json").write_text(text)
        (bad / "adapter_model.safetensors").write_bytes(b"")
        with pytest.raises(LoRAError, match=message):
            registry.add(bad.name, str(bad))
    (tmp_path / "bad0" / "adapter_config.json").write_text("[" * 100_000)
    with pytest.raises(LoRAError, match="is not JSON"):
        registry.add("deep", str(tmp_path / "bad0"))
    assert registry.remove("sql").name == "sql"
    with pytest.raises(LoRAError, match="no LoRA adapter named"):
        registry.remove("sql")


def altered_copy(src: str, dst, change) -> str:
    """A copy of the adapter at src whose tensors went through change(dict)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    (dst / "adapter_config.json").write_text(open(f"{src}/adapter_config.json").read())
    tensors = load_file(f"{src}/adapter_model.safetensors")
    changed = change(tensors)  # a new dict, or None: changed in place
    save_file(tensors if changed is None else changed, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_adapters_whose_tensors_do_not_fit_the_model_are_refused(models, tmp_path):
    """An adapter of another model (a bigger hidden size), a tensor of a layer the model
    lacks, an integer or a non-finite tensor, or a truncated file is refused when added,
    not in a worker's step."""
    base, paths = models
    other = tmp_path / "other-base"
    save_random_llama(str(other), seed=5, hidden_size=96)
    save_adapter(str(other), str(tmp_path / "other"), 4, 8, ["o_proj", "gate_proj"], seed=3)
    layer = "base_model.model.model.layers.{}.self_attn.o_proj.lora_{}.weight"

    def copy(name, change):
        return altered_copy(paths["code"], tmp_path / name, change)
    in_layers = "in the model's 4 layers"
    bad = {"other": (str(tmp_path / "other"), r"has shape \[(4, 96|96, 4)\], not "),
           "layer9": (copy("layer9", lambda t: t.update(
               {layer.format(9, "A"): t[layer.format(0, "A")].clone()})), in_layers),
           "layer²": (copy("layer²", lambda t: {k.replace(".0.", ".²."): v
                                                for k, v in t.items()}), in_layers),
           "ints": (copy("ints", lambda t: {k: v.to(torch.int32) for k, v in t.items()}),
                    r"dtype torch\.int32, not a float"),
           "inf": (copy("inf", lambda t: {**t, layer.format(1, "B"): torch.full_like(
               t[layer.format(1, "B")], float("inf"))}), "not finite"),
           "cut": (copy("cut", lambda t: None), "cannot read")}
    cut = tmp_path / "cut" / "adapter_model.safetensors"
    cut.write_bytes(cut.read_bytes()[:200])
    shapes, num_layers, _ = model_of(base)
    assert num_layers == 4 and shapes["o_proj"] == (64, 64) and shapes["k_proj"] == (64, 32)
    registry = LoRARegistry(max_rank=8, model=(shapes, num_layers))
    for name, (path, message) in bad.items():
        with pytest.raises(LoRAError, match=message):
            registry.add(name, path)
    assert sorted(registry.adapters) == []
    for name, path in paths.items():  # every adapter of this model fits
        registry.add(name, path)
    # a configured adapter is read once the model is known, and fails the start
    from engine_actors.config import EngineConfig
    from engine_actors.lora import Adapters
    adapters = Adapters(EngineConfig(model=base, lora_modules={
        "code": paths["code"], "other": bad["other"][0]}))
    adapters.load_configured()  # (its config is fine)
    engine = types.SimpleNamespace(
        info=types.SimpleNamespace(lora_shapes=shapes, num_layers=num_layers, moe_layers=()),
        scheduler=types.SimpleNamespace(loras=None))
    with pytest.raises(LoRAError, match="'other'"):
        asyncio.run(adapters.know_engine(engine))
    # the same model with experts in layers 1 and 3: an adapter of every MLP does not fit
    experts = LoRARegistry(max_rank=8, model=(shapes, num_layers, (1, 3)))
    experts.add("sql", paths["sql"])  # (attention only)
    with pytest.raises(LoRAError, match="adapts the MLP of layer [13], a mixture of experts"):
        experts.add("chat", paths["chat"])


def info(i: int) -> AdapterInfo:
    return AdapterInfo(f"a{i}", "/x", 4, 1.0, ("q_proj",), i)


def test_a_multimodal_models_adapter_is_served_without_its_vision_tensors(models, tmp_path):
    """peft's default targets adapt a multimodal model's vision tower too: its tensors
    (of other shapes, in layers numbered as the text model's) are left out, since the
    server runs text only; the adapter serves as the same adapter without them."""
    base, paths = models
    vision = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn." \
             "q_proj.lora_{}.weight"
    with_vision = altered_copy(paths["code"], tmp_path / "vis", lambda t: t.update({
        vision.format("A"): torch.ones(4, 1152), vision.format("B"): torch.ones(1152, 4),
        "base_model.model.model.multi_modal_projector.proj.lora_A.weight": torch.ones(4, 8)}))
    engine = InProcessEngine(model=base, dtype="float32", max_lora_rank=8, max_batch_size=4,
                             lora_modules={"code": paths["code"], "vis": with_vision},
                             block_size=4, max_num_batched_tokens=64, max_num_tokens=1024)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(30, 50))
    out = engine.run({0: [("a", prompt, sampling, "code"), ("b", prompt, sampling, "vis")]})
    assert out["a"] == out["b"] == peft_greedy(base, paths["code"], prompt, 8)


def test_slots_evict_the_least_recently_used_unused_adapter():
    slots = LoRASlots(2)
    assert slots.acquire(info(1)) == (0, True)
    assert slots.acquire(info(2)) == (1, True)
    assert slots.acquire(info(1)) == (0, False)  # resident: no load
    assert not slots.has_room_for(info(3), set())  # both slots in use: a3 waits
    slots.release(0)
    slots.release(0)
    slots.release(1)
    # a2's slot was released last: a1's is the least recently used and goes first
    assert slots.has_room_for(info(3), set())
    assert slots.acquire(info(3)) == (0, True)
    assert slots.acquire(info(2)) == (1, False)
    slots.release(1)
    # a kept adapter's unused slot is not evicted for a load of the same iteration
    assert not slots.has_room_for(info(4), {2})
    slots.release(0)
    assert slots.acquire(info(4), keep={3}) == (1, True)
    assert slots.resident == ["a3", "a4"]


def test_an_adapter_unloaded_while_its_requests_run_and_wait_serves_them_all():
    """One slot; a request of adapter x runs and another of x waits when x is unloaded:
    the waiting one shares the resident slot (a reload would need a free slot, and the
    scheduler crashed looking for one), and the slot is free once both are done."""
    from engine_actors.config import EngineConfig
    from engine_actors.lora import Adapters
    from engine_actors.request import Request
    from engine_actors.scheduler import Scheduler
    from tests.fake_runner import FakeRunner
    cfg = EngineConfig(block_size=4, enable_lora=True, max_loras=1)
    scheduler = Scheduler.from_config(cfg, 64, 512, (0,))
    adapters = Adapters(cfg)
    x = info(1)
    adapters.registry.adapters["a1"], adapters.slots = x, scheduler.loras
    runner = FakeRunner(4)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    scheduler.add(Request("a", [1, 2, 3, 4, 5], sampling, 0.0, lora=x))
    batch = scheduler.schedule()
    scheduler.add(Request("b", [6, 7, 8], sampling, 1.0, lora=x))
    assert adapters.unload("a1") is None
    finished, loads = set(), list(batch.step.lora_loads)
    while batch is not None:
        outputs = scheduler.process(batch, runner.execute(batch.step))
        finished |= {o.request_id for o in outputs if o.finish_reason is not None}
        batch = scheduler.schedule()
        loads += list(batch.step.lora_loads) if batch is not None else []
    assert finished == {"a", "b"} and len(loads) == 1  # loaded once, shared by b
    assert scheduler.loras.resident == [] and scheduler.loras.has_room_for(info(2), set())


# CPU: the Triton interpreter in fp32. GPU: compiled, in bf16 and fp32.
@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32, id="interpreter-fp32"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu)])
def test_lora_kernels_match_the_reference(device, dtype):
    torch.manual_seed(0)
    # prefill and decode of three adapters and the base model, interleaved; slot 0 has more
    # than one tile of tokens
    lens, slots = [1, 37, 1, 5, 16, 1, 3], [2, 0, -1, 1, 2, 0, -1]
    token_slots = np.repeat(slots, lens)
    t, k, n, r = len(token_slots), 600, 200, 24  # K split over 3 programs, the last partial
    x = torch.randn(t, k, device=device, dtype=dtype)
    a = torch.randn(3, r, k, device=device, dtype=dtype) / 8
    b = torch.randn(3, n, r, device=device, dtype=dtype) / 8
    y = torch.randn(t, n, device=device, dtype=dtype)
    order, tiles = group_tokens(token_slots)
    assert len(tiles) == 6 and len(tiles) <= max_tiles(t, 3)  # 38, 5 and 17 tokens
    # a graph's padding: empty tiles and unused order entries
    tiles += [(0, 0, -1)] * 3
    order = np.concatenate([order, np.zeros(t - len(order), np.int32)])
    expected = y.clone().float()
    for i, slot in enumerate(token_slots):  # token by token, from the definition
        if slot >= 0:
            expected[i] += (x[i].float() @ a[slot].float().T) @ b[slot].float().T
    out = lora_triton(y.clone(), x, a, b, torch.tensor(order, device=device),
                      torch.tensor(tiles, dtype=torch.int32, device=device))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    base = torch.from_numpy(token_slots < 0).to(device)
    assert torch.equal(out[base], y[base])  # the base model's tokens: untouched
    ref = lora_ref(y.clone().float(), x.float(), a.float(), b.float(), token_slots)
    torch.testing.assert_close(ref, expected, rtol=1e-4, atol=1e-4)  # the base model's token: untouched
