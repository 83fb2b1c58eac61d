"""INT4 mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): compressed-tensors', GPTQ's and
AWQ's checkpoints, their experts served with greedy outputs equal to transformers' on the
same weights dequantized (fp32, CPU); two ranks' shards of experts, scales and zero points;
the fused kernel's INT4 path (CPU: the Triton interpreter) against a loop over pairs. The
checkpoints are written by tests/test_int4.py's, test_gptq.py's and test_awq.py's writers
(their own quantization; compressed-tensors' and AutoAWQ's packing)."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors import pack_to_int32

from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ParallelGroup
from tests.engine_harness import InProcessEngine
from tests.test_awq import dequantize_asymmetric, quantize_asymmetric, write_checkpoint
from tests.test_fp8_moe import (PROJECTIONS, check_expert_shards_add_up, experts_of,
                                kernel_routing, moe_checkpoint)
from tests.test_gptq import write_gptq_checkpoint
from tests.test_int4 import dequantize, engine, quantize, write_int4_checkpoint
from tests.test_parity import check_parity, ragged_workload


def write(base, out, ref, fmt: str) -> None:
    """fmt: compressed-tensors, gptq, awq or gptq-asymmetric; "-int8": 8-bit weights."""
    bits = 8 if fmt.endswith("-int8") else 4
    fmt = fmt.removesuffix("-int8")
    if fmt == "compressed-tensors":
        write_int4_checkpoint(base, out, ref, 16, projections=PROJECTIONS, bits=bits)
    elif fmt == "gptq":
        write_gptq_checkpoint(base, out, ref, 16, projections=PROJECTIONS, bits=bits)
    else:  # "awq" or "gptq-asymmetric": zero points
        write_checkpoint(base, out, ref, 16, fmt.removesuffix("-asymmetric"),
                         projections=PROJECTIONS, bits=bits)
    if fmt == "awq":  # (AutoAWQ's mixtures name their router so, for vLLM's substring match)
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = ["gate"]
        (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name,fmt", [
    ("qwen3-moe", "compressed-tensors"),
    ("mixtral", "gptq"),  # w1/w3/w2; 48 intermediate features, 6 words a row
    ("qwen2-moe", "awq"),  # zero points; its shared expert an INT4 MLP too
    ("qwen3-moe", "gptq-asymmetric"),
    ("qwen3-moe", "compressed-tensors-int8"),
    ("mixtral", "gptq-asymmetric-int8"),
])
def test_int4_experts_match_transformers_on_their_dequantized_weights(tmp_path, name, fmt):
    moe_checkpoint(tmp_path / "base", name)
    write(tmp_path / "base", tmp_path / "q", tmp_path / "ref", fmt)
    served = engine(tmp_path / "q")
    moe = experts_of(served.worker.runner)
    assert moe.w13.dtype == moe.w2.dtype == torch.int32
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "awq", "gptq-asymmetric-int8"])
def test_two_ranks_hold_their_shards_of_int4_experts(tmp_path, fmt):
    """Each rank's experts' partial sums (its half of every expert's intermediate features:
    gate's and up's rows, down's words and groups) add up to the one worker's."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", intermediate_size=192)  # (its dense layer)
    write(tmp_path / "base", tmp_path / "q", tmp_path / "ref", fmt)
    check_expert_shards_add_up(tmp_path / "q")


def test_groups_that_split_a_ranks_share_are_refused(tmp_path):
    """Groups of 32 over a rank's 16 intermediate features of each expert."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", intermediate_size=192)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref", 32,
                          projections=PROJECTIONS)
    with pytest.raises(ValueError, match="INT4 expert groups of 32 columns do not divide"):
        ModelRunner(str(tmp_path / "q"), "cpu", torch.float32, 256, 16, 4, 0,
                    parallel=ParallelGroup(0, 2, 0, 1))


# ---- the kernel (CPU: the Triton interpreter) -------------------------------------------
@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("zero_points,group,tokens,n,k,block_m,bits", [
    (False, 32, 5, 40, 96, 16, 4),
    (True, 16, 33, 48, 48, 64, 4),  # 6 words a row
    (False, None, 9, 24, 64, 16, 4),  # one scale per row
    (True, None, 5, 40, 96, 16, 4),  # one per row, K under the K tile (not a power of two)
    (True, 128, 300, 256, 256, 128, 4),
    (False, 32, 5, 40, 96, 16, 8),  # INT8: 4 values a word
    (True, 16, 33, 48, 80, 64, 8),  # 20 words a row
])
def test_expert_matmul_kernel_with_int4_weights(monkeypatch, device, zero_points, group, tokens,
                                                n, k, block_m, bits):
    """Both matmuls' shapes (a token's row for each of its pairs, then each pair's own row)
    against one pair at a time over this test's dequantized weights."""
    from kernels.int4_layout import by_group, tile_experts
    from kernels.moe import align_pairs, expert_matmul, expert_matmul_ref
    num_experts, top_k = 6, 2
    g, experts = kernel_routing(monkeypatch, device, tokens, n, k, num_experts, top_k)
    words, scales, zeros, ref = [], [], [], []
    for _ in range(num_experts):
        w = torch.randn(n, k, generator=g)
        if zero_points:
            u, z, s = quantize_asymmetric(w, group or k, bits)
            words.append(pack_to_int32((u - (1 << (bits - 1))).to(torch.int8), bits))
            zeros.append(z.float())
            ref.append(dequantize_asymmetric(u, z, s, group or k))
        else:
            q, s = quantize(w, group, bits)
            words.append(pack_to_int32(q, bits))
            ref.append(dequantize(q, s, group))
        scales.append(s.float())
    # (stored as the layer stores them on the GPU: tiled, scales group by group)
    stacked = [torch.stack(t).to(device) if t else None for t in (words, scales, zeros)]
    stacked = [tile_experts(stacked[0]), *(t if t is None else by_group(t) for t in stacked[1:])]
    for pairs_per_row in (top_k, 1):
        x = torch.randn(tokens * top_k // pairs_per_row, k, generator=g)
        pair_ids, block_experts = align_pairs(experts.to(device), num_experts, block_m)
        got = expert_matmul(x.to(device), stacked[0], pair_ids, block_experts, tokens * top_k,
                            pairs_per_row, block_m, scales=stacked[1],
                            int4=(group or k, stacked[2], bits))
        want = expert_matmul_ref(x, torch.stack(ref), experts, pairs_per_row)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["compressed-tensors", "awq", "gptq-asymmetric-int8"])
