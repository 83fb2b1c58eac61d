"""Checkpoints users have: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, Granite, OLMo 2
and 3, SmolLM3, Seed-OSS, EXAONE 4.0, and the mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral, in fp32, bf16 or
fp16, whole or sharded, each with greedy outputs equal to transformers' (fp32 compute)."""
from __future__ import annotations

import json

import pytest
import torch

from engine_actors.checkpoint import model_info, save_random_checkpoint
from engine_actors.config import EngineConfig
from tests.engine_harness import InProcessEngine
from tests.test_parity import check_parity, ragged_workload

GEMMA3 = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
              layer_types=["sliding_attention", "full_attention"] * 2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
GEMMA2 = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
              layer_types=["sliding_attention", "full_attention"] * 2,
              attn_logit_softcapping=2.0, final_logit_softcapping=10.0,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
               logits_scaling=8.0)  # (granite-3.x's, the score scale for 16-wide heads)
CHECKPOINTS = {
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window-covers-context": ("mistral", dict(sliding_window=4096)),
    "mistral-window-8": ("mistral", dict(sliding_window=8)),  # prompts up to 60 tokens
    "qwen2-window-on-upper-layers": ("qwen2", dict(sliding_window=8, use_sliding_window=True,
                                                   max_window_layers=2)),
    "phi3-window-8": ("phi3", dict(sliding_window=8)),
    "qwen2": ("qwen2", dict()),
    "qwen2.5-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-bias-head24": ("qwen3", dict(head_dim=24, attention_bias=True)),
    "llama-bf16-sharded": ("llama", dict(dtype=torch.bfloat16, max_shard_size="40KB")),
    "llama-fp16": ("llama", dict(dtype=torch.float16)),
    "phi3": ("phi3", dict()),  # fused qkv_proj and gate_up_proj in the checkpoint
    "phi3-gqa-sharded": ("phi3", dict(num_key_value_heads=1, max_shard_size="40KB")),
    # sliding layers of 8 positions with a rotary of their own, beside full ones with linear
    # rope scaling (as the 4B+ releases); tied embeddings (as all Gemma 3)
    "gemma3": ("gemma3_text", dict(
        GEMMA3, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                    "factor": 8.0}})),
    "gemma3-bf16-one-type": ("gemma3_text", dict(GEMMA3, dtype=torch.bfloat16,
                                                 layer_types=["full_attention"] * 4)),
    # soft caps low enough that tanh bends the scores and logits these weights give
    "gemma2": ("gemma2", GEMMA2),
    # mixtures of experts: every token's top 2 of 8 (4) experts; a dense layer among them
    "qwen3-moe": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=True,
                                    mlp_only_layers=[2])),
    "qwen3-moe-unnormed-bf16": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32,
                                                  num_experts=8, num_experts_per_tok=3,
                                                  norm_topk_prob=False,
                                                  dtype=torch.bfloat16)),
    # Qwen1.5-MoE's and Qwen2-57B's: a shared expert beside the routed ones, q/k/v biases
    "qwen2-moe": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                    mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(intermediate_size=48, num_local_experts=4,
                                num_experts_per_tok=2)),
    "granite": ("granite", GRANITE),
    # norms after each sublayer, q and k normed over all heads
    "olmo2": ("olmo2", dict(attention_bias=True)),
    # three sliding layers of 8 positions to one full one, each type with its own rotary
    # (yarn on the full layers, as OLMo 3's long-context releases)
    "olmo3-window-8": ("olmo3", dict(
        sliding_window=8, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 1024}})),
    # no rotary in every other layer (NoPE); a window on those, as use_sliding_window sets
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),
    "smollm3-window-8": ("smollm3", dict(no_rope_layer_interval=2, use_sliding_window=True,
                                         sliding_window=8, dtype=torch.bfloat16)),
    # OLMo's post-norms, q and k norms per head; rotary on the sliding layers only (NoPE on
    # the full ones), or on every layer without a window
    "exaone4-window-8": ("exaone4", dict(head_dim=32, sliding_window=8,
                                         sliding_window_pattern=2)),
    "exaone4": ("exaone4", dict(head_dim=32, sliding_window=None,
                                layer_types=["full_attention"] * 4)),
    # q/k/v biases, and o_proj's own (attention_out_bias); the released 36B's: only q/k/v's
    "seed-oss": ("seed_oss", dict(head_dim=32, attention_bias=True, attention_out_bias=True)),
    "seed-oss-released": ("seed_oss", dict(head_dim=32, attention_bias=True,
                                           attention_out_bias=False)),
}


