"""FP8 mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): checkpoints whose experts are
stored in e4m3 with block, row or tensor scales, and online quantization, each served with
greedy outputs equal to transformers' on the same weights dequantized (fp32); two ranks'
shards of experts and scales; the fused kernel's e4m3 path against a loop over pairs. The
quantization and dequantization are tests/test_fp8.py's own loops, not the engine's."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_actors.checkpoint import save_random_checkpoint
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ParallelGroup
from tests.engine_harness import InProcessEngine
from tests.test_architectures import CHECKPOINTS
from tests.test_fp8 import (E4M3, FORMATS, blocks, dequantize, engine, quantize,
                            rows_reference, write_fp8_checkpoint)
from tests.test_parity import check_parity, ragged_workload

# the attention's and dense MLPs' projections (a shared expert's too) and every expert's
# (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2); never the router or the shared expert's gate
PROJECTIONS = re.compile(r"layers\.\d+\.(?:self_attn\.\w+_proj|mlp\.(?:shared_expert\.)?\w+_proj"
                         r"|(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+)\.weight$")


def moe_checkpoint(path, name: str, **overrides) -> None:
    model_type, kwargs = CHECKPOINTS[name]
    save_random_checkpoint(str(path), model_type, seed=5, **{**kwargs, **overrides})


def experts_of(runner: ModelRunner, layer: str = "0"):
    return runner.model.layers[layer].mlp


@pytest.mark.parametrize("name,fmt", [
    ("qwen3-moe", "fp8-blocks"),  # 16 x 32 blocks
    ("qwen3-moe", "compressed-tensors-channel"),
    ("qwen3-moe", "compressed-tensors-tensor-static"),
    ("qwen2-moe", "fp8-blocks"),  # with its shared expert's projections in FP8 too
    ("mixtral", "compressed-tensors-blocks"),  # w1/w3/w2
    ("mixtral", "fp8-blocks"),  # 48 intermediate features: the down projection's last
])                              # column block is half a block
def test_fp8_experts_match_transformers_on_their_dequantized_weights(tmp_path, name, fmt):
    moe_checkpoint(tmp_path / "base", name)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", FORMATS[fmt],
                         PROJECTIONS)
    served = engine(tmp_path / "fp8")
    moe = experts_of(served.worker.runner)
    assert moe.w13.dtype == moe.w2.dtype == E4M3
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def test_online_quantization_of_experts_matches_transformers_on_rows_quantized(tmp_path):
    moe_checkpoint(tmp_path / "base", "qwen3-moe")
    rows_reference(tmp_path / "base", tmp_path / "ref", PROJECTIONS)
    served = engine(tmp_path / "base", quantization="fp8")
    assert experts_of(served.worker.runner).w2.dtype == E4M3
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=4))


@pytest.mark.parametrize("fmt", [blocks(16, 16), FORMATS["compressed-tensors-channel"]],
                         ids=["blocks", "channel"])
def test_two_ranks_hold_their_shards_of_experts_and_scales(tmp_path, fmt):
    """Each rank's experts' partial sums (its half of every expert's intermediate features,
    with its scales) add up to the one worker's."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", intermediate_size=192)  # (its dense layer)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", fmt,
                         PROJECTIONS)
    check_expert_shards_add_up(tmp_path / "fp8")


def check_expert_shards_add_up(checkpoint) -> None:
    """Two ranks' experts' partial sums add up to the one worker's (a qwen3-moe)."""
    args = (str(checkpoint), "cpu", torch.float32, 256, 16, 4, 0)
    whole = experts_of(ModelRunner(*args))
    halves = [experts_of(ModelRunner(*args, parallel=ParallelGroup(r, 2, 0, 1)))
              for r in range(2)]
    assert halves[0].w13.shape[1] == whole.w13.shape[1] // 2
    x = torch.randn(7, 64)
    torch.testing.assert_close(sum(h.routed(x) for h in halves), whole.routed(x),
                               rtol=1e-4, atol=1e-5)


