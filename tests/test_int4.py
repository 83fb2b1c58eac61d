"""INT4 weights (W4A16, compressed-tensors' pack-quantized checkpoints): served with greedy
outputs equal to transformers' on the same weights dequantized (fp32, CPU: the weights are
dequantized for each matmul); two ranks' shards of packed weights and scales; the Triton
kernel in the interpreter; what is refused at start. The quantization below is this test's
own; the packing is compressed-tensors' (the library that writes these checkpoints)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from compressed_tensors.compressors import pack_to_int32
from safetensors.torch import load_file, save_file

from engine_actors.checkpoint import model_info, save_random_checkpoint
from engine_actors.config import EngineConfig
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ParallelGroup
from tests.engine_harness import InProcessEngine
from tests.test_fp8 import check_shards_add_up
from tests.test_parity import check_parity, ragged_workload

PROJECTION = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def quantize(w: torch.Tensor, group: int | None, bits: int = 4
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8 in [-8, 7] (bits 4; 8: [-128, 127]), scales [N, K / group]
    or [N, 1]): each group's absolute maximum maps to 7 (127)."""
    n, k = w.shape
    g = group or k
    top = (1 << (bits - 1)) - 1
    scales = w.reshape(n, k // g, g).abs().amax(-1) / top
    q = (w.reshape(n, k // g, g) / scales[..., None]).round().clamp(-top - 1, top)
    return q.reshape(n, k).to(torch.int8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int | None) -> torch.Tensor:
    n, k = q.shape
    g = group or k
    return (q.float().reshape(n, k // g, g) * scales.float()[..., None]).reshape(n, k)


def w4a16_config(group: int | None, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int",
                                                      "symmetric": True, "dynamic": False,
                                                      "strategy": "group" if group else "channel",
                                                      "group_size": group, "actorder": None,
                                                      **weights}}}}


def write_quantized(src, out_dir, ref_dir, convert, quantization_config: dict,
                    projections: re.Pattern = PROJECTION) -> None:
    """out_dir: src with each projection's weight w replaced by the tensors of convert(w)[0]
    (names after the projection's path); ref_dir: src with w replaced by convert(w)[1], its
    dequantized weight (what the checkpoint means, for transformers)."""
    for d in (out_dir, ref_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    packed, ref = {}, {}
    for key, w in load_file(f"{src}/model.safetensors").items():
        if not projections.search(key):
            packed[key] = ref[key] = w
            continue
        stored, ref[key] = convert(w.float())
        packed.update({key.removesuffix("weight") + name: t for name, t in stored.items()})
    save_file(packed, f"{out_dir}/model.safetensors")
    save_file(ref, f"{ref_dir}/model.safetensors")
    cfg = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                     quantization_config}))


def write_int4_checkpoint(src, int4_dir, ref_dir, group: int | None,
                          scale_dtype=torch.float32, projections=PROJECTION, bits: int = 4
                          ) -> None:
    """int4_dir: src's projections in INT4 (bits 8: INT8; pack-quantized); ref_dir: src with
    them dequantized."""
    def convert(w):
        q, scales = quantize(w, group, bits)
        scales = scales.to(scale_dtype)
        return ({"weight_packed": pack_to_int32(q, bits), "weight_scale": scales,
                 "weight_shape": torch.tensor(list(w.shape))}, dequantize(q, scales, group))
    write_quantized(src, int4_dir, ref_dir, convert, w4a16_config(group, num_bits=bits),
                    projections)


