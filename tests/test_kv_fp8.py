"""An FP8 KV cache (kv_cache_dtype "fp8", "fp8_e5m2"): greedy outputs equal transformers'
(fp32) with its keys and values rounded to the same format, each divided by its layer's
scale (1.0, or the checkpoint's k_scale / v_scale in the formats vLLM reads) and multiplied
back; the pool takes half the bytes of bf16; formats and scales the engine cannot serve
are refused at start. The rounding below is this test's own (an attention function
registered with transformers), not the engine's."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine_actors.checkpoint import save_random_checkpoint
from engine_actors.config import ConfigError, EngineConfig
from tests.engine_harness import InProcessEngine, hf_greedy
from tests.test_parity import ragged_workload

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}
# layer -> (k_scale, v_scale) written into a checkpoint (the tiny model has 4 layers)
SCALES = {0: (0.5, 2.0), 1: (4.0, 0.25), 2: (1.5, 1.5), 3: (0.125, 8.0)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_random_checkpoint(str(path), "llama", seed=5)
    return path


def rounded_reference(model_dir, dtype: torch.dtype, scales: dict):
    """transformers' model whose attention sees keys and values rounded to `dtype` after
    division by their layer's scale, then multiplied back (as an FP8 pool stores them)."""
    limit = torch.finfo(dtype).max

    def rounded(x, scale):
        return (x / scale).clamp(-limit, limit).to(dtype).to(x.dtype) * scale

    def attention(module, q, k, v, *args, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return sdpa_attention_forward(module, q, rounded(k, k_scale), rounded(v, v_scale),
                                      *args, **kwargs)
    name = f"kv_rounded_{id(attention)}"
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation=name).eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine(model, **args) -> InProcessEngine:
    return InProcessEngine(model=str(model), max_batch_size=8, block_size=4,
                           max_num_batched_tokens=24, max_num_tokens=4096, **args)


def check_against(reference, eng: InProcessEngine, seed: int) -> dict:
    """Every request's greedy tokens equal the reference's; returns the outputs."""
    arrivals = ragged_workload(seed)
    outputs = eng.run(arrivals)
    for reqs in arrivals.values():
        for rid, prompt, sampling in reqs:
            assert outputs[rid] == greedy(reference, prompt, sampling.max_tokens), rid
    return {rid: (prompt, s.max_tokens, outputs[rid])
            for reqs in arrivals.values() for rid, prompt, s in reqs}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_matches_transformers_with_rounded_keys_and_values(base, kv_cache_dtype):
    eng = engine(base, kv_cache_dtype=kv_cache_dtype)
    k_cache, v_cache = eng.worker.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == FORMATS[kv_cache_dtype]
    outputs = check_against(rounded_reference(base, FORMATS[kv_cache_dtype], {}), eng, seed=3)
    # the rounding changes outputs of this model: the check above can fail
    assert any(out != hf_greedy(str(base), prompt, n) for prompt, n, out in outputs.values())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_on_gpu_matches_transformers_with_rounded_keys_and_values(
        base, tmp_path, kv_cache_dtype):
    """The Triton kernels (the pool written and read in graphs of decode and mixed steps), in
    fp32, with the checkpoint's scales."""
    scaled = with_scales(base, tmp_path / "scaled",
                         {i: {"k_scale": k, "v_scale": v} for i, (k, v) in SCALES.items()})
    eng = InProcessEngine(device="cuda", model=str(scaled), dtype="float32", max_batch_size=8,
                          max_num_batched_tokens=24, max_num_tokens=4096,
                          kv_cache_dtype=kv_cache_dtype)
    reference = rounded_reference(base, FORMATS[kv_cache_dtype], SCALES).cuda()
    check_against(reference, eng, seed=11)
    runner = eng.worker.runner
    assert runner.num_graph_replays > 0 and runner.num_mixed_replays > 0


def test_the_pool_holds_keys_and_values_in_one_byte(base):
    plain, fp8 = engine(base).worker.runner, engine(base, kv_cache_dtype="fp8").worker.runner
    assert plain.kv_caches[0][0].dtype == torch.float32  # (fp32 on CPU)
    assert fp8.kv_bytes_per_block() * 4 == plain.kv_bytes_per_block()
    assert fp8.kv_caches[0][0].untyped_storage().nbytes() * 4 == \
        plain.kv_caches[0][0].untyped_storage().nbytes()


