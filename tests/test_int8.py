"""INT8 weights stored one int8 each (compressed-tensors' int-quantized format, as
llm-compressor writes W8A8 INT8 checkpoints). A dense model's symmetric per-channel weights
are served as W8A8 (kernels/int8.py): its activations quantized per token as they come, the
products summed in int32; greedy outputs equal transformers' on the same weights
dequantized with each projection's input quantized so (fp32, CPU). Other ones (zero points,
a mixture's experts) are packed as they load and served as W8A16 (activations in the
model's dtype; a static `input_scale` and `input_zero_point` are not read), equal to
transformers' on the dequantized weights. The checkpoints are quantized, compressed and
decompressed by compressed-tensors itself, an independent reference of the layout. (INT8 in
pack-quantized and GPTQ's checkpoints: tests/test_int4.py, test_gptq.py and test_awq.py, by
their `bits`.)"""
from __future__ import annotations

import pytest
import torch

from engine_actors.checkpoint import save_random_checkpoint
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ParallelGroup
from tests.engine_harness import hf_greedy, hf_model
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


def quantized_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to the int8 grid of its absolute maximum over 127 (round half
    to even), as vLLM's dynamic per-token INT8 does."""
    scales = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scales).clamp(-128, 127) * scales


def quantize_inputs(model) -> None:
    """transformers' model with each decoder projection's input quantized per token first."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and ".layers." in f".{name}" and \
                name.removesuffix(".base_layer").endswith("_proj"):  # (peft's: the base)
            module.register_forward_pre_hook(lambda _, args: (quantized_per_token(args[0]),))


@pytest.mark.parametrize("arch,static_inputs", [
    ("llama", False),  # RedHatAI's quantized.w8a8: dynamic per-token activations
    ("qwen2", True),  # a static activation scale and zero point, not read: per token too
    ("phi3", False),  # fused qkv_proj and gate_up_proj
])
def test_w8a8_checkpoint_matches_transformers_with_inputs_quantized_per_token(
        tmp_path, arch, static_inputs):
    extra = {"num_key_value_heads": 1} if arch == "phi3" else {}
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192, **extra)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref",
                          static_inputs=static_inputs)
    served = engine(tmp_path / "q")
    down = served.worker.runner.model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.int8 and down.weight.shape == (64, 192)
    quantize_inputs(hf_model(str(tmp_path / "ref")))
    check_parity_but_near_ties(str(tmp_path / "ref"), served, ragged_workload(seed=3))


def check_parity_but_near_ties(ref: str, served, arrivals, margin: float = 0.02) -> None:
    """Greedy tokens equal transformers', except that one request may take the second
    choice where transformers' two best logits are within `margin` (the rest of it is then
    not compared): fp32 noise of 1e-7 that moves an activation across a rounding boundary
    moves the logits by ~1e-3, enough to flip such a near tie."""
    outputs = served.run(arrivals)
    flips = []
    for rid, prompt, sampling in (r for reqs in arrivals.values() for r in reqs):
        want = hf_greedy(ref, prompt, sampling.max_tokens)
        got = outputs[rid]
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is None:
            assert len(got) == len(want), rid
            continue
        with torch.no_grad():
            logits = hf_model(ref)(torch.tensor([prompt + want[:at]])).logits[0, -1]
        assert logits[want[at]] - logits[got[at]] < margin, (rid, at)
        flips.append(rid)
    assert len(flips) <= 1, flips


def test_lora_adapter_on_w8a8_weights_matches_transformers_peft(tmp_path):
    """Adapters beside W8A8 projections take the unquantized input, as vLLM's do:
    transformers + peft on the dequantized weights, with each base projection's input (not
    the adapter's) quantized per token."""
    import peft
    from transformers import AutoModelForCausalLM
    from tests.test_lora import ADAPTERS, _peft_models, check_against_peft, save_adapter
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref")
    ref, adapter = str(tmp_path / "ref"), str(tmp_path / "lora")
    save_adapter(ref, adapter, 8, 16, ADAPTERS["chat"][2], seed=6)
    quantize_inputs(hf_model(ref))
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32), adapter).eval()
    quantize_inputs(model)
    assert any(n.endswith("q_proj.base_layer") for n, _ in model.named_modules())
    _peft_models[("peft", adapter)] = model
    check_against_peft(ref, adapter, str(tmp_path / "q"))