def write_act_order_checkpoint(src, int4_dir, ref_dir, group: int, actorder) -> None:
    """actorder "group": each projection quantized in its own column order (as GPTQ's
    act-order), stored in the original one with `weight_g_idx`, each column's group."""
    seeds = iter(range(1000))

    def convert(w):
        k = w.shape[1]
        order = torch.randperm(k, generator=torch.Generator().manual_seed(next(seeds)))
        q_sorted, scales = quantize(w[:, order], group)
        q, ref, g_idx = torch.empty_like(q_sorted), torch.empty_like(w), torch.empty(k)
        q[:, order], ref[:, order] = q_sorted, dequantize(q_sorted, scales, group)
        g_idx[order] = (torch.arange(k) // group).float()
        return ({"weight_packed": pack_to_int32(q, 4), "weight_scale": scales,
                 "weight_g_idx": g_idx.to(torch.int32)}, ref)
    write_quantized(src, int4_dir, ref_dir, convert, w4a16_config(group, actorder=actorder))


def engine(model, **args) -> InProcessEngine:
    return InProcessEngine(model=str(model), max_batch_size=8, block_size=4,
                           max_num_batched_tokens=24, max_num_tokens=4096, **args)


@pytest.mark.parametrize("arch,group,scale_dtype,bits", [
    ("llama", 16, torch.float32, 4),
    ("llama", None, torch.float32, 4),  # strategy "channel"
    ("qwen2", 32, torch.bfloat16, 4),  # q/k/v biases; scales stored in bf16, as released
    ("phi3", 16, torch.float32, 4),  # fused qkv_proj and gate_up_proj split by rows
    ("llama", 32, torch.bfloat16, 8),  # INT8 (W8A16)
    ("phi3", None, torch.float32, 8),
])
def test_int4_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path, arch, group,
                                                                         scale_dtype, bits):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192, **extra)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", group,
                          scale_dtype, bits=bits)
    served = engine(tmp_path / "int4")
    down = served.worker.runner.model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.int32 and down.weight.shape == (64, 192 * bits // 32)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def write_asymmetric_checkpoint(src, out_dir, ref_dir, group: int | None, bits: int = 4
                                ) -> None:
    """Zero points: quantized, packed and dequantized by compressed-tensors itself (its
    qparams, its PackedQuantizationCompressor), an independent reference of their layout."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    config = w4a16_config(group, symmetric=False, num_bits=bits)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        **config["config_groups"]["group_0"]["weights"]))

    def convert(w):
        n, k = w.shape
        g = w.reshape(n, k // (group or k), -1)
        scales, zeros = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
        stored = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scales, "weight_zero_point": zeros}, scheme)
        ref = PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
        return stored, ref
    write_quantized(src, out_dir, ref_dir, convert, config)


@pytest.mark.parametrize("actorder", ["group", True])  # (True: an older name of "group")
def test_act_order_int4_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path,
                                                                                   actorder):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=8, intermediate_size=192)
    write_act_order_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16,
                               actorder)
    served = engine(tmp_path / "int4")
    assert served.worker.runner.model.layers["1"].mlp.down_proj.order is not None
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


@pytest.mark.parametrize("group,bits", [(16, 4), (None, 4), (32, 8)],
                         ids=["groups", "channel", "int8-groups"])
def test_asymmetric_int4_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path,
                                                                                   group, bits):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_asymmetric_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", group,
                                bits)
    served = engine(tmp_path / "int4")
    assert served.worker.runner.model.layers["0"].mlp.down_proj.quant.zero_points
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


@pytest.mark.parametrize("group,bits", [(32, 4), (None, 4), (None, 8)],
                         ids=["groups", "channel", "int8-channel"])
def test_two_ranks_hold_their_shards_of_packed_weights_and_scales(tmp_path, group, bits):
    """Two ranks' projections together give the one worker's: column-parallel outputs
    concatenated part by part, row-parallel partial sums added."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", group,
                          bits=bits)
    check_shards_add_up(tmp_path / "int4")


def test_lora_adapter_on_int4_weights_matches_transformers_peft(tmp_path):
    from tests.test_lora import ADAPTERS, check_against_peft, save_adapter
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16)
    save_adapter(str(tmp_path / "ref"), str(tmp_path / "lora"), 8, 16, ADAPTERS["chat"][2],
                 seed=6)
    check_against_peft(str(tmp_path / "ref"), str(tmp_path / "lora"), str(tmp_path / "int4"))


def test_lora_slots_take_an_int4_layers_features_not_its_stored_shape(tmp_path):
    """On the GPU an INT4 weight is stored tiled ([N / 128, words, 128]): LoRA's slots (and
    the row-parallel all-reduce's buffer) take the layer's output features."""
    from engine_actors.layers import lora as lora_layers
    from kernels.int4_layout import tile
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16)
    model = ModelRunner(str(tmp_path / "int4"), "cpu", torch.float32, 256, 16, 4, 0).model
    down = model.layers["0"].mlp.down_proj
    down.weight.data = tile(down.weight.data)  # (as finish_loading stores it on a GPU)
    lora_layers.attach(model, 2, 8, torch.float32)
    assert down.lora.b.shape[1] == down.out_features == 64