def perturb_norms_and_biases(path, seed: int = 0) -> None:
    """Every norm weight drawn from N(1, 0.5) and every bias from N(0, 0.5) (transformers
    starts them at 1 and 0: a model that left a norm's weight or a bias out would match)."""
    from safetensors.torch import load_file, save_file
    gen = torch.Generator().manual_seed(seed)
    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        for key, t in tensors.items():
            if key.endswith("norm.weight") or key.endswith(".bias"):
                noise = torch.randn(t.shape, generator=gen) * 0.5
                tensors[key] = (noise + (1.0 if key.endswith("weight") else 0.0)).to(t.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_greedy_matches_transformers(name, tmp_path):
    model_type, overrides = CHECKPOINTS[name]
    save_random_checkpoint(str(tmp_path), model_type, seed=5, **overrides)
    perturb_norms_and_biases(tmp_path)
    engine = InProcessEngine(model=str(tmp_path), max_batch_size=8, block_size=4,
                             max_num_batched_tokens=24, max_num_tokens=4096,
                             max_model_len=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=3))


@pytest.mark.parametrize("model_type", ["gemma2", "granite"])
def test_scaled_logits_give_transformers_logprobs(tmp_path, model_type):
    """Gemma 2's final soft-capping and Granite's logits_scaling leave greedy tokens as they
    are (they keep the order): the log-probabilities show them."""
    from engine_actors.request import SamplingParams
    from tests.engine_harness import hf_model
    save_random_checkpoint(str(tmp_path), model_type, seed=5,
                           **(GEMMA2 if model_type == "gemma2" else GRANITE))
    engine = InProcessEngine(model=str(tmp_path), max_batch_size=8, block_size=4,
                             max_num_batched_tokens=24, max_num_tokens=4096)
    prompt = list(range(60, 90))
    out = engine.run({0: [("r", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True, logprobs=3))]})["r"]
    with torch.no_grad():
        logits = hf_model(str(tmp_path))(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    assert (ref.exp().max(-1).values < 0.9).all()  # (the cap or scaling flattens them)
    for t, (lp, ids, values, _) in enumerate(engine.logprobs["r"]):
        assert lp == pytest.approx(ref[t, out[t]].item(), abs=1e-4)
        assert values == pytest.approx(ref[t].topk(3).values.tolist(), abs=1e-4)


def write_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    save_random_checkpoint(str(tmp_path), "llama")
    for name in ["FalconForCausalLM", "FalconForSequenceClassification"]:
        write_config(tmp_path, architectures=[name])
        with pytest.raises(ValueError) as e:
            model_info(EngineConfig.from_args({"model": str(tmp_path), "runner": "pooling"}))
        message = str(e.value)
        assert f"architecture {name!r} is not supported" in message
    assert all(a in message for a in ["LlamaForCausalLM", "MistralForCausalLM",
                                      "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                      "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                      "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"])


@pytest.mark.parametrize("changes,args,match", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.75}), {}, "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                           "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                           "original_max_position_embeddings": 2048}), {}, "longrope"),
    ({}, {"enable_finetuning": True}, "enable_finetuning is not supported for Phi3"),
])
def test_phi3_variants_this_engine_cannot_run_fail_the_start(tmp_path, changes, args, match):
    """Phi-4-mini's partial rotary, the 128k releases' LongRoPE, and fine-tuning (its
    adapters target q/k/v and gate/up apart): refused at start, saying what."""
    save_random_checkpoint(str(tmp_path), "phi3")
    write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        model_info(EngineConfig.from_args({"model": str(tmp_path), **args}))