def test_w8a8_projection_against_its_definition(tmp_path):
    """One layer's projections: x quantized per token times the int8 weight, times both
    scales; and off from the unquantized x's product by the quantization (the activations'
    rounding shows)."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref")
    layer = ModelRunner(str(tmp_path / "q"), "cpu", torch.float32, 256, 16, 4, 0
                        ).model.layers["1"]
    weights = hf_model(str(tmp_path / "ref")).state_dict()
    x = torch.randn(7, 192)
    want = x @ weights["model.layers.1.mlp.down_proj.weight"].T
    got = layer.mlp.down_proj.matmul(x)
    torch.testing.assert_close(got, quantized_per_token(x) @ weights[
        "model.layers.1.mlp.down_proj.weight"].T, rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() > 1e-3


def test_w8a8_ranks_quantize_their_own_inputs(tmp_path):
    """Two ranks' shards: column-parallel outputs concatenated give the one worker's (the
    whole input quantized alike); row-parallel ranks quantize their own columns of the
    input, as vLLM's do, so their partial sums add up to that (not to the one worker's)."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref")
    args = (str(tmp_path / "q"), "cpu", torch.float32, 256, 16, 4, 0)
    whole = ModelRunner(*args).model.layers["1"]
    halves = [ModelRunner(*args, parallel=ParallelGroup(r, 2, 0, 1)).model.layers["1"]
              for r in range(2)]
    weights = hf_model(str(tmp_path / "ref")).state_dict()
    x = torch.randn(5, 64)
    full = whole.mlp.gate_up_proj
    parts = [h.mlp.gate_up_proj.matmul(x).split(h.mlp.gate_up_proj.part_sizes, -1)
             for h in halves]
    gate_up = torch.cat([weights[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    wanted = (quantized_per_token(x) @ gate_up.T).split(full.part_sizes, -1)
    for p, expected in enumerate(full.matmul(x).split(full.part_sizes, -1)):
        torch.testing.assert_close(expected, wanted[p], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([rank[p] for rank in parts], -1), expected)
    y = torch.randn(5, 192)
    w = weights["model.layers.1.mlp.down_proj.weight"]
    sums = sum(h.mlp.down_proj.matmul(y[:, r * 96:(r + 1) * 96]) for r, h in enumerate(halves))
    want = sum(quantized_per_token(y[:, r * 96:(r + 1) * 96]) @ w[:, r * 96:(r + 1) * 96].T
               for r in range(2))
    torch.testing.assert_close(sums, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,symmetric,static_inputs", [
    ("qwen2", False, True),  # weight zero points; a static activation scale and zero point
])
def test_int8_weights_stored_unpacked_match_transformers_on_their_dequantized_weights(
        tmp_path, arch, symmetric, static_inputs):
    """Weights with zero points: packed as they load and served as W8A16."""
    save_random_checkpoint(str(tmp_path / "base"), arch, seed=5, intermediate_size=192)
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


@pytest.mark.gpu
def test_w8a8_on_gpu_matches_transformers_with_inputs_quantized_per_token(tmp_path):
    """fp32 activations take the int8 kernel at every step (quantized per token): CUDA
    graphs, prompts and decode steps."""
    from tests.engine_harness import InProcessEngine
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref")
    served = InProcessEngine(device="cuda", model=str(tmp_path / "q"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096)
    assert served.worker.runner.model.layers["0"].mlp.down_proj.weight.dtype == torch.int8
    quantize_inputs(hf_model(str(tmp_path / "ref")))
    check_parity_but_near_ties(str(tmp_path / "ref"), served, ragged_workload(seed=3))
    assert served.worker.runner.num_graph_replays > 0


# ---- the GPU kernels (CPU: the Triton interpreter) ----------------------------------------
DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,config", [
    (1, 48, 256, None), (5, 40, 96, None), (20, 72, 160, None), (70, 130, 256, None),
    (300, 136, 512, None),
    (300, 72, 160, (16, 32, 64, 4, 2)),  # bands of 8 row tiles, the last one of 3
])
def test_int8_matmul_kernel(monkeypatch, device, m, n, k, config):
    """int8 rows times int8 weights, summed in int32, scaled per row and per column, plus
    the bias (rows, columns and K past the tiles; every tile once, in bands of rows)."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int8 import int8_matmul
    gen = torch.Generator().manual_seed(m + n)
    q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q_scales, w_scales, bias = torch.rand(m, generator=gen), torch.rand(n, generator=gen), \
        torch.randn(n, generator=gen)
    want = (q.double() @ w.double().T) * q_scales[:, None] * w_scales[None, :] + bias
    got = int8_matmul(*(t.to(device) for t in (q, q_scales, w, w_scales)), torch.float32,
                      bias.to(device), config=config)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_quantization_kernel_rounds_half_to_even(monkeypatch, device):
    """The kernel's rows and scales equal the definition's (amax / 127, torch.round: half
    to even), on rows whose values fall on halves of their grid, and so do the CPU
    path's."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.int8 import quantize_rows
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1500, generator=gen)
    x[0, :5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5])  # (scale 1: halves)
    x[1] = 0.0
    want_s = x.abs().amax(1).clamp(min=1e-12) / 127
    want_q = torch.round(x / want_s[:, None]).clamp(-128, 127).to(torch.int8)
    assert want_q[0, 1:5].tolist() == [2, -4, 0, 0]
    cpu_q, cpu_s = quantize_rows(x)
    assert torch.equal(cpu_q, want_q) and torch.equal(cpu_s, want_s)
    got_q, got_s = quantize_rows(x.cuda()) if device == "cuda" else _interpreted_rows(x)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,split", [(1, 1), (5, 2), (32, 4)])