@pytest.mark.gpu
def test_lora_adapter_on_int4_weights_on_gpu_matches_transformers_peft(tmp_path):
    from tests.test_lora import ADAPTERS, check_against_peft, save_adapter
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16)
    save_adapter(str(tmp_path / "ref"), str(tmp_path / "lora"), 8, 16, ADAPTERS["chat"][2],
                 seed=6)
    check_against_peft(str(tmp_path / "ref"), str(tmp_path / "lora"), str(tmp_path / "int4"),
                       device="cuda")


def test_groups_that_straddle_shards_are_refused(tmp_path):
    """64-column groups over a rank's 96 input features of the down projection."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", intermediate_size=192)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 64)
    args = (str(tmp_path / "int4"), "cpu", torch.float32, 256, 16, 4, 0)
    ModelRunner(*args)  # one worker: fine
    with pytest.raises(ValueError, match="INT4 weight groups of 64 columns do not divide"):
        ModelRunner(*args, parallel=ParallelGroup(0, 2, 0, 1))


def test_int4_weights_stored_unpacked_are_refused(tmp_path):
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16)
    tensors = load_file(f"{tmp_path}/int4/model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight_packed"
    tensors[key] = tensors[key].to(torch.int64)
    save_file(tensors, f"{tmp_path}/int4/model.safetensors")
    with pytest.raises(ValueError, match="weight is stored as torch.int64, not int32"):
        engine(tmp_path / "int4")


@pytest.mark.parametrize("change,args,message", [
    ({"actorder": "by-size"}, {}, r"actorder 'by-size'"),
    ({}, {"quantization": "fp8"}, "this checkpoint's weights are integers already"),
    ({"group_size": 48}, {}, "INT4 groups of 48 columns"),
    ({"num_bits": 2}, {}, "int weights of 2 bits are not supported"),
    ({"num_bits": 8, "strategy": "tensor"}, {}, "INT8 weights by 'tensor'"),
    ({"strategy": "tensor"}, {}, "INT4 weights by 'tensor'"),
    ({}, {"enable_finetuning": True}, "enable_finetuning with INT4"),
])
def test_unserved_int4_variants_are_refused_at_start(tmp_path, change, args, message):
    save_random_checkpoint(str(tmp_path), "llama", seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    quantization = w4a16_config(32)
    quantization["config_groups"]["group_0"]["weights"].update(change)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        model_info(EngineConfig(model=str(tmp_path), **args))


def test_act_order_experts_and_quantized_activations_are_refused(tmp_path):
    save_random_checkpoint(str(tmp_path), "mixtral", intermediate_size=48,
                           num_local_experts=4, num_experts_per_tok=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                      w4a16_config(16, actorder="group")}))
    with pytest.raises(ValueError, match="act-order INT4 weights are not supported for "
                                         "Mixtral"):
        model_info(EngineConfig(model=str(tmp_path)))
    w4afp8 = w4a16_config(16)
    w4afp8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": w4afp8}))
    with pytest.raises(ValueError, match="INT4 weights with float activations of 8 bits"):
        model_info(EngineConfig(model=str(tmp_path)))
    int4_stored_unpacked = w4a16_config(16)
    int4_stored_unpacked["format"] = "int-quantized"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                      int4_stored_unpacked}))
    with pytest.raises(ValueError, match="format 'int-quantized' is not supported for 4-bit"):
        model_info(EngineConfig(model=str(tmp_path)))


# ---- the GPU kernels (CPU: the Triton interpreter) ----------------------------------------
@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,n,k,group,split,bits", [
    (1, 48, 256, 128, 1, 4), (5, 40, 96, 32, 2, 4), (20, 72, 160, None, 3, 4),
    (70, 130, 256, 64, 2, 4), (300, 256, 512, 128, 1, 4),
    (1, 48, 256, 128, 1, 8), (5, 40, 160, 32, 2, 8), (20, 72, 100, None, 3, 8)])
def test_int4_matmul_kernel(monkeypatch, device, m, n, k, group, split, bits):
    """x times each tiled tile unpacked and scaled as it loads, the K range split over
    programs or not, against the dequantized weight's fp32 matmul (channel scales; groups
    narrower than the K tile; rows, columns and words past the tiles'); INT8 alike."""
    if device == "cpu":
        if m * n * k > 3e6:
            pytest.skip("too slow in the interpreter")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int4 import int4_matmul
    from kernels.int4_layout import tile
    torch.manual_seed(m + k)
    q, scales = quantize(torch.randn(n, k), group, bits)
    x, bias = torch.randn(m, k), torch.randn(n)
    want = x @ dequantize(q, scales, group).T + bias
    w = tile(pack_to_int32(q, bits).to(device))
    got = int4_matmul(x.to(device), w, scales.to(device), group or k, bias.to(device),
                      split_k=split, bits=bits)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,group,bits", [(5, 32, 4), (3, None, 4), (200, 64, 4), (5, 32, 8),
                                          (200, 64, 8)])