def test_int4_experts_on_gpu_match_transformers(tmp_path, fmt):
    """fp32 activations: the fused kernel unpacks the INT4 experts to fp32 as they load (and
    the dense projections take INT4's kernel), in CUDA graphs and eager steps."""
    moe_checkpoint(tmp_path / "base", "qwen3-moe", hidden_size=128, moe_intermediate_size=64)
    write(tmp_path / "base", tmp_path / "q", tmp_path / "ref", fmt)
    served = InProcessEngine(device="cuda", model=str(tmp_path / "q"), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    assert experts_of(served.worker.runner).w13.dtype == torch.int32
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=11), device="cuda")
    assert served.worker.runner.num_graph_replays > 0


@pytest.mark.parametrize("name,bits", [("qwen3-moe", 4), ("qwen2-moe", 4), ("mixtral", 4),
                                       ("qwen3-moe", 8)])
def test_the_benchmarks_int4_writer_packs_each_expert(tmp_path, name, bits):
    """load_tests/int4_checkpoint.py on a mixture of experts: each expert's projections (and
    a shared expert's) packed, checked against the originals through compressed-tensors'
    own unpacking; the routers left out; the engine serves what it wrote."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file
    from load_tests.int4_checkpoint import main
    moe_checkpoint(tmp_path / "base", name)
    main(["--model", str(tmp_path / "base"), "--group", "16", "--bits", str(bits),
          "--out", str(tmp_path / "q")])
    served = engine(tmp_path / "q")
    assert experts_of(served.worker.runner).w13.dtype == torch.int32
    if name != "qwen3-moe":
        return
    written = {k: v for f in (tmp_path / "q").glob("*.safetensors") for k, v in
               load_file(str(f)).items()}
    stem = "model.layers.0.mlp.experts.3.down_proj."
    values = unpack_from_int32(written[stem + "weight_packed"], bits, torch.Size([64, 32]))
    weight = (values.float().view(64, 2, 16) * written[stem + "weight_scale"].float()[..., None])
    base = load_file(f"{tmp_path}/base/model.safetensors")  # (per expert, or stacked)
    original = base.get(stem + "weight", base.get("model.layers.0.mlp.experts.down_proj"))
    original = original[3] if original.dim() == 3 else original
    error = (weight.view(64, 32) - original).norm() / original.norm()
    assert 0 < error < (0.15 if bits == 4 else 0.01)
    assert written["model.layers.0.mlp.gate.weight"].is_floating_point()


def test_the_benchmarks_int4_experts_call_matches_its_dequantized_weights(monkeypatch):
    """load_tests/bench_moe.py's INT4 path (its own quantization, the layer's storage) in the
    Triton interpreter: both matmuls over the INT4 experts equal those over the weights it
    dequantized."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int4_layout import by_group, tile_experts
    from load_tests.bench_moe import fused, int4_quantized
    g = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 4, (6, 2), generator=g)
    x = torch.randn(6, 64, generator=g)
    (q13, s13, d13), (q2, s2, d2) = (int4_quantized(torch.randn(4, n, k, generator=g), 32)
                                     for n, k in ((64, 64), (64, 32)))
    got = fused(x, tile_experts(q13), tile_experts(q2), experts, 16,
                int4=(by_group(s13), by_group(s2), 32))
    torch.testing.assert_close(got, fused(x, d13, d2, experts, 16), rtol=1e-4, atol=1e-4)
