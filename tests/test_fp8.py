"""FP8 weights: checkpoints in transformers' fine-grained FP8 and compressed-tensors formats,
and online quantization, each served with greedy outputs equal to transformers' on the same
weights dequantized (fp32, CPU: the weights are dequantized for each matmul); tensor-parallel
shards of weights and scales; the formats and combinations refused at start. The quantization
below is this test's own (a loop over blocks), not the engine's."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_actors.checkpoint import model_info, save_random_checkpoint
from engine_actors.config import EngineConfig
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ParallelGroup
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine
from tests.test_parity import check_parity, hf_greedy, ragged_workload

E4M3 = torch.float8_e4m3fn
PROJECTION = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def quantize(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w in e4m3 by blocks of rows x cols, each block's absolute maximum mapped to 448."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3)
    scales = torch.empty(-(-n // rows), -(-k // cols))
    for i in range(0, n, rows):
        for j in range(0, k, cols):
            block = w[i:i + rows, j:j + cols]
            scales[i // rows, j // cols] = block.abs().max() / 448
            q[i:i + rows, j:j + cols] = (block / scales[i // rows, j // cols]).to(E4M3)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    w = q.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] *= scales[i, j]
    return w


def ct_config(strategy: str, block=None, static_inputs: bool = False) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False, **({"block_structure": list(block)} if block else {})}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True,
              **({"strategy": "tensor", "dynamic": False} if static_inputs
                 else {"strategy": "token", "dynamic": True})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs}}}


# name -> (quantization_config, what one scale covers: a block (rows, cols), "row" or
# "tensor", the scales' tensor name)
FORMATS = {
    # transformers' fine-grained FP8 (Qwen3-*-FP8); the down projection's 176 columns end in
    # half a block
    "fp8-blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [16, 32]}, (16, 32), "weight_scale_inv"),
    "compressed-tensors-channel": (ct_config("channel"), "row", "weight_scale"),
    "compressed-tensors-tensor-static": (ct_config("tensor", static_inputs=True), "tensor",
                                         "weight_scale"),
    "compressed-tensors-blocks": (ct_config("block", (16, 16)), (16, 16), "weight_scale"),
}


def write_fp8_checkpoint(src, fp8_dir, ref_dir, fmt: tuple, projections=PROJECTION) -> None:
    """fp8_dir: src's projections (the weights `projections` finds) quantized in format `fmt`
    (as FORMATS'); ref_dir: src with those weights dequantized (what the FP8 checkpoint
    means, for transformers)."""
    config, block, scale_name = fmt
    static = "static" in json.dumps(config.get("config_groups", {}))
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(f"{src}/model.safetensors")
    fp8, ref = {}, {}
    for key, w in tensors.items():
        if not projections.search(key):
            fp8[key] = ref[key] = w
            continue
        rows, cols = {"row": (1, w.shape[1]), "tensor": w.shape}.get(block, block)
        q, scales = quantize(w, rows, cols)
        fp8[key], ref[key] = q, dequantize(q, scales, rows, cols)
        stem = key.removesuffix("weight")
        fp8[stem + scale_name] = scales.reshape(-1) if block == "tensor" else scales
        if static:
            fp8[stem + "input_scale"] = torch.tensor([0.05])  # (not used: per token)
    save_file(fp8, f"{fp8_dir}/model.safetensors")
    save_file(ref, f"{ref_dir}/model.safetensors")
    cfg = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_random_checkpoint(str(path), "llama", seed=5)
    return path


def engine(model, **args) -> InProcessEngine:
    return InProcessEngine(model=str(model), max_batch_size=8, block_size=4,
                           max_num_batched_tokens=24, max_num_tokens=4096, **args)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(base, tmp_path, name):
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    write_fp8_checkpoint(base, fp8, ref, FORMATS[name])
    runner = engine(fp8).worker.runner
    assert runner.model.layers["0"].mlp.down_proj.weight.dtype == E4M3
    check_parity(str(ref), engine(fp8), ragged_workload(seed=3))


@pytest.mark.parametrize("name", ["fp8-blocks", "compressed-tensors-tensor-static"])
def test_phi3_fp8_checkpoint_splits_its_fused_scales(tmp_path, name):
    """Phi-3's fused qkv_proj and gate_up_proj: block scales split by rows of blocks, one
    per-tensor scale shared by the parts."""
    save_random_checkpoint(str(tmp_path / "base"), "phi3", seed=5, num_key_value_heads=1)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", FORMATS[name])
    check_parity(str(tmp_path / "ref"), engine(tmp_path / "fp8"), ragged_workload(seed=3))


def test_online_quantization_matches_transformers_on_rows_quantized(base, tmp_path):
    """quantization: fp8 on an unquantized checkpoint: one scale per output row."""
    rows_reference(base, tmp_path / "ref")
    check_parity(str(tmp_path / "ref"), engine(base, quantization="fp8"),
                 ragged_workload(seed=4))
    plain = engine(base)  # (quantizing changes the outputs: the test above can fail)
    arrivals = ragged_workload(seed=4)
    outputs = plain.run(arrivals)
    assert any(outputs[rid] != hf_greedy(str(tmp_path / "ref"), prompt, s.max_tokens)
               for reqs in arrivals.values() for rid, prompt, s in reqs)


def blocks(rows: int, cols: int) -> tuple:
    return ({"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [rows, cols]}, (rows, cols), "weight_scale_inv")


@pytest.mark.parametrize("fmt", [blocks(16, 16), FORMATS["compressed-tensors-channel"]],
                         ids=["blocks", "channel"])
def test_tensor_parallel_ranks_hold_their_shards_of_weights_and_scales(tmp_path, fmt):
    """Two ranks' projections together give the one worker's: column-parallel outputs
    concatenated part by part, row-parallel partial sums added."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=6, intermediate_size=192)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", fmt)
    check_shards_add_up(tmp_path / "fp8")