def test_kernels_with_zero_points(monkeypatch, device, m, group, bits):
    """w = (u - z) s with a zero point z per scale, u the stored value: the kernel (up to
    128 rows) and the unpacking for cuBLAS (more) against this test's dequantization."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int4 import dequantize_tiled, int4_matmul
    from kernels.int4_layout import by_group, tile
    n, k = 136, 256
    gen = torch.Generator().manual_seed(m)
    u = torch.randint(0, 1 << bits, (n, k), generator=gen)
    groups = k // (group or k)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
    scales = torch.rand(n, groups, generator=gen) / 10
    ref = ((u - zeros.repeat_interleave(k // groups, 1)) * scales.repeat_interleave(
        k // groups, 1))
    if group is None:  # (channel: one scale and zero point per row, [N])
        zeros, scales = zeros.reshape(n), scales.reshape(n)
    w = tile(pack_to_int32((u - (1 << (bits - 1))).to(torch.int8), bits)).to(device)
    scales, zeros = by_group(scales.to(device)), by_group(zeros.to(device))  # (as stored)
    if m <= 128:
        x = torch.randn(m, k)
        got = int4_matmul(x.to(device), w, scales, group or k, zeros=zeros, split_k=2,
                          bits=bits)
        torch.testing.assert_close(got.cpu(), x @ ref.T, rtol=1e-4, atol=1e-3)
    else:
        got = dequantize_tiled(w, scales, group or k, k, torch.float32, zeros, bits)
        torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n,k,group,bits", [(130, 192, 64, 4), (40, 100, None, 4),
                                            (64, 256, 16, 4), (130, 192, 64, 8),
                                            (40, 100, None, 8)])
def test_dequantize_tiled(monkeypatch, device, n, k, group, bits):
    """The prompt path's unpacking of a tiled weight equals this test's dequantization."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int4 import dequantize_tiled
    from kernels.int4_layout import tile
    q, scales = quantize(torch.randn(n, k), group, bits)
    got = dequantize_tiled(tile(pack_to_int32(q, bits).to(device)), scales.to(device),
                           group or k, k, torch.float32, bits=bits)
    torch.testing.assert_close(got.cpu(), dequantize(q, scales, group), rtol=0, atol=0)