def test_online_quantization_quantizes_each_ranks_rows(tmp_path):
    """quantization fp8 over two ranks: gate's and up's rows are whole rows (as one
    worker's); each rank's rows of the down projection are quantized over its own columns."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", intermediate_size=192)
    down = load_file(f"{tmp_path}/base/model.safetensors")[
        "model.layers.0.mlp.experts.3.down_proj.weight"]
    args = (str(tmp_path / "base"), "cpu", torch.float32, 256, 16, 4, 0)
    whole = experts_of(ModelRunner(*args, quantization="fp8"))
    for r in range(2):
        half = experts_of(ModelRunner(*args, parallel=ParallelGroup(r, 2, 0, 1),
                                      quantization="fp8"))
        w13 = half.dequantized("w13", torch.float32)
        full = whole.dequantized("w13", torch.float32)
        rows = [*range(16 * r, 16 * r + 16), *range(32 + 16 * r, 32 + 16 * r + 16)]
        torch.testing.assert_close(w13, full[:, rows], rtol=0, atol=0)
        cols = down[:, 16 * r:16 * r + 16]
        torch.testing.assert_close(half.dequantized("w2", torch.float32)[3],
                                   dequantize(*quantize(cols, 1, 16), 1, 16), rtol=1e-6, atol=0)


def test_blocks_that_split_an_experts_features_are_refused(tmp_path):
    """32-row blocks over a rank's 16 intermediate features of each expert."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", intermediate_size=192)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", blocks(32, 32),
                         PROJECTIONS)
    args = (str(tmp_path / "fp8"), "cpu", torch.float32, 256, 16, 4, 0)
    ModelRunner(*args)  # one worker: fine
    with pytest.raises(ValueError, match=r"FP8 weight blocks of \[32, 32\] do not divide this "
                                         r"model's experts' 32 intermediate features"):
        ModelRunner(*args, parallel=ParallelGroup(0, 2, 0, 1))


def test_experts_stored_in_another_dtype_or_without_scales_are_refused(tmp_path):
    moe_checkpoint(tmp_path / "base", "mixtral")
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref",
                         FORMATS["fp8-blocks"], PROJECTIONS)
    fp8 = load_file(f"{tmp_path}/fp8/model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.2.w3."
    widened = {**fp8, expert + "weight": fp8[expert + "weight"].float()}
    save_file(widened, f"{tmp_path}/fp8/model.safetensors")
    with pytest.raises(ValueError, match="expert weight is stored as torch.float32, not float8"):
        engine(tmp_path / "fp8")
    save_file({k: v for k, v in fp8.items() if k != expert + "weight_scale_inv"},
              f"{tmp_path}/fp8/model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for .*layers\.1\.mlp\.2\.up_proj"
                                         r"\.weight_scale"):
        engine(tmp_path / "fp8")


# ---- the kernel (CPU: the Triton interpreter) -------------------------------------------
def kernel_routing(monkeypatch, device: str, tokens: int, n: int, k: int, num_experts: int,
                   top_k: int) -> tuple[torch.Generator, torch.Tensor]:
    """The Triton interpreter on CPU (a skip where it would be too slow); a generator, and
    each token's top_k experts [tokens, top_k] drawn from it."""
    if device == "cpu":
        if n * k * tokens > 1e6:
            pytest.skip("too slow in the interpreter")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(tokens + n + k)
    return g, torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                           for _ in range(tokens)])


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("w8a8,block,tokens,n,k,block_m", [
    (False, None, 5, 40, 96, 16),  # a scale per row
    (False, (16, 32), 5, 40, 96, 16),  # the last row block partial
    (False, (16, 64), 33, 48, 160, 64),  # the last column block partial; 64-column tiles
    (False, (128, 128), 70, 384, 256, 16),
    (True, None, 9, 40, 200, 64),  # 128-column activation groups, the last one partial
    (True, (16, 64), 33, 48, 160, 64),
    (True, (128, 128), 300, 384, 256, 128),
], ids=lambda v: "w8a8" if v is True else "w8a16" if v is False else None)
def test_expert_matmul_kernel_with_e4m3_weights(monkeypatch, device, w8a8, block, tokens, n, k,
                                                block_m):
    """Both matmuls' shapes (a token's row for each of its pairs, then each pair's own row)
    against one pair at a time over the dequantized weights: tiles widened as they load
    (W8A16), or the activations quantized too (W8A8, prompts: each group's products scaled
    by its rows' activation scales). For W8A8 the activations are on e4m3's grid already
    (quantized and dequantized by this test, per row and group of the blocks' width, else
    128), so that their quantization in the kernel is exact whatever its rounding (the
    interpreter's is not the GPU's; the GPU's is tests/test_fp8.py's
    test_activation_quantization_kernel)."""
    from kernels.moe import align_pairs, expert_matmul, expert_matmul_ref
    from tests.test_fp8 import group_quantized
    num_experts, top_k = 6, 2
    g, experts = kernel_routing(monkeypatch, device, tokens, n, k, num_experts, top_k)
    rows, cols = block or (1, k)
    group = block[1] if block else 128
    quantized = [quantize(torch.randn(n, k, generator=g), rows, cols) for _ in range(num_experts)]
    w = torch.stack([q for q, _ in quantized])
    scales = torch.stack([s if block else s.reshape(n) for _, s in quantized])
    ref_w = torch.stack([dequantize(q, s, rows, cols) for q, s in quantized])
    for pairs_per_row in (top_k, 1):
        x = torch.randn(tokens * top_k // pairs_per_row, k, generator=g)
        if w8a8:
            x = dequantize(*group_quantized(x, group), 1, group)
        pair_ids, block_experts = align_pairs(experts.to(device), num_experts, block_m)
        got = expert_matmul(x.to(device), w.to(device), pair_ids, block_experts,
                            tokens * top_k, pairs_per_row, block_m, scales=scales.to(device),
                            block=block, quantize_a=w8a8)
        want = expert_matmul_ref(x, ref_w, experts, pairs_per_row)
        # (Hopper's FP8 tensor cores add a group's products in less than fp32's precision)
        atol = 2e-3 * want.abs().max().item() if w8a8 and device == "cuda" else 1e-3
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=atol)