def check_shards_add_up(checkpoint) -> None:
    """Layer 1's projections on two ranks against one worker (a llama of intermediate size
    192): column-parallel outputs concatenated part by part, row-parallel partial sums
    added."""
    args = (str(checkpoint), "cpu", torch.float32, 256, 16, 4, 0)
    whole = ModelRunner(*args).model.layers["1"]
    halves = [ModelRunner(*args, parallel=ParallelGroup(r, 2, 0, 1)).model.layers["1"]
              for r in range(2)]
    x = torch.randn(5, 64)
    for path in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        full = whole.get_submodule(path)
        parts = [h.get_submodule(path).matmul(x).split(h.get_submodule(path).part_sizes, -1)
                 for h in halves]
        want = full.matmul(x).split(full.part_sizes, -1)
        for p, expected in enumerate(want):
            torch.testing.assert_close(torch.cat([rank[p] for rank in parts], -1), expected)
    for path, width in (("self_attn.o_proj", 64), ("mlp.down_proj", 192)):
        y = torch.randn(5, width)
        sums = sum(h.get_submodule(path).matmul(y[:, r * width // 2:(r + 1) * width // 2])
                   for r, h in enumerate(halves))
        torch.testing.assert_close(sums, whole.get_submodule(path).matmul(y))


def test_lora_adapter_on_fp8_weights_matches_transformers_peft(base, tmp_path):
    """Adapters (in the activations' dtype) over FP8 projections: transformers + peft on the
    dequantized weights."""
    from tests.test_lora import ADAPTERS, check_against_peft, save_adapter
    write_fp8_checkpoint(base, tmp_path / "fp8", tmp_path / "ref", FORMATS["fp8-blocks"])
    save_adapter(str(tmp_path / "ref"), str(tmp_path / "lora"), 8, 16, ADAPTERS["chat"][2],
                 seed=6)
    check_against_peft(str(tmp_path / "ref"), str(tmp_path / "lora"), str(tmp_path / "fp8"))


def test_blocks_that_straddle_shards_are_refused(tmp_path):
    """32-row blocks over 16-row K/V shards (one KV head per rank) cannot be split."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", intermediate_size=192)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", blocks(32, 32))
    args = (str(tmp_path / "fp8"), "cpu", torch.float32, 256, 16, 4, 0)
    ModelRunner(*args)  # one worker: fine
    with pytest.raises(ValueError, match=r"FP8 weight blocks of \[32, 32\] do not divide"):
        ModelRunner(*args, parallel=ParallelGroup(0, 2, 0, 1))


@pytest.mark.parametrize("quantization_config,args,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, {},
     r"quantized checkpoints \('bitsandbytes'\) are not"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16]},
     {}, "static activation scales"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.down_proj"]}, {},
     r"unquantized decoder projections .*layers.0.mlp.down_proj"),
    (ct_config("channel") | {"config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "float"}}}}, {}, "INT8 weights with float activations"),
    (ct_config("group"), {}, "FP8 weights by 'group' are not supported"),
    (ct_config("channel") | {"config_groups": {"g": {
        **ct_config("channel")["config_groups"]["group_0"], "targets": ["Embedding"]}}}, {},
     r"groups targeting \['Embedding'\] are not supported"),
    (FORMATS["fp8-blocks"][0], {"enable_finetuning": True}, "enable_finetuning with FP8"),
])
def test_unserved_quantizations_are_refused_at_start(base, tmp_path, quantization_config,
                                                      args, message):
    shutil.copytree(base, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=message):
        model_info(EngineConfig(model=str(tmp_path), **args))


def test_fp8_weights_stored_in_another_dtype_are_refused(base, tmp_path):
    """A config that says FP8 over weights that are not (llm-compressor's fake-quantized
    "dense" save, or a float-quantized config over bf16 tensors): refused, not cast."""
    write_fp8_checkpoint(base, tmp_path / "fp8", tmp_path / "ref",
                         FORMATS["compressed-tensors-channel"])
    tensors = load_file(f"{tmp_path}/ref/model.safetensors")  # (dequantized weights)
    tensors.update({k: v for k, v in load_file(f"{tmp_path}/fp8/model.safetensors").items()
                    if k.endswith("weight_scale")})
    save_file(tensors, f"{tmp_path}/fp8/model.safetensors")
    with pytest.raises(ValueError, match="weight is stored as torch.float32, not float8"):
        engine(tmp_path / "fp8")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["format"] = "dense"
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="compressed-tensors format 'dense' is not supported"):
        model_info(EngineConfig(model=str(tmp_path / "fp8")))


def test_a_quantized_embedding_or_lm_head_is_refused():
    from engine_actors.layers.embedding import ParallelLMHead
    head = ParallelLMHead(10, 4)
    with pytest.raises(ValueError, match="quantized embedding or LM head"):
        head.load("weight", torch.randn(10, 4).to(E4M3))
    with pytest.raises(ValueError, match="quantized embedding or LM head"):
        head.load("weight_scale", torch.ones(10, 1))


# ---- the GPU kernels (CPU: the matmul in the Triton interpreter) ------------------------
def group_quantized(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x per row and group of columns in e4m3, each group's absolute maximum mapped to 448."""
    q, scales = zip(*(quantize(row[None], 1, group) for row in x.float().cpu()))
    return torch.cat(q).to(x.device), torch.cat(scales).to(x.device)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,group", [(1, 4096, 128), (37, 200, 64), (300, 1000, 128)])
def test_activation_quantization_kernel(m, k, group):
    from kernels.fp8_quantize import quantize_groups
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    q, scales = quantize_groups(x, group)
    want_q, want_scales = group_quantized(x, group)
    torch.testing.assert_close(scales, want_scales)
    assert torch.equal(q.float(), want_q.float())


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,n,k,block", [(5, 48, 200, None), (5, 48, 200, 16),
                                         (70, 200, 256, None), (300, 256, 384, 128),
                                         (1, 4096, 512, 128)])