def ordered_weight(n: int, k: int, group: int, parts: list[tuple[int, int]], seed: int = 0):
    """A weight whose parts (rows) are quantized each in its own column order: (its values
    in input order, scales, dequantized, each part's g_idx)."""
    gen = torch.Generator().manual_seed(seed)
    q, g_idx = torch.empty(n, k, dtype=torch.int8), torch.empty(len(parts), k, dtype=torch.int32)
    scales, ref = torch.empty(n, k // group), torch.empty(n, k)
    for p, (start, end) in enumerate(parts):
        order = torch.randperm(k, generator=gen)
        q_sorted, scales[start:end] = quantize(torch.randn(end - start, k, generator=gen), group)
        q[start:end, order] = q_sorted
        ref[start:end, order] = dequantize(q_sorted, scales[start:end], group)
        g_idx[p, order] = (torch.arange(k) // group).to(torch.int32)
    return q, scales, ref, g_idx


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,split", [(3, 1), (6, 2), (200, 1)])
def test_act_order_kernels_read_each_parts_columns_in_its_order(monkeypatch, device, m, split):
    """Two parts of a tile each (sorted by kernels.int4_layout.sort_columns): x gathered into each
    part's order for the kernel and for the prompt path, against the dequantized weight."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int4 import int4_linear, int4_matmul
    from kernels.int4_layout import sort_columns, tile, tile_parts
    parts, k, group = [(0, 128), (128, 200)], 128, 32
    q, scales, ref, g_idx = ordered_weight(200, k, group, parts, seed=m)
    stored, order = sort_columns(pack_to_int32(q, 4), g_idx, parts, group, k)
    order = tile_parts(order._replace(columns=order.columns.to(device)), 200)
    assert order.tile_part.tolist() == [0, 1]
    x, bias = torch.randn(m, k), torch.randn(200)
    want = x @ ref.T + bias
    w, scales, x, bias = (t.to(device) for t in (tile(stored), scales, x, bias))
    if m <= 128:
        got = int4_matmul(x, w.to(device), scales, group, bias, split_k=split, order=order)
    else:  # (the GPU's unpacked weight and cuBLAS; CPU's plain weight)
        got = int4_linear(x, stored if device == "cpu" else w, scales, group, k, bias,
                          order=order)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


def test_sort_columns_refuses_groups_of_other_sizes_and_parts_off_tiles():
    from kernels.int4_layout import ColumnOrder, pack, sort_columns, tile_parts, unpack
    q, _, _, g_idx = ordered_weight(8, 64, 16, [(0, 8)])
    words = pack_to_int32(q, 4)
    assert torch.equal(pack(unpack(words, 64)), words)  # (negative words too)
    g_idx[0, :3] = 0  # group 0 has 16 + some columns
    with pytest.raises(ValueError, match="groups are not 16 columns each"):
        sort_columns(words, g_idx, [(0, 8)], 16, 64)
    in_order = (torch.arange(64) // 16).to(torch.int32)[None]
    assert sort_columns(words, in_order, [(0, 8)], 16, 64) == (words, None)
    with pytest.raises(ValueError, match=r"start on a multiple of 128 rows.*\[0, 64\]"):
        tile_parts(ColumnOrder(torch.zeros(2, 64, dtype=torch.long), ((0, 64), (64, 192))), 192)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 16, 64, 100, 128, 129, 300])
def test_int4_linear_bf16_on_gpu(m, bits):
    """bf16 activations on both paths (the kernel up to KERNEL_MAX_TOKENS rows, the weight
    unpacked for cuBLAS beyond), against the dequantized weight's matmul."""
    from kernels.int4 import int4_linear
    from kernels.int4_layout import tile
    torch.manual_seed(m)
    q, scales = quantize(torch.randn(6144, 4096), 128, bits)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ dequantize(q, scales, 128).cuda().T
    got = int4_linear(x, tile(pack_to_int32(q, bits).cuda()), scales.cuda(), 128, 4096,
                      bits=bits)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_on_gpu_matches_transformers(tmp_path, bits):
    """fp32 activations (the kernel widens the weights to fp32), CUDA graphs and prompts."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 32, bits=bits)
    served = InProcessEngine(device="cuda", model=str(tmp_path / "int4"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3), device="cuda")
    assert served.worker.runner.num_graph_replays > 0


def test_transforms_sparsity_and_stray_tensors_are_refused(tmp_path):
    """Rotations applied at run time (QuIP, SpinQuant) and 2:4 sparsity are refused at
    start; a tensor a projection has no place for (a g_idx) when it loads."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5)
    write_int4_checkpoint(tmp_path / "base", tmp_path / "int4", tmp_path / "ref", 16)
    cfg = json.loads((tmp_path / "int4" / "config.json").read_text())
    for extra, message in [
            ({"transform_config": {"config_groups": {"u": {"type": "random-hadamard"}}}},
             "transforms"),
            ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format")]:
        quantization = {**cfg["quantization_config"], **extra}
        (tmp_path / "int4" / "config.json").write_text(json.dumps(
            {**cfg, "quantization_config": quantization}))
        with pytest.raises(ValueError, match=message):
            model_info(EngineConfig(model=str(tmp_path / "int4")))
    (tmp_path / "int4" / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(f"{tmp_path}/int4/model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_g_idx"] = torch.zeros(176, dtype=torch.int32)
    save_file(tensors, f"{tmp_path}/int4/model.safetensors")
    with pytest.raises(ValueError, match="'weight_g_idx' tensor is not served"):
        engine(tmp_path / "int4")


def test_a_quantized_lm_head_is_refused():
    """ignore [] quantizes the LM head too: refused as it loads, saying so."""
    from engine_actors.layers.embedding import ParallelLMHead
    head = ParallelLMHead(10, 16)
    with pytest.raises(ValueError, match="quantized embedding or LM head"):
        head.load("weight", pack_to_int32(torch.zeros(10, 16, dtype=torch.int8), 4))
