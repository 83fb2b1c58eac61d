"""Checkpoints: the built-in tiny random model, config and weight loading from a local dir."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_actors.config import DEFAULT_MODEL, EngineConfig

# Bump when the built-in model changes so stale copies are not reused.
_DEFAULT_VERSION = 1
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def save_byte_tokenizer(path: str) -> None:
    """A byte-level tokenizer: ids 0-255 are the bytes, then <s> and </s>; any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB)}
    vocab.update({"<s>": BOS_ID, "</s>": EOS_ID})
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
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(**config_overrides)).save_pretrained(path)
    save_byte_tokenizer(path)


def resolve_model_path(model: str) -> str:
    """The local directory of `model`; the built-in default is written on first use.

    Every process that needs the default (ingress, scheduler, each worker) builds the same
    bytes from a fixed seed, so nothing has to be shipped between machines.
    """
    if model != DEFAULT_MODEL:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is not a local checkpoint directory with a config.json "
                f"(no model hub is used); pass a directory or {DEFAULT_MODEL!r}")
        return str(path)
    target = Path(tempfile.gettempdir()) / f"orca-serve-{DEFAULT_MODEL}-v{_DEFAULT_VERSION}"
    if not (target / "model.safetensors").is_file():
        staging = tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent)
        save_random_llama(staging)
        try:
            os.rename(staging, target)  # atomic: concurrent builders race harmlessly
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def load_hf_config(path: str):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type not in ("llama",):
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; supported: llama")
    return cfg


def iter_checkpoint_tensors(path: str):
    """(name, tensor) for every tensor of the checkpoint's safetensors files, one at a time."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
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


def model_info(cfg: EngineConfig) -> ModelInfo:
    path = resolve_model_path(cfg.model)
    hf = load_hf_config(path)
    limit = hf.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    eos = _as_ids(hf.eos_token_id)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig
        eos |= _as_ids(GenerationConfig.from_pretrained(path).eos_token_id)
    return ModelInfo(cfg.model_name, path, cfg.max_model_len or limit, tuple(sorted(eos)),
                     hf.vocab_size)


def _as_ids(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