def test_weight_only_kernel_on_int8_weights(monkeypatch, device, m, split):
    """Decode steps' path: x unquantized times each int8 tile widened to x's dtype, times
    the row scales (kernels.fp8's kernel, its K range split or not), plus the bias."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.fp8 import weight_only_matmul
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 320, generator=gen), \
        torch.randint(-128, 128, (72, 320), generator=gen, dtype=torch.int8)
    scales, bias = torch.rand(72, generator=gen) / 100, torch.randn(72, generator=gen)
    want = x @ (w.float() * scales[:, None]).T + bias
    got = weight_only_matmul(x.to(device), w.to(device), scales.to(device), None,
                             bias.to(device), split_k=split)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_a_symmetric_w8a8_checkpoint_may_store_zero_zero_points(tmp_path):
    """Zero points of all zeros beside symmetric weights (as some writers keep them) are
    skipped; nonzero ones are refused, naming them."""
    from safetensors.torch import load_file, save_file
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_w8a8_checkpoint(tmp_path / "base", tmp_path / "q", tmp_path / "ref")
    tensors = load_file(f"{tmp_path}/q/model.safetensors")
    for key in [k for k in tensors if k.endswith("weight_scale")]:
        tensors[key.replace("weight_scale", "weight_zero_point")] = \
            torch.zeros_like(tensors[key], dtype=torch.int8)
    save_file(tensors, f"{tmp_path}/q/model.safetensors")
    assert engine(tmp_path / "q").worker.runner.model.layers["0"].mlp.down_proj.w8a8
    tensors["model.layers.1.mlp.down_proj.weight_zero_point"][3] = 2
    save_file(tensors, f"{tmp_path}/q/model.safetensors")
    with pytest.raises(ValueError, match="zero points are not all zero"):
        engine(tmp_path / "q")


def _interpreted_rows(x: torch.Tensor):
    """The Triton kernel of quantize_rows run by the interpreter on CPU tensors."""
    from kernels.fp8_quantize import quantize_rows_kernel
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0])
    quantize_rows_kernel[(x.shape[0],)](x, q, scales, x.shape[1], x.stride(0), INT8=True,
                                        BLOCK=1024)
    return q, scales


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 32, 33, 64, 300])
def test_int8_linear_bf16_on_gpu(m):
    """bf16 activations: up to 32 rows x stays bf16 (the weights widened), beyond it is
    quantized per token; each against its definition in fp32."""
    from kernels.int8 import int8_linear
    torch.manual_seed(m)
    w = torch.randint(-127, 128, (6144, 4096), dtype=torch.int8, device="cuda")
    scales = torch.rand(6144, device="cuda") / 500
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    got = int8_linear(x, w, scales)
    xs = x.float() if m <= 32 else quantized_per_token(x.float())
    want = xs @ (w.float() * scales[:, None]).T
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-3


def test_the_benchmarks_writer_makes_w8a8_checkpoints_the_engine_serves(tmp_path):
    """load_tests/int4_checkpoint.py --w8a8 on a bf16 checkpoint: each projection int8 with
    a bf16 scale per row, within half a step of the original, served as W8A8; a mixture's
    experts as W8A16."""
    from safetensors.torch import load_file
    from load_tests.int4_checkpoint import main
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192,
                           dtype=torch.bfloat16)
    main(["--model", str(tmp_path / "base"), "--w8a8", "--out", str(tmp_path / "q")])
    written = {k: v for f in (tmp_path / "q").glob("*.safetensors")
               for k, v in load_file(str(f)).items()}
    stem = "model.layers.1.mlp.down_proj."
    scales = written[stem + "weight_scale"].float()
    original = load_file(f"{tmp_path}/base/model.safetensors")[stem + "weight"].float()
    step_errors = (written[stem + "weight"].float() * scales - original).abs() / scales
    assert written[stem + "weight"].dtype == torch.int8 and step_errors.max() <= 0.5 + 1e-3
    assert written[stem + "weight_scale"].dtype == torch.bfloat16
    assert engine(tmp_path / "q").worker.runner.model.layers["1"].mlp.down_proj.w8a8
    moe_checkpoint(tmp_path / "moe", "qwen3-moe")
    main(["--model", str(tmp_path / "moe"), "--w8a8", "--out", str(tmp_path / "moe-q")])
    assert experts_of(engine(tmp_path / "moe-q").worker.runner).w13.dtype == torch.int32
