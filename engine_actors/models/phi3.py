"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): Llama with its projections fused in the
checkpoint. `qkv_proj` holds q, k and v one after another and `gate_up_proj` gate then up;
they are split into the parts of our own stacked projections (whose names they already
have), so tensor parallelism shards each part as for Llama; an FP8 checkpoint's scales are
split with them. Rotary must cover the whole head and LongRoPE (the 128k releases) is
refused, as is fine-tuning (engine_actors/model_checks.py says why).
"""
from __future__ import annotations

import torch

from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.quantization import SCALE_NAMES, UNUSED


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """A fused tensor is loaded part by part, under one key (see weight_keys)."""
        module_path, _, param = name.rpartition(".")
        fused = module_path.rpartition(".")[2]
        if fused not in ("qkv_proj", "gate_up_proj") or param in UNUSED:
            return super().load_weight(name, tensor)
        if name.startswith("model."):
            module_path = module_path[len("model."):]
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None  # another stage's layer
        param = SCALE_NAMES.get(param, param)
        sizes = [heads * size for heads, size in module.parts]
        if param == "weight_g_idx":  # (by input column: the same for every part)
            sizes, tensor = None, [tensor] * len(sizes)
        if param == "weight_scale" and module.quant.block is not None:  # rows of blocks
            sizes = [size // module.quant.block[0] for size in sizes]
        elif param == "weight_scale" and tensor.numel() == 1:  # one scale for all parts
            tensor = tensor.reshape(1).expand(sum(sizes))
        for part, piece in enumerate(tensor if sizes is None else tensor.split(sizes, dim=0)):
            module.load(param, piece, part)
        return f"{module_path}.{param}[fused]"

    def weight_keys(self) -> set[str]:
        """As Llama's, with one key per fused tensor instead of one per part."""
        keys = set()
        for key in super().weight_keys():
            path, _, rest = key.rpartition(".")
            if path.rpartition(".")[2] in ("qkv_proj", "gate_up_proj"):
                keys.add(f"{path}.{rest.split('[')[0]}[fused]")
            else:
                keys.add(key)
        return keys