def test_fp8_matmul_kernel(monkeypatch, device, m, n, k, block):
    """Each group's product scaled by its activation and weight scales, against the
    dequantized operands' fp32 matmul (weights per row, or per block x 64-column group)."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.fp8 import fp8_matmul
    if device == "cpu" and m * n * k > 5e6:
        pytest.skip("too slow in the interpreter")
    group = 64
    torch.manual_seed(m + n)
    q, q_scales = group_quantized(torch.randn(m, k), group)
    w, w_scales = quantize(torch.randn(n, k), block or 1, group if block else k)
    w_scales = w_scales if block else w_scales.reshape(n)
    want = dequantize(q, q_scales, 1, group) @ dequantize(
        w, w_scales.reshape(n, 1) if block is None else w_scales, block or 1,
        group if block else k).T
    got = fp8_matmul(*(t.to(device) for t in (q, q_scales, w, w_scales)), block,
                     torch.float32, group=group)
    # (Hopper's FP8 tensor cores add a group's products in less than fp32's precision)
    atol = 1e-3 if device == "cpu" else 2e-3 * want.abs().max().item()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,n,k,block,split", [(1, 48, 200, None, 1), (3, 40, 600, None, 3),
                                               (5, 64, 300, (16, 64), 2),
                                               (20, 96, 256, (32, 128), 1)])
def test_weight_only_kernel(monkeypatch, device, m, n, k, block, split):
    """x unquantized times each weight tile widened as it loads (with tiles 128 columns
    deep: two 64-column blocks' scales in one tile, a tile of a partial block at the end),
    the K range split over programs or not."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.fp8 import weight_only_matmul
    torch.manual_seed(m)
    rows, cols = block or (1, k)
    w, w_scales = quantize(torch.randn(n, k), rows, cols)
    w_scales = w_scales if block else w_scales.reshape(n)
    x, bias = torch.randn(m, k), torch.randn(n)
    want = x @ dequantize(w, w_scales.reshape(n, 1) if block is None else w_scales, rows,
                          cols).T + bias
    got = weight_only_matmul(*(t.to(device) for t in (x, w, w_scales)), block, bias.to(device),
                             split_k=split)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_activation_scales_group_by_group():
    """The layout cuBLASLt's blockwise matmul takes: the same scales, stored column-first."""
    from kernels.fp8_quantize import quantize_groups
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    q, scales = quantize_groups(x, 128)
    q_t, scales_t = quantize_groups(x, 128, columns_first=True)
    assert torch.equal(q.float(), q_t.float()) and torch.equal(scales, scales_t)
    assert scales_t.stride() == (1, 37)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["rows", "blocks"])