def with_scales(src, dst, names: dict[int, dict[str, float]]):
    """A copy of checkpoint `src` with extra scalar tensors: layer -> {name: value}."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for layer, scales in names.items():
        for name, value in scales.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


CHECKPOINT_NAMES = {  # how checkpoints name a layer's KV scales (vLLM reads each)
    "k_scale": lambda k, v: {"k_scale": k, "v_scale": v},
    "output_scale": lambda k, v: {"k_proj.output_scale": k, "v_proj.output_scale": v},
}


@pytest.mark.parametrize("naming", sorted(CHECKPOINT_NAMES))
def test_a_checkpoints_kv_scales_divide_what_the_pool_stores(base, tmp_path, naming):
    scaled = with_scales(base, tmp_path / "scaled",
                         {i: CHECKPOINT_NAMES[naming](*s) for i, s in SCALES.items()})
    outputs = check_against(rounded_reference(base, torch.float8_e4m3fn, SCALES),
                            engine(scaled, kv_cache_dtype="fp8"), seed=4)
    # the scales change outputs of this model: the check above can fail
    unscaled = rounded_reference(base, torch.float8_e4m3fn, {})
    assert any(out != greedy(unscaled, prompt, n) for prompt, n, out in outputs.values())


def test_one_kv_scale_serves_keys_and_values(base, tmp_path):
    """An older format's `kv_scale`: the same scale for both (as vLLM reads it)."""
    scaled = with_scales(base, tmp_path / "scaled", {i: {"kv_scale": 2.0} for i in range(4)})
    check_against(rounded_reference(base, torch.float8_e4m3fn,
                                    {i: (2.0, 2.0) for i in range(4)}),
                  engine(scaled, kv_cache_dtype="fp8"), seed=5)


def test_a_pool_in_the_models_dtype_ignores_kv_scales(base, tmp_path):
    scaled = with_scales(base, tmp_path / "scaled",
                         {i: {"k_scale": 4.0, "v_scale": 0.25, "q_scale": 1.0}
                          for i in range(4)})
    eng = engine(scaled)
    arrivals = ragged_workload(seed=3)
    outputs = eng.run(arrivals)
    for reqs in arrivals.values():
        for rid, prompt, sampling in reqs:
            assert outputs[rid] == hf_greedy(str(base), prompt, sampling.max_tokens), rid


SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
          "symmetric": True}


def test_an_fp8_kv_release_is_served_with_its_scales(base, tmp_path):
    """llm-compressor's FP8 weights with a kv_cache_scheme (RedHatAI's "FP8-KV" releases):
    the weights per channel, and a k_scale and v_scale per layer."""
    from tests.test_fp8 import FORMATS as WEIGHT_FORMATS, write_fp8_checkpoint
    config, block, scale_name = WEIGHT_FORMATS["compressed-tensors-channel"]
    fmt = ({**config, "kv_cache_scheme": SCHEME}, block, scale_name)
    write_fp8_checkpoint(base, tmp_path / "fp8", tmp_path / "ref", fmt)
    scaled = with_scales(tmp_path / "fp8", tmp_path / "scaled",
                         {i: {"k_scale": k, "v_scale": v} for i, (k, v) in SCALES.items()})
    check_against(rounded_reference(tmp_path / "ref", torch.float8_e4m3fn, SCALES),
                  engine(scaled, kv_cache_dtype="fp8"), seed=6)


@pytest.mark.parametrize("change", [{"strategy": "attn_head"}, {"dynamic": True},
                                    {"num_bits": 4, "type": "int"}])
def test_kv_cache_schemes_not_served_are_refused_at_start(base, tmp_path, change):
    from tests.test_fp8 import FORMATS as WEIGHT_FORMATS, write_fp8_checkpoint
    config, block, scale_name = WEIGHT_FORMATS["compressed-tensors-channel"]
    fmt = ({**config, "kv_cache_scheme": {**SCHEME, **change}}, block, scale_name)
    write_fp8_checkpoint(base, tmp_path / "fp8", tmp_path / "ref", fmt)
    with pytest.raises(ValueError, match="kv_cache_scheme .* is not supported"):
        engine(tmp_path / "fp8", kv_cache_dtype="fp8")


def test_a_kv_scale_that_is_not_one_positive_value_is_refused(base, tmp_path):
    scaled = with_scales(base, tmp_path / "scaled", {1: {"k_scale": 0.0}})
    with pytest.raises(ValueError, match="k_scale must be one positive value"):
        engine(scaled, kv_cache_dtype="fp8")


def test_unknown_kv_cache_dtypes_are_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_args({"kv_cache_dtype": "int8"})
