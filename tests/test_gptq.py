"""GPTQ checkpoints (4-bit, symmetric, with act-order or without; with zero points:
tests/test_awq.py): served with greedy outputs equal to transformers' on the same weights
dequantized (fp32, CPU); both checkpoint formats (zero points stored as 7 or 8); two ranks'
shards; what is refused. The checkpoints are written here: quantized by this test
(tests/test_int4.py's rounding), packed by compressed-tensors' pack_to_int32 along GPTQ's axes (qweight along K
within each column, qzeros along N), an independent reference of the bit layout."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors import pack_to_int32
from safetensors.torch import load_file, save_file

from engine_actors.checkpoint import model_info, save_random_checkpoint
from engine_actors.config import EngineConfig
from tests.test_fp8 import check_shards_add_up
from tests.test_int4 import (PROJECTION, dequantize, engine, quantize, write_int4_checkpoint,
                             write_quantized)
from tests.test_parity import check_parity, ragged_workload


def gptq_config(group: int, checkpoint_format: str | None = None, **changes) -> dict:
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
              "desc_act": False, "damp_percent": 0.01, "true_sequential": True,
              "modules_in_block_to_quantize": None, "use_exllama": True}
    if checkpoint_format:
        config["checkpoint_format"] = checkpoint_format
    return {**config, **changes}


def act_order(k: int, seed: int) -> torch.Tensor:
    """A column order as GPTQ's act-order makes one (a random one here): it quantizes the
    columns in this order, so group g holds columns order[g G: (g + 1) G]."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))


def write_gptq_checkpoint(src, gptq_dir, ref_dir, group: int, checkpoint_format=None,
                          g_idx: bool = True, desc_act: bool = False,
                          projections=PROJECTION, bits: int = 4) -> None:
    """gptq_dir: src's projections in GPTQ's layout (of `bits`-bit values); ref_dir: src with
    them dequantized. desc_act: each projection quantized in its own column order, stored in
    the original one, with g_idx giving each column's group."""
    offset = 1 << (bits - 1)  # (pack_to_int32 stores value + offset)
    zero = offset - (checkpoint_format != "gptq_v2")  # (v1 stores zero - 1)
    size = None if group == -1 else group
    seeds = iter(range(1000))

    def convert(w):
        n, k = w.shape
        order = act_order(k, next(seeds)) if desc_act else torch.arange(k)
        q_sorted, scales = quantize(w[:, order], size, bits)  # [N, K], [N, groups]
        groups = scales.shape[1]
        scales = scales.to(torch.float16)
        q, ref = torch.empty_like(q_sorted), torch.empty_like(w)
        q[:, order] = q_sorted
        ref[:, order] = dequantize(q_sorted, scales.float(), size)
        stored = {"qweight": pack_to_int32(q.T.contiguous(), bits, packed_dim=0),
                  # a zero point z as z - offset
                  "qzeros": pack_to_int32(torch.full((groups, n), zero - offset,
                                                     dtype=torch.int8), bits),
                  "scales": scales.T.contiguous()}
        if g_idx:
            stored["g_idx"] = torch.empty(k, dtype=torch.int32)
            stored["g_idx"][order] = (torch.arange(k) // (k // groups)).to(torch.int32)
        return stored, ref
    write_quantized(src, gptq_dir, ref_dir, convert,
                    gptq_config(group, checkpoint_format, desc_act=desc_act, bits=bits),
                    projections)


@pytest.mark.parametrize("arch,group,checkpoint_format,bits", [
    ("llama", 32, None, 4),  # the original format: zero points stored as 7
    ("llama", -1, "gptq_v2", 4),  # one scale per row; zero points stored as 8
    ("qwen2", 16, "gptq", 4),  # q/k/v biases
    ("phi3", 16, None, 4),  # fused qkv_proj and gate_up_proj
    ("qwen2", 32, None, 8),  # Qwen's -GPTQ-Int8: zero points stored as 127
    ("llama", -1, "gptq_v2", 8),  # zero points stored as 128
])
def test_gptq_checkpoint_matches_transformers_on_its_dequantized_weights(
        tmp_path, arch, group, checkpoint_format, bits):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192, **extra)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", group,
                          checkpoint_format, g_idx=arch != "qwen2", bits=bits)
    served = engine(tmp_path / "gptq")
    down = served.worker.runner.model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.int32 and down.weight.shape == (64, 192 * bits // 32)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


@pytest.mark.parametrize("arch,group,checkpoint_format,bits", [
    ("llama", 32, None, 4),
    ("phi3", 16, "gptq_v2", 4),  # one order for each fused tensor, its parts split by rows
    ("llama", 32, None, 8),
])
def test_act_order_gptq_matches_transformers_on_its_dequantized_weights(
        tmp_path, arch, group, checkpoint_format, bits):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=7, intermediate_size=192, **extra)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", group,
                          checkpoint_format, desc_act=True, bits=bits)
    served = engine(tmp_path / "gptq")
    qkv = served.worker.runner.model.layers["0"].self_attn.qkv_proj
    assert qkv.order is not None and len(qkv.order.rows) == 3
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def test_act_order_is_served_at_one_rank_only(tmp_path):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", 32,
                          desc_act=True)
    with pytest.raises(ValueError, match="act-order INT4 weights .* at tensor_parallel_size 1"):
        check_shards_add_up(tmp_path / "gptq")


