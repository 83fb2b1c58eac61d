"""What a checkpoint's config must satisfy for this engine to serve it (and to train
adapters on it), checked at start so that a model it cannot run fails the start and says
why."""
from __future__ import annotations

from engine_actors.quantization import Fp8Format, read_format

MIXTURES_OF_EXPERTS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# architectures whose layers differ from the trainer's (Llama's) pass: served, LoRA adapters
# included, but not fine-tuned
NOT_TRAINED = ("GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
               "SmolLM3ForCausalLM", "Exaone4ForCausalLM")
# architectures whose query and key norms span all heads: tensor parallelism would need
# their statistics gathered over ranks
NORMS_OVER_HEADS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def check_model(hf_config, cfg, architecture: str) -> None:
    """ValueError naming what is not supported (cfg: the EngineConfig)."""
    check_tensor_parallel(hf_config, cfg.tensor_parallel_size)
    if cfg.enable_finetuning and cfg.tensor_parallel_size > hf_config.num_key_value_heads:
        raise ValueError(f"enable_finetuning with tensor_parallel_size "
                         f"{cfg.tensor_parallel_size} above the model's "
                         f"{hf_config.num_key_value_heads} KV heads (which then replicate) is "
                         "not supported")
    check_attention_window(hf_config, cfg,
                           cfg.max_model_len or hf_config.max_position_embeddings)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    types = set(getattr(hf_config, "layer_types", None) or ()) & set(rope)  # (keyed by type)
    for rope_type in [rope[t].get("rope_type") for t in types] or [rope.get("rope_type")]:
        if rope_type in ("dynamic", "longrope"):  # (as layers/rotary.py, before the workers)
            raise ValueError(f"rope_type {rope_type!r} rescales with sequence length at run "
                             "time and is not supported; supported: default, linear, "
                             "llama3, yarn")
    if architecture == "Phi3ForCausalLM":
        check_phi3(hf_config, cfg)
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        check_gemma(hf_config, cfg, architecture)
    if architecture in NORMS_OVER_HEADS and cfg.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size {cfg.tensor_parallel_size} is not supported "
                         f"for {architecture} (its query and key norms span all heads); "
                         "pipeline_parallel_size is")
    if architecture in NOT_TRAINED and cfg.enable_finetuning:
        raise ValueError(f"enable_finetuning is not supported for {architecture} (LoRA "
                         "adapters are served)")
    if architecture in MIXTURES_OF_EXPERTS and cfg.enable_finetuning:
        raise ValueError(f"enable_finetuning is not supported for {architecture} (a mixture "
                         "of experts; LoRA adapters of its attention are served)")
    check_quantized(hf_config, cfg, architecture)


def check_quantized(hf_config, cfg, architecture: str) -> None:
    """FP8 weights (engine_actors/quantization.py) and INT4 ones (int4_format.py): on the
    decoder's projections and experts (INT4 experts without act-order)."""
    fmt = read_format(hf_config, cfg.quantization)
    if fmt is None:
        return
    kind = "FP8" if isinstance(fmt, Fp8Format) else fmt.name
    if kind != "FP8" and architecture in MIXTURES_OF_EXPERTS and fmt.act_order:
        raise ValueError(f"act-order {kind} weights are not supported for {architecture} (a "
                         f"mixture of experts; {kind} experts without act-order are)")
    if cfg.enable_finetuning:
        raise ValueError(f"enable_finetuning with {kind} weights is not supported (LoRA "
                         "adapters are served)")


def qwen_sparse_layer(hf_config, i: int) -> bool:
    """Whether the Qwens' layer i is a mixture of experts (else a dense MLP)."""
    return hf_config.num_experts > 0 and i not in (hf_config.mlp_only_layers or []) \
        and (i + 1) % hf_config.decoder_sparse_step == 0


def moe_layers(hf_config, architecture: str) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts (LoRA adapters leave it alone)."""
    layers = range(hf_config.num_hidden_layers)
    if architecture == "MixtralForCausalLM":
        return tuple(layers)
    if architecture in MIXTURES_OF_EXPERTS:
        return tuple(i for i in layers if qwen_sparse_layer(hf_config, i))
    return ()


def layer_window(hf_config, layer: int, max_model_len: int) -> int:
    """The sliding window of a layer's attention in positions (0: none, or one that the
    context never exceeds): the config's sliding_window, on the layers its layer_types
    mark "sliding_attention" when it has them (Qwen2's use_sliding_window), else on all
    (Mistral, Phi-3)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types and types[layer] != "sliding_attention":
        window = None
    return window if window is not None and window < max_model_len else 0


def check_attention_window(hf_config, cfg, max_model_len: int) -> None:
    """Fine-tuning's attention has no window: refuse it where a window applies."""
    if cfg.enable_finetuning and any(layer_window(hf_config, i, max_model_len)
                                     for i in range(hf_config.num_hidden_layers)):
        raise ValueError(f"enable_finetuning with sliding-window attention (window "
                         f"{hf_config.sliding_window} tokens, under max_model_len "
                         f"{max_model_len}) is not supported; set max_model_len to at most "
                         f"{hf_config.sliding_window}")


def check_tensor_parallel(hf_config, tp_size: int) -> None:
    """Refuse head counts that tensor parallelism cannot split: query heads must divide
    evenly, and KV heads either divide evenly or are replicated, each rank holding one whole
    KV head whose query heads all live on that rank (tp a multiple of the KV heads)."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's "
                         f"{heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} and the model's {kv_heads} KV heads: "
                         "one must be a multiple of the other (each rank holds whole KV heads, "
                         "or one replicated KV head)")


def check_gemma(hf_config, cfg, architecture: str) -> None:
    """Logit soft-capping only on Gemma 2 (Gemma 3 has none), causal attention, GELU, and
    default or linear rope (per layer type); no fine-tuning (its forward pass is Llama's)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if architecture != "Gemma2ForCausalLM" and getattr(hf_config, name, None) is not None:
            raise ValueError(f"{name} (logit soft-capping) is not supported on {architecture}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    for kind in set(hf_config.layer_types):
        rope = hf_config.rope_parameters.get(kind) or hf_config.rope_parameters
        if rope.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"rope_type {rope['rope_type']!r} on the {kind} layers is not "
                             "supported (default and linear only)")
    if cfg.enable_finetuning:
        raise ValueError(f"enable_finetuning is not supported for {architecture} (LoRA "
                         "adapters are served)")


def check_phi3(hf_config, cfg) -> None:
    """Rotary over the whole head and SiLU (Phi-4-mini rotates part of each head); no
    fine-tuning: the trainer's adapters target q/k/v and gate/up apart, and transformers'
    Phi-3 has only its fused projections."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor",
                      getattr(hf_config, "partial_rotary_factor", None))
    if factor not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor {factor} (rotary over part of each head) is "
                         "not supported")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    if cfg.enable_finetuning:
        raise ValueError("enable_finetuning is not supported for Phi3ForCausalLM (adapters "
                         "of its fused qkv_proj and gate_up_proj are served)")