@pytest.mark.parametrize("changes,args,match", [
    (dict(final_logit_softcapping=30.0), {}, "final_logit_softcapping"),
    (dict(attn_logit_softcapping=50.0), {}, "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), {}, "use_bidirectional_attention"),
    (dict(rope_parameters={kind: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
                           for kind in ("sliding_attention", "full_attention")}), {}, "yarn"),
    (dict(layer_types=["full_attention"] * 4), {"enable_finetuning": True},
     "enable_finetuning is not supported"),
])
def test_gemma3_variants_this_engine_cannot_run_fail_the_start(tmp_path, changes, args, match):
    save_random_checkpoint(str(tmp_path), "gemma3_text", **GEMMA3)
    write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        model_info(EngineConfig.from_args({"model": str(tmp_path), **args}))


@pytest.mark.parametrize("model_type,args,match", [
    ("olmo2", {"tensor_parallel_size": 2}, "tensor_parallel_size 2 is not supported for Olmo2"),
    ("olmo3", {"tensor_parallel_size": 2}, "tensor_parallel_size 2 is not supported for Olmo3"),
    ("olmo2", {"enable_finetuning": True}, "enable_finetuning is not supported for Olmo2"),
    ("smollm3", {"enable_finetuning": True}, "enable_finetuning is not supported for SmolLM3"),
    ("exaone4", {"enable_finetuning": True}, "enable_finetuning is not supported for Exaone4"),
])
def test_olmo_and_smollm3_refuse_what_they_cannot_run(tmp_path, model_type, args, match):
    """OLMo's q and k norms span all heads (no tensor parallelism); neither trains (the
    trainer's pass is Llama's)."""
    save_random_checkpoint(str(tmp_path), model_type)
    assert model_info(EngineConfig.from_args({"model": str(tmp_path)}))
    if model_type == "exaone4":  # (its q and k norms are per head: it shards)
        assert model_info(EngineConfig.from_args({"model": str(tmp_path),
                                                  "tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match=match):
        model_info(EngineConfig.from_args({"model": str(tmp_path), **args}))


def test_a_rope_type_keyed_by_layer_type_is_checked_at_start(tmp_path):
    """OLMo 3 keys its rope parameters by layer type: one that rescales at run time there
    fails the start, as at the top level."""
    save_random_checkpoint(str(tmp_path), "olmo3", sliding_window=8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "dynamic", "rope_theta": 1e4,
                                                "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        model_info(EngineConfig.from_args({"model": str(tmp_path)}))


@pytest.mark.parametrize("model_type", ["olmo2", "smollm3", "exaone4"])
def test_lora_adapters_on_olmo_and_smollm3_match_transformers_peft(tmp_path, model_type):
    from tests.test_lora import ADAPTERS, check_against_peft, save_adapter
    save_random_checkpoint(str(tmp_path / "base"), model_type, seed=5,
                           **({"no_rope_layer_interval": 2} if model_type == "smollm3" else {}))
    save_adapter(str(tmp_path / "base"), str(tmp_path / "lora"), *ADAPTERS["chat"], seed=6)
    check_against_peft(str(tmp_path / "base"), str(tmp_path / "lora"))


def test_fine_tuning_refuses_a_sliding_window_shorter_than_the_context(tmp_path):
    """Serving follows the window; fine-tuning's attention has none."""
    save_random_checkpoint(str(tmp_path), "mistral", sliding_window=512)
    assert model_info(EngineConfig.from_args({"model": str(tmp_path)})).max_model_len == 4096
    with pytest.raises(ValueError, match="sliding-window"):
        model_info(EngineConfig.from_args({"model": str(tmp_path), "enable_finetuning": True}))
    info = model_info(EngineConfig.from_args({"model": str(tmp_path), "max_model_len": 512,
                                              "enable_finetuning": True}))
    assert info.max_model_len == 512


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,head_dim", [("llama", 80), ("llama", 128), ("qwen3", 80),
                                                 ("phi3", 96)])
def test_greedy_matches_transformers_on_gpu_fp32_for_head_sizes(model_type, head_dim, tmp_path):
    """Triton kernels at head sizes that are not (80) and are (128) powers of two."""
    save_random_checkpoint(str(tmp_path), model_type, seed=7, hidden_size=4 * head_dim,
                           head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2)
    engine = InProcessEngine(device="cuda", model=str(tmp_path), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=11), device="cuda")
    assert engine.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["olmo3-window-8", "smollm3-window-8"])
def test_olmo3_and_smollm3_on_gpu_fp32(name, tmp_path):
    """The q and k norms over all heads (a strided view of the qkv output) in the Triton
    norm, NoPE layers, windows and rotaries per layer type, CUDA graphs."""
    model_type, overrides = CHECKPOINTS[name]
    save_random_checkpoint(str(tmp_path), model_type, seed=7, **dict(overrides, head_dim=128,
                           hidden_size=512, dtype=torch.float32))
    perturb_norms_and_biases(tmp_path)
    engine = InProcessEngine(device="cuda", model=str(tmp_path), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=11), device="cuda")
    assert engine.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_matches_transformers_on_gpu_fp32_at_its_head_size(model_type, tmp_path):
    """Gemma's head size (256), norms, GELU and rotaries (Gemma 3's per layer type), and
    Gemma 2's soft-capped scores in the Triton kernel (with its windows), CUDA graphs.
    Gemma 2's caps are its own (50, 30): lower ones (as on CPU) flatten this random model's
    attention until its top logits nearly tie, and fp32 rounding then decides its tokens."""
    config = dict(GEMMA3, head_dim=256, query_pre_attn_scalar=256) \
        if model_type == "gemma3_text" else dict(
            GEMMA2, head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0)
    save_random_checkpoint(str(tmp_path), model_type, seed=7, **config)
    engine = InProcessEngine(device="cuda", model=str(tmp_path), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=11), device="cuda")
    assert engine.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