@pytest.mark.parametrize("m", [5, 300])
def test_fp8_linear_on_gpu(m, block):
    """The engine's dispatch (row scales and few tokens: weights widened as they load; else
    activations quantized, on cuBLASLt or the W8A8 kernel) against the dequantized weight in
    fp32: within bf16's rounding when widened, and e4m3 activations' otherwise."""
    from kernels.fp8 import fp8_linear
    torch.manual_seed(m)
    rows, cols = block or (1, 512)
    w, scales = quantize(torch.randn(384, 512), rows, cols)
    scales = scales if block else scales.reshape(-1)
    bias = torch.randn(384)
    x = torch.randn(m, 512)
    want = x @ dequantize(w, scales.reshape(-1, 1) if block is None else scales, rows, cols).T \
        + bias
    got = fp8_linear(x.cuda().bfloat16(), w.cuda(), scales.cuda(), block, bias.cuda().bfloat16())
    error = (got.float().cpu() - want).norm() / want.norm()
    widened = block is None and m <= 16  # (weight_only_matmul; else e4m3 activations)
    assert error < (0.01 if widened else 0.04), error


def hf_quantized(path, group: int | None):
    """transformers' model on GPU in fp32, every projection's input quantized per token and
    group of `group` columns first (None: not quantized)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()

    def quantized(module, args):
        x = args[0]
        g = x.reshape(*x.shape[:-1], -1, group)
        scales = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
        return ((g / scales).to(E4M3).float() * scales).reshape(x.shape),
    for name, module in model.named_modules():
        if group and name.endswith("_proj") and "layers" in name:
            module.register_forward_pre_hook(quantized)
    return model


def rows_reference(base, ref, projections=PROJECTION) -> None:
    """ref: base with its projections quantized per row and dequantized (what online
    quantization serves)."""
    shutil.copytree(base, ref, dirs_exist_ok=True)
    tensors = load_file(f"{base}/model.safetensors")
    for key, w in tensors.items():
        if projections.search(key):
            tensors[key] = dequantize(*quantize(w, 1, w.shape[1]), 1, w.shape[1])
    save_file(tensors, f"{ref}/model.safetensors")


@pytest.mark.gpu
def test_online_fp8_on_gpu_matches_transformers(base, tmp_path):
    """fp32 activations keep the weight-only kernel at every step (weights widened to fp32
    as they load): greedy tokens equal to transformers' on the row-quantized weights."""
    rows_reference(base, tmp_path / "ref")
    engine = InProcessEngine(device="cuda", model=str(base), dtype="float32", quantization="fp8",
                             max_batch_size=8, max_num_tokens=4096, enforce_eager=True)
    check_parity(str(tmp_path / "ref"), engine, ragged_workload(seed=3), device="cuda")


@pytest.mark.gpu
def test_fp8_activations_quantized_as_transformers_with_quantized_inputs(tmp_path):
    """Blocks of 32 x 32 take the W8A8 kernel at every step, activations quantized per token
    and 32-column group: the prompts' log-probabilities are much closer to transformers'
    with each projection's input quantized so than to transformers' without (the
    quantization shows, and it is the one done)."""
    save_random_checkpoint(str(tmp_path / "base"), "llama", seed=5, intermediate_size=192)
    write_fp8_checkpoint(tmp_path / "base", tmp_path / "fp8", tmp_path / "ref", blocks(32, 32))
    engine = InProcessEngine(device="cuda", model=str(tmp_path / "fp8"), dtype="float32",
                             max_batch_size=8, max_num_tokens=4096, enforce_eager=True)
    ref = str(tmp_path / "ref")
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=rng).tolist()
               for n in torch.randint(2, 60, (10,), generator=rng)]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine.run({0: [(f"r{i}", p, sampling) for i, p in enumerate(prompts)]})
    errors_by = {}
    for group in (32, None):
        model = hf_quantized(ref, group)
        errors = []
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                logits = model(torch.tensor([prompt], device="cuda")).logits[0]
            want = torch.log_softmax(logits.float(), -1).cpu()
            errors += [abs(lp - want[p, prompt[p + 1]].item())
                       for p, (lp, *_) in enumerate(engine.prompt_logprobs[f"r{i}"])]
        errors_by[group] = torch.tensor(errors).median().item()
    # A rounding flipped by fp32 noise moves the later layers, so not equality: medians.
    # On an H200 they were 0.070 against 0.168; unquantized activations would give about
    # 0.17 against 0, wrong scales large errors against both.
    assert errors_by[32] < 0.6 * errors_by[None], errors_by
