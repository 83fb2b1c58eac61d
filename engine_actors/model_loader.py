"""Building a model on its device and reading its checkpoint's weights into it."""
from __future__ import annotations

import torch

from engine_actors import awq_format, gptq_format, int4_format
from engine_actors.checkpoint import architecture, iter_checkpoint_tensors
from engine_actors.int4_format import Int4Format
from engine_actors.layers.linear import Linear
from engine_actors.layers.moe import SparseMoE
from engine_actors.models import model_class
from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.parallel import ParallelGroup
from engine_actors.pooling import keep_classifier
from engine_actors.quantization import check_device, fp8_weights, loaded_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# INT4 checkpoints read as compressed-tensors' after each tensor is translated
TRANSLATIONS = {"compressed-tensors": int4_format.translate, "gptq": gptq_format.translate,
                "awq": awq_format.translate}
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return DTYPES[dtype]


def load_model(path: str, hf_config, dtype: torch.dtype, device: torch.device,
               max_model_len: int, parallel: ParallelGroup, fp8, pooling) -> LlamaForCausalLM:
    """The model of checkpoint `path` (its config as hf_config), this rank's share of its
    weights loaded; fp8: the checkpoint's FP8 format (quantization.read_format), pooling:
    a pooling runner's head (pooling.read_pooling), None to generate text. A weight the
    model needs and the checkpoint lacks is a ValueError naming it."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    check_device(fp8, device)
    try:
        with torch.device(device), fp8_weights(fp8):
            model = model_class(architecture(hf_config))(hf_config, max_model_len, parallel)
    finally:
        torch.set_default_dtype(default_dtype)
    loaded = set()
    translate = TRANSLATIONS.get(fp8.source) if isinstance(fp8, Int4Format) else None
    for name, tensor in iter_checkpoint_tensors(path, device):
        if translate:  # (to compressed-tensors' INT4 tensors)
            translated = translate(name, tensor, fp8)
            if translated is None:
                continue
            name, tensor = translated
        keep_classifier(pooling, name, tensor, hf_config.tie_word_embeddings, device)
        keys = model.load_weight(name, loaded_dtype(name, tensor, dtype))
        loaded.update(keys if isinstance(keys, list) else [keys])  # (a list: experts')
    if pooling is not None and pooling.classifier is None and \
            (pooling.token_ids or pooling.num_labels):
        raise ValueError(f"checkpoint {path} has no classifier head (score.weight)"
                         if pooling.num_labels else
                         f"classifier_from_token: checkpoint {path} has no LM head (nor "
                         "embedding table) to take the tokens' rows from")
    missing = model.weight_keys() - loaded
    if pooling is not None:  # it never reads the LM head (a classifier has none):
        missing = {k for k in missing if not k.startswith("lm_head.")}
        if not hf_config.tie_word_embeddings:  # its memory goes to the KV cache
            model.lm_head = None
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for {sorted(missing)[:8]}")
    for name, module in model.named_modules():
        if isinstance(module, (Linear, SparseMoE)):
            try:
                module.finish_loading()
            except ValueError as e:  # (an act-order g_idx, or its parts off the tiles)
                raise ValueError(f"{name}: {e}") from None
    return model.eval()