def test_a_mixture_of_experts_on_gpu(tmp_path, name):
    """fp32: transformers' greedy tokens through the fused expert kernel. bf16: the kernel,
    captured in CUDA graphs, gives the tokens of the same steps run eagerly."""
    model_type, overrides = CHECKPOINTS[name]
    save_random_checkpoint(str(tmp_path), model_type, seed=7, **dict(
        overrides, hidden_size=128, moe_intermediate_size=64))
    args = dict(device="cuda", model=str(tmp_path), max_batch_size=8,
                max_num_batched_tokens=24, max_num_tokens=4096)
    engine = InProcessEngine(dtype="float32", **args)
    check_parity(str(tmp_path), engine, ragged_workload(seed=11), device="cuda")
    assert engine.worker.runner.num_graph_replays > 0
    graphs = InProcessEngine(dtype="bfloat16", **args)
    eager = InProcessEngine(dtype="bfloat16", enforce_eager=True, **args)
    assert graphs.run(ragged_workload(seed=12)) == eager.run(ragged_workload(seed=12))
    assert graphs.worker.runner.num_graph_replays > 0


@pytest.mark.gpu
def test_a_sliding_window_matches_transformers_on_gpu_fp32(tmp_path):
    """The Triton kernel's window, in prefill tiles, decodes and CUDA graphs."""
    save_random_checkpoint(str(tmp_path), "mistral", seed=7, sliding_window=8)
    engine = InProcessEngine(device="cuda", model=str(tmp_path), dtype="float32",
                             max_batch_size=8, max_num_batched_tokens=24, max_num_tokens=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=13), device="cuda")
    assert engine.worker.runner.num_graph_replays > 0


def test_fine_tuning_refuses_tensor_parallelism_that_replicates_kv_heads(tmp_path):
    """Serving replicates a KV head over the ranks; training does not: refused at start."""
    save_random_checkpoint(str(tmp_path), "qwen2", num_key_value_heads=1)
    args = {"model": str(tmp_path), "tensor_parallel_size": 2}
    assert model_info(EngineConfig.from_args(args)).name  # serving alone starts
    with pytest.raises(ValueError, match="enable_finetuning with tensor_parallel_size 2"):
        model_info(EngineConfig.from_args({**args, "enable_finetuning": True}))