@pytest.mark.gpu
def test_fp8_experts_on_gpu_match_transformers(tmp_path):
    """fp32 activations: the fused kernel widens the e4m3 experts to fp32 as they load (and
    the dense projections take the weight-only kernel), in CUDA graphs and eager steps."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", hidden_size=128, moe_intermediate_size=64)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref",
                         FORMATS["compressed-tensors-channel"], PROJECTIONS)
    served = InProcessEngine(device="cuda", model=str(tmp_path / "fp8"), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    assert experts_of(served.worker.runner).w13.dtype == E4M3
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=11), device="cuda")
    assert served.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
def test_fp8_experts_in_bf16_graphs_equal_eager_steps(tmp_path, monkeypatch):
    """bf16: decode steps widen the e4m3 experts (in CUDA graphs), prompts quantize their
    activations too (W8A8); the graphs give the tokens of the same steps run eagerly."""
    import kernels.moe
    moe_checkpoint(tmp_path / "base", "qwen3-moe", hidden_size=128, moe_intermediate_size=64)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", blocks(16, 32),
                         PROJECTIONS)
    quantized, quantize = [], kernels.moe.quantize_groups

    def counted(*args):
        quantized.append(args[0].shape[0])
        return quantize(*args)
    monkeypatch.setattr(kernels.moe, "quantize_groups", counted)
    args = dict(device="cuda", model=str(tmp_path / "fp8"), dtype="bfloat16", max_batch_size=8,
                max_num_batched_tokens=64, max_num_tokens=4096)
    graphs, eager = InProcessEngine(**args), InProcessEngine(enforce_eager=True, **args)
    assert graphs.run(ragged_workload(seed=12)) == eager.run(ragged_workload(seed=12))
    assert graphs.worker.runner.num_graph_replays > 0 and quantized


def test_a_quantized_router_is_refused(tmp_path):
    """Every Linear quantized, the router included (no ignore entry for it): refused rather
    than loaded as e4m3 values without their scale."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe")
    with_router = re.compile(PROJECTIONS.pattern + r"|layers\.\d+\.mlp\.gate\.weight$")
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref",
                         FORMATS["compressed-tensors-channel"], with_router)
    with pytest.raises(ValueError, match=r"mixture of experts' gate is quantized"):
        engine(tmp_path / "fp8")


@pytest.mark.parametrize("ignore,served", [
    (["lm_head", "re:.*block_sparse_moe.gate"], True),  # llm-compressor's Mixtral recipe
    (["lm_head", "model.layers.0.block_sparse_moe.gate"], True),
    (["lm_head", "re:.*mlp.gate$"], True),  # its Qwen MoE recipes
    (["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"], True),
    (["lm_head", "re:.*down_proj"], False),
])
def test_ignore_lists_that_leave_out_the_router(ignore, served):
    from engine_actors.quantization import read_format
    config = type("Config", (), {"quantization_config": {
        **FORMATS["compressed-tensors-channel"][0], "ignore": ignore}})()
    if served:
        assert read_format(config, None).block is None
    else:
        with pytest.raises(ValueError, match="unquantized decoder projections"):
            read_format(config, None)


@pytest.mark.parametrize("fmt,shape", [("fp8-blocks", (1, 2)),
                                       ("compressed-tensors-channel", (16,))])
def test_a_scale_of_the_wrong_shape_is_refused(tmp_path, fmt, shape):
    """A scale tensor that does not cover its expert's projection (say, of smaller blocks
    than the config says) is refused, not loaded in part."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe")
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", FORMATS[fmt],
                         PROJECTIONS)
    tensors = load_file(f"{tmp_path}/fp8/model.safetensors")
    key = next(k for k in tensors if k.endswith("experts.5.down_proj.weight_scale")
               or k.endswith("experts.5.down_proj.weight_scale_inv"))
    tensors[key] = torch.ones(shape)
    save_file(tensors, f"{tmp_path}/fp8/model.safetensors")
    with pytest.raises(ValueError, match=r"expert 5's down_proj scale has shape"):
        engine(tmp_path / "fp8")