def test_two_ranks_hold_their_shards_of_gptq_weights(tmp_path):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", 32)
    check_shards_add_up(tmp_path / "gptq")


@pytest.mark.parametrize("change,args,message", [
    ({"bits": 3}, {}, "GPTQ weights of 3 bits"),
    ({"checkpoint_format": "marlin"}, {}, "checkpoint_format 'marlin'"),
    ({"lm_head": True}, {}, "quantized LM head"),
    ({"dynamic": {"-:.*down_proj": {}}}, {}, "per-module settings"),
    ({"group_size": 48}, {}, "GPTQ groups of 48 columns"),
    ({}, {"quantization": "fp8"}, "GPTQ \\(integer weights\\) already"),
    ({}, {"enable_finetuning": True}, "enable_finetuning with INT4"),
])
def test_unserved_gptq_variants_are_refused_at_start(tmp_path, change, args, message):
    save_random_checkpoint(str(tmp_path), "llama", seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": gptq_config(32, **change)}))
    with pytest.raises(ValueError, match=message):
        model_info(EngineConfig(model=str(tmp_path), **args))


def test_vllm_quantization_names_need_a_checkpoint_of_their_method(tmp_path):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", 16)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref2", 16)
    for model, name, refusal in [
            ("base", "gptq_marlin", "serves GPTQ checkpoints; this one is unquantized"),
            ("base", "moe_wna16", "serves GPTQ or AWQ checkpoints; this one is unquantized"),
            ("gptq", "compressed-tensors", "serves compressed-tensors checkpoints; this one is "
                                           "gptq"),
            ("gptq", "gptq", None), ("gptq", "moe_wna16", None),
            ("int4", "compressed-tensors", None)]:
        config = EngineConfig(model=str(tmp_path / model), quantization=name)
        if refusal is None:
            model_info(config)
            continue
        with pytest.raises(ValueError, match=f"quantization {name} {refusal}"):
            model_info(config)


@pytest.mark.parametrize("tensor,value,message", [
    ("qzeros", 5, "zero points other than the symmetric 7"),
    ("g_idx", None, "out of their groups' order"),
])
def test_asymmetric_zero_points_and_act_order_are_refused_as_they_load(tmp_path, tensor, value,
                                                                      message):
    """A config that says symmetric, no act-order, over tensors that are not."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_gptq_checkpoint(tmp_path / "base", tmp_path / "gptq", tmp_path / "ref", 16)
    tensors = load_file(f"{tmp_path}/gptq/model.safetensors")
    key = f"model.layers.1.mlp.up_proj.{tensor}"
    if tensor == "qzeros":
        tensors[key] = pack_to_int32(torch.full(tensors[key].shape[:1] + (
            tensors[key].shape[1] * 8,), value - 8, dtype=torch.int8), 4)
    else:
        tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, f"{tmp_path}/gptq/model.safetensors")
    with pytest.raises(ValueError, match=message):
        engine(tmp_path / "gptq")
