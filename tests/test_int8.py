"""INT8 weights stored one int8 each (compressed-tensors' int-quantized format, as
llm-compressor writes W8A8 INT8 checkpoints): packed as they load and served as W8A16 (the
activations stay in the model's dtype; a static `input_scale` and `input_zero_point` are
not read), with greedy outputs equal to transformers' on the same weights dequantized (fp32,
CPU). The checkpoints are quantized, compressed and decompressed by compressed-tensors
itself, an independent reference of the layout. (INT8 in pack-quantized and GPTQ's
checkpoints: tests/test_int4.py, test_gptq.py and test_awq.py, by their `bits`.)"""
from __future__ import annotations

import pytest
import torch

from engine_actors.checkpoint import save_random_checkpoint
from tests.test_fp8_moe import PROJECTIONS, experts_of, moe_checkpoint
from tests.test_int4 import PROJECTION, engine, write_quantized
from tests.test_parity import check_parity, ragged_workload


def w8a8_config(symmetric: bool, static_inputs: bool) -> dict:
    inputs = {"num_bits": 8, "type": "int", "symmetric": not static_inputs,
              **({"strategy": "tensor", "dynamic": False} if static_inputs
                 else {"strategy": "token", "dynamic": True})}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": inputs,
                "weights": {"num_bits": 8, "type": "int", "symmetric": symmetric,
                            "strategy": "channel", "dynamic": False}}}}


def write_w8a8_checkpoint(src, out_dir, ref_dir, symmetric: bool = True,
                          static_inputs: bool = False, projections=PROJECTION) -> None:
    """out_dir: src's projections as int8 weights with a scale (and, asymmetric, a zero
    point) per row; static_inputs: with an asymmetric per-tensor input_scale and
    input_zero_point too; ref_dir: src with the weights dequantized."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    config = w8a8_config(symmetric, static_inputs)
    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"],
                                weights=QuantizationArgs(**group["weights"]),
                                input_activations=QuantizationArgs(**group["input_activations"]))

    def convert(w):
        scales, zeros = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True),
                                          scheme.weights)
        stored = IntQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scales, "weight_zero_point": zeros}, scheme)
        assert stored["weight"].dtype == torch.int8
        ref = IntQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
        if static_inputs:
            stored["input_scale"] = torch.tensor([0.05])
            stored["input_zero_point"] = torch.tensor([3], dtype=torch.int8)
        return stored, ref
    write_quantized(src, out_dir, ref_dir, convert, config, projections)


@pytest.mark.parametrize("arch,symmetric,static_inputs", [
    ("llama", True, False),  # RedHatAI's quantized.w8a8: dynamic per-token activations
    ("qwen2", False, True),  # weight zero points; a static activation scale and zero point
    ("phi3", True, False),  # fused qkv_proj and gate_up_proj
])
def test_int8_weights_stored_unpacked_match_transformers_on_their_dequantized_weights(
        tmp_path, arch, symmetric, static_inputs):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192, **extra)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref", symmetric,
                          static_inputs)
    served = engine(tmp_path / "q")
    down = served.worker.runner.model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.int32 and down.weight.shape == (64, 192 // 4)
    assert down.quant.zero_points == (not symmetric)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def test_int8_experts_stored_unpacked_match_transformers(tmp_path):
    moe_checkpoint(tmp_path / "base", "qwen3-moe")
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref",
                          static_inputs=True, projections=PROJECTIONS)
    served = engine(tmp_path / "q")
    assert experts_of(served.worker.runner).w13.dtype == torch.int32
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3))


@pytest.mark.gpu
def test_int8_weights_stored_unpacked_on_gpu_match_transformers(tmp_path):
    """Packed on the device as they load, then INT8's kernels (fp32 activations), CUDA
    graphs and prompts."""
    from tests.engine_harness import InProcessEngine
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref", symmetric=False)
    served = InProcessEngine(device="cuda", model=str(tmp_path / "q"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096)
    check_parity(str(tmp_path / "ref"), served, ragged_workload(seed=3), device="cuda")
    assert served.worker.runner.num_graph_replays > 0