@pytest.mark.parametrize("layout", ["released", "transformers"])
def test_gemma3_multimodal_checkpoints_serve_their_text_model(tmp_path, layout):
    """Gemma 3's 4B-27B releases (Gemma3ForConditionalGeneration): their text model, greedy
    as transformers' multimodal model on text alone; the vision tower is not loaded. Its
    weights may be named `language_model.model.*` (as released) or
    `model.language_model.*`."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from engine_actors.checkpoint import save_byte_tokenizer
    text = dict(GEMMA3, vocab_size=300, hidden_size=64, intermediate_size=176,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                hidden_activation="gelu_pytorch_tanh", initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(3)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # (zeros at init: 1 + weight)
            param.data.normal_(0.0, 0.5)
    model.save_pretrained(str(tmp_path))
    save_byte_tokenizer(str(tmp_path))
    if layout == "transformers":
        weights = load_file(str(tmp_path / "model.safetensors"))
        save_file({k.replace("language_model.model.", "model.language_model."): v
                   for k, v in weights.items()}, str(tmp_path / "model.safetensors"),
                  metadata={"format": "pt"})
    info = model_info(EngineConfig.from_args({"model": str(tmp_path)}))
    assert info.architecture == "Gemma3ForCausalLM"
    engine = InProcessEngine(model=str(tmp_path), max_batch_size=8, block_size=4,
                             max_num_batched_tokens=24, max_num_tokens=4096)
    check_parity(str(tmp_path), engine, ragged_workload(seed=3))


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_finetuning_a_mixture_of_experts_is_refused_at_start(tmp_path, name):
    model_type, overrides = CHECKPOINTS[name]
    save_random_checkpoint(str(tmp_path), model_type, **overrides)
    with pytest.raises(ValueError, match=r"enable_finetuning is not supported for \w+ \(a "
                                         r"mixture of experts; LoRA adapters of its attention"):
        model_info(EngineConfig.from_args({"model": str(tmp_path), "enable_finetuning": True}))


def test_experts_load_per_expert_or_stacked_and_shard_over_ranks():
    """A checkpoint's per-expert tensors (as released and as transformers saves them) and
    transformers 5's stacked ones (the random-weight benchmark models') fill the same
    weights; each of two ranks holds its half of every expert's intermediate features."""
    from engine_actors.layers.moe import SparseMoE
    from engine_actors.parallel import ParallelGroup
    gate_up, down = torch.randn(4, 2 * 6, 8), torch.randn(4, 8, 6)
    stacked, split = SparseMoE(8, 6, 4, 2, True, True), SparseMoE(8, 6, 4, 2, True, True)
    keys = stacked.load_checkpoint("gate_up_proj", gate_up) + \
        stacked.load_checkpoint("down_proj", down)
    for e in range(4):
        for name, tensor in [("w1", gate_up[e, :6]), ("w3", gate_up[e, 6:]),
                             ("down_proj", down[e])]:
            split.load_checkpoint(f"{e}.{name}", tensor)
    assert sorted(keys + ["gate"]) == sorted(split.checkpoint_keys())
    assert torch.equal(stacked.w13, split.w13) and torch.equal(stacked.w2, split.w2)
    for rank in range(2):
        half = SparseMoE(8, 6, 4, 2, True, True, ParallelGroup(rank, 2, 0, 1))
        half.load_checkpoint("gate_up_proj", gate_up)
        half.load_checkpoint("down_proj", down)
        cols = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(half.w13, torch.cat([gate_up[:, :6][:, cols],
                                                gate_up[:, 6:][:, cols]], 1))
        assert torch.equal(half.w2, down[:, :, cols])


def test_gemma3_multimodal_top_level_fields_and_quantized_checkpoints(tmp_path):
    """The text model of a multimodal checkpoint takes the top level's tie_word_embeddings
    (transformers ties lm_head by it) and end-of-turn ids; a quantized checkpoint is refused
    at start, saying so (FP8 ones are served: tests/test_fp8.py)."""
    from engine_actors.checkpoint import load_hf_config
    save_random_checkpoint(str(tmp_path), "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    text = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "vocab_size")}
    write_config(tmp_path, architectures=["Gemma3ForConditionalGeneration"],
                 model_type="gemma3", tie_word_embeddings=False, eos_token_id=[1, 106],
                 text_config={**text, "model_type": "gemma3_text", "eos_token_id": 1},
                 vision_config={"model_type": "siglip_vision_model"})
    hf = load_hf_config(str(tmp_path))
    assert (hf.architectures, hf.tie_word_embeddings, hf.eos_token_id) == \
        (["Gemma3ForCausalLM"], False, [1, 106])
    write_config(tmp_path, quantization_config={"quant_method": "bitsandbytes",
                                                "load_in_4bit": True})
    with pytest.raises(ValueError,
                       match=r"quantized checkpoints \('bitsandbytes'\) are not supported"):
        model_info(EngineConfig(model=str(tmp_path)))
