"""AWQ checkpoints (4-bit with zero points, AutoAWQ's GEMM layout), and GPTQ ones with zero
points (sym: false): served with greedy outputs equal to transformers' on the same weights
dequantized (fp32, CPU), two ranks' shards, what is refused. The checkpoints are written
here, packed as AutoAWQ documents its GEMM layout (columns in the order 0 2 4 6 1 3 5 7
within a word) and GPTQ's by compressed-tensors' pack_to_int32."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors import pack_to_int32

from engine_actors.checkpoint import model_info, save_random_checkpoint
from engine_actors.config import EngineConfig
from tests.test_fp8 import check_shards_add_up
from tests.test_gptq import act_order, gptq_config
from tests.test_int4 import PROJECTION, engine, write_quantized
from tests.test_parity import check_parity, ragged_workload

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_asymmetric(w: torch.Tensor, group: int, bits: int = 4, min_zero: int = 0):
    """w [N, K] -> (u [N, K] in [0, 15], zeros [N, K / group] in [min_zero, 15], fp16
    scales); bits 8: in [0, 255]."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    top = (1 << bits) - 1
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / top).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(min_zero, top)
    u = (g / scales.float()[..., None] + zeros[..., None]).round().clamp(0, top)
    return u.reshape(n, k).to(torch.int32), zeros.to(torch.int32), scales


def dequantize_asymmetric(u, zeros, scales, group):
    n, k = u.shape
    return ((u.reshape(n, k // group, group) - zeros[..., None]).float()
            * scales.float()[..., None]).reshape(n, k)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] unsigned 4-bit -> [R, N / 8] int32, AutoAWQ's GEMM order."""
    r, n = values.shape
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for i, j in enumerate(AWQ_ORDER):
            words[:, c] |= values[:, 8 * c + j].to(torch.int64) << (4 * i)
    return words.to(torch.uint32).view(torch.int32)


def write_checkpoint(src, out_dir, ref_dir, group: int, method: str,
                     desc_act: bool = False, projections=PROJECTION, bits: int = 4) -> None:
    """out_dir: src's projections in AWQ's (or asymmetric GPTQ's: "gptq" in its v2 format,
    "gptq-v1" in the original one) layout; ref_dir: src with them dequantized. desc_act
    (GPTQ): quantized in act-order (tests/test_gptq.py); bits (GPTQ): 4 or 8."""
    v1 = int(method == "gptq-v1")  # (zero points stored minus 1: none can be 0)
    seeds = iter(range(1000))

    def convert(w):
        k = w.shape[1]
        order = act_order(k, next(seeds)) if desc_act else torch.arange(k)
        u_sorted, zeros, scales = quantize_asymmetric(w[:, order], group, bits, min_zero=v1)
        u, ref = torch.empty_like(u_sorted), torch.empty_like(w)
        u[:, order] = u_sorted
        ref[:, order] = dequantize_asymmetric(u_sorted, zeros, scales, group)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
        if method == "awq":
            stored = {"qweight": pack_awq(u.T.contiguous()),
                      "qzeros": pack_awq(zeros.T.contiguous())}
        else:  # GPTQ's v2 format (zero points as they are: the original one stores them
            # minus 1, and cannot hold a zero point of 0); pack_to_int32 adds the offset
            offset = 1 << (bits - 1)
            stored = {"qweight": pack_to_int32((u - offset).T.contiguous().to(torch.int8),
                                               bits, packed_dim=0),
                      "qzeros": pack_to_int32((zeros - v1 - offset).T.contiguous()
                                              .to(torch.int8), bits),
                      "g_idx": g_idx}
        stored["scales"] = scales.T.contiguous()
        return stored, ref
    write_quantized(src, out_dir, ref_dir, convert, awq_config(group) if method == "awq"
                    else gptq_config(group, "gptq" if v1 else "gptq_v2", sym=False,
                                     desc_act=desc_act, bits=bits),
                    projections)


def awq_config(group: int, **changes) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None, **changes}


