"""Checkpoints: the built-in tiny random model, config and weight loading from a local dir."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_actors.config import DEFAULT_MODEL, EngineConfig
from engine_actors.generation_config import as_ids, generation_defaults
from engine_actors.lora_files import target_shapes
from engine_actors.model_checks import check_model, moe_layers
from engine_actors.plain_config import config_data
from engine_actors.pooling import as_causal_lm, classifier_labels

# Bump when the built-in model changes so stale copies are not reused.
_DEFAULT_VERSION = 2
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257
# The built-in model's template; tools in the Hermes format (see deployments/tool_parsers.py)
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these tools. To call one, answer with\n"
    "<tool_call>\n{\"name\": <name>, \"arguments\": <an object>}\n</tool_call>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def save_byte_tokenizer(path: str, vocab_size: int = BYTE_VOCAB + 2) -> None:
    """A byte-level tokenizer: ids 0-255 are the bytes, then <s> and </s>; any text round-trips.

    Ids past those (for a random model with a large vocabulary) decode as `<|id_N|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB)}
    vocab.update({"<s>": BOS_ID, "</s>": EOS_ID})
    vocab.update({f"<|id_{i}|>": i for i in range(EOS_ID + 1, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig
    kwargs = dict(vocab_size=BYTE_VOCAB + 2, hidden_size=64, intermediate_size=176,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  tie_word_embeddings=False, initializer_range=0.2)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_random_llama(path: str, seed: int = 0, **config_overrides) -> None:
    """Write a random-weight Llama checkpoint and the byte tokenizer with save_pretrained."""
    save_random_checkpoint(path, "llama", seed, **config_overrides)


def save_random_checkpoint(path: str, model_type: str = "llama", seed: int = 0,
                           dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                           **config_overrides) -> None:
    """A small random-weight checkpoint of any supported architecture (tiny_llama_config's
    shape), saved by transformers in `dtype`, optionally sharded, with the byte tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = tiny_llama_config().to_diff_dict()
    kwargs.pop("model_type", None)
    kwargs.update(config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs))
    for name, param in model.named_parameters():  # Gemma's norms start at 0 (1 + weight):
        if name.endswith("norm.weight") and not param.any():  # random, so that they count
            param.data.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size}
                                             if max_shard_size else {}))
    save_byte_tokenizer(path)


# Random-weight models of real shapes, for benchmarks. Their weights are never written to
# disk: every tensor is generated on the device from its name (random_weight), so the engine
# and a transformers baseline can build the same model independently.
RANDOM_MODELS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # Qwen3-30B-A3B's shape: 128 experts, 8 per token
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          tie_word_embeddings=False, vocab_size=151936),
}
RANDOM_MARKER = "orca_random_weights.json"


def random_weight(name: str, shape, device, dtype=torch.bfloat16) -> torch.Tensor:
    """The tensor `name` of a random-weight model: ones for norms, N(0, 0.02) otherwise,
    from a generator seeded by the name, so any process rebuilds identical weights."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)


def _save_random_model_dir(path: str, name: str) -> None:
    from transformers import AutoConfig
    shape = dict(RANDOM_MODELS[name])
    model_type = shape.pop("model_type", "llama")
    cfg = tiny_llama_config(**{"vocab_size": 128256, "max_position_embeddings": 8192,
                               "rope_parameters": {"rope_type": "default",
                                                   "rope_theta": 500000.0}, **shape})
    if model_type != "llama":
        kwargs = cfg.to_diff_dict()
        kwargs.pop("model_type", None)
        cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg.save_pretrained(path)
    save_byte_tokenizer(path, cfg.vocab_size)
    Path(path, RANDOM_MARKER).write_text('{"std": 0.02}\n')


def resolve_model_path(model: str) -> str:
    """The local directory of `model`; built-in models are written on first use.

    Every process that needs a built-in model (ingress, scheduler, each worker) builds the
    same bytes from fixed seeds, so nothing has to be shipped between machines.
    """
    if model in RANDOM_MODELS:
        return _build_once(f"orca-serve-{model}-v{_DEFAULT_VERSION}",
                           lambda p: _save_random_model_dir(p, model))
    if model != DEFAULT_MODEL:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is not a local checkpoint directory with a config.json "
                f"(no model hub is used); pass a directory or {DEFAULT_MODEL!r}")
        return str(path)
    return _build_once(f"orca-serve-{DEFAULT_MODEL}-v{_DEFAULT_VERSION}", save_random_llama)


def _build_once(dirname: str, build) -> str:
    target = Path(tempfile.gettempdir()) / dirname
    if not (target / "config.json").is_file():
        staging = tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent)
        build(staging)
        try:
            os.rename(staging, target)  # atomic: concurrent builders race harmlessly
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


# architectures[0] of config.json (engine_actors/models has the classes); configs without
# one (our random-weight presets) are named by their model_type
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "seed_oss": "SeedOssForCausalLM", "exaone4": "Exaone4ForCausalLM"}

# multimodal architectures whose text model is served (not their vision tower): its class
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def load_hf_config(path: str, overrides: dict | None = None):
    """The checkpoint's transformers config (a multimodal one's text config, named as its
    text model) with `overrides` set on it (hf_overrides; the config class's own rules
    apply: rope_scaling becomes rope_parameters); ValueError for an architecture we do not
    serve or an override the config refuses."""
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(path)
    except ValueError as e:  # a model_type transformers does not know
        raise ValueError(f"cannot read {path}/config.json: {e}") from None
    if architecture(cfg) in TEXT_MODELS:  # with what it takes from the top level
        text = cfg.text_config  # (transformers ties lm_head by the top level's field)
        text.architectures = [TEXT_MODELS[architecture(cfg)]]
        text.tie_word_embeddings = cfg.tie_word_embeddings
        top_eos = as_ids(getattr(cfg, "eos_token_id", None))
        text.eos_token_id = sorted(as_ids(text.eos_token_id) | top_eos)
        text.quantization_config = getattr(cfg, "quantization_config", None)
        cfg = text
    if overrides:
        try:
            cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides})
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"hf_overrides: {e}") from None
    as_causal_lm(cfg)  # (a sequence classifier: pooling.py)
    if architecture(cfg) not in ARCHITECTURES.values():
        name = getattr(cfg, "sequence_classifier", None) or architecture(cfg)
        raise ValueError(f"architecture {name!r} is not supported; supported: "
                         f"{', '.join([*ARCHITECTURES.values(), *TEXT_MODELS])} (and "
                         "their *ForSequenceClassification)")
    return cfg


def architecture(hf_config) -> str:
    names = getattr(hf_config, "architectures", None)
    return names[0] if names else ARCHITECTURES.get(hf_config.model_type, hf_config.model_type)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer (a fast one: streaming decode runs in Rust), with a simple
    chat template when it has none."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"the tokenizer of {path} has no fast (tokenizers) version; "
                         "save it with tokenizer.json")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files, in name order."""
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def iter_checkpoint_tensors(path: str, device: torch.device | str = "cpu"):
    """(name, tensor) for every tensor of the checkpoint, one at a time.

    Tensors of a random-weight model are generated on `device`; others are read from the
    safetensors files.
    """
    if os.path.isfile(os.path.join(path, RANDOM_MARKER)):
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            shapes = AutoModelForCausalLM.from_config(load_hf_config(path))
        for name, param in shapes.named_parameters():
            yield name, random_weight(name, param.shape, device)
        return
    from safetensors import safe_open
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the scheduler and the ingress need to know about the model, besides its weights."""
    name: str
    path: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    architecture: str = "LlamaForCausalLM"
    # generation_config.json's temperature, top_p, top_k, min_p: for a request without them
    sampling_defaults: dict = field(default_factory=dict)
    num_layers: int = 0
    lora_shapes: dict = field(default_factory=dict)  # LoRA target -> (in, out) features
    moe_layers: tuple[int, ...] = ()  # layers whose MLP (experts) takes no LoRA adapter
    config: dict = field(default_factory=dict)  # transformers' config (plain_config.py)
    scores: bool = False  # a reranker: its pooling gives a pair's logit (pooling.py)
    labels: tuple[str, ...] = ()  # a sequence classifier's, in order (its logits')


def model_info(cfg: EngineConfig) -> ModelInfo:
    path = resolve_model_path(cfg.model)
    hf = load_hf_config(path, cfg.hf_overrides)
    limit = hf.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    check_model(hf, cfg, architecture(hf))
    labels = classifier_labels(hf, cfg.runner, cfg.classifier_from_token)
    more_eos, defaults = generation_defaults(cfg, path)
    eos = as_ids(hf.eos_token_id) | more_eos
    return ModelInfo(cfg.model_name, path, cfg.max_model_len or limit, tuple(sorted(eos)),
                     hf.vocab_size, architecture(hf), defaults, hf.num_hidden_layers,
                     target_shapes(hf), moe_layers(hf, architecture(hf)), config_data(hf),
                     cfg.classifier_from_token is not None or len(labels) == 1, labels)