@pytest.mark.parametrize("arch,group,method,desc_act,bits", [
    ("llama", 32, "awq", False, 4),
    ("qwen2", 16, "awq", False, 4),  # q/k/v biases
    ("phi3", 16, "awq", False, 4),  # fused qkv_proj and gate_up_proj
    ("llama", 16, "gptq", False, 4),  # sym: false
    ("qwen2", 32, "gptq", True, 4),  # sym: false, act-order: each part's groups in its order
    ("llama", 32, "gptq", False, 8),  # INT8, sym: false (zero points 4 to a word)
    ("llama", 16, "gptq-v1", False, 4),  # the original format: zero points stored minus 1
    ("qwen2", 32, "gptq-v1", False, 8),
])
def test_checkpoint_with_zero_points_matches_transformers_on_its_dequantized_weights(
        tmp_path, arch, group, method, desc_act, bits):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192, **extra)
    write_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref", group, method,
                     desc_act, bits=bits)
    served = engine(tmp_path / "q")
    down = served.worker.runner.model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.int32 and down.quant.zero_points
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def test_two_ranks_hold_their_shards_of_awq_weights_and_zero_points(tmp_path):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_checkpoint(tmp_path / "base", tmp_path / "awq", tmp_path / "ref", 32, "awq")
    check_shards_add_up(tmp_path / "awq")


@pytest.mark.parametrize("change,args,message", [
    ({"bits": 8}, {}, "AWQ weights of 8 bits"),
    ({"zero_point": False}, {}, "without zero points"),
    ({"version": "gemv_fast"}, {}, "AWQ version 'gemv_fast'"),
    ({"group_size": 48}, {}, "AWQ groups of 48 columns"),
    ({"modules_to_not_convert": ["mlp.down_proj"]}, {}, "unquantized decoder projections"),
    ({}, {"quantization": "fp8"}, "AWQ \\(INT4\\) already"),
    ({}, {"quantization": "gptq"}, "quantization gptq serves GPTQ checkpoints; this one is awq"),
])
def test_unserved_awq_variants_are_refused_at_start(tmp_path, change, args, message):
    save_random_checkpoint(str(tmp_path), "llama", seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": awq_config(32, **change)}))
    with pytest.raises(ValueError, match=message):
        model_info(EngineConfig(model=str(tmp_path), **args))


def test_awq_names_are_accepted_for_an_awq_checkpoint(tmp_path):
    save_random_checkpoint(str(tmp_path), "llama", seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": awq_config(32, modules_to_not_convert=["visual"])}))
    for name in ("awq", "awq_marlin"):
        model_info(EngineConfig(model=str(tmp_path), quantization=name))


@pytest.mark.gpu
def test_awq_on_gpu_matches_transformers(tmp_path):
    """fp32 activations, CUDA graphs and prompts: the zero points' term beside the tiled
    kernel, and beside the unpacked weight on prompts."""
    from tests.engine_harness import InProcessEngine
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_checkpoint(tmp_path / "base", tmp_path / "awq", tmp_path / "ref", 32, "awq")
    served = InProcessEngine(device="cuda", model=str(tmp_path / "awq"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3), device="cuda")
    assert served.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
def test_act_order_gptq_with_zero_points_on_gpu_matches_transformers(tmp_path):
    """fp32, CUDA graphs and prompts: x read in each part's order by the kernel, the
    unpacked weight's columns put back for prompts, and the zero points' term in that order.
    Heads of 128 features: the parts start on the kernel's tiles."""
    from tests.engine_harness import InProcessEngine
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, hidden_size=256,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                           intermediate_size=384)
    write_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref", 32, "gptq", True)
    served = InProcessEngine(device="cuda", model=str(tmp_path / "q"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096)
    assert served.worker.runner.model.layers["0"].mlp.gate_up_proj.order.tile_part.tolist() \
        == [0, 0, 0, 1, 1, 1]
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3), device="cuda")
    assert served.worker.runner.num_graph_replays > 0
