"""LoRA slots on the linear layers of a worker, and the tiles of the current step.

Each LoRA-capable projection (the merged q/k/v and gate/up, o, down) holds `num_slots`
slots of A [R_total, in] and B [out, R_total] on its device, this rank's shard of them: a
merged projection stacks its parts' ranks (B is block-diagonal), and padding ranks and
projections an adapter does not target stay zero. The runner loads an adapter into a slot
when the step message says so (`load_adapter`) and sets the step's tiles before the forward
(`set_batch`): the step's tokens grouped by slot, from each table row's slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_actors.lora_files import FUSED, of_vision_tower
from kernels.lora import lora_ref, lora_triton

# a PEFT target -> (the module of a decoder layer that holds it, its part in that module)
MODULES = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}


@dataclass(slots=True)
class LoRABatch:
    order: torch.Tensor  # int32 on the device: the adapter tokens grouped by slot
    tiles: torch.Tensor  # [n, 3] int32 on the device: (first, end, slot) over order
    token_slots: np.ndarray | None  # host: each token's slot (-1: none); None under a graph


_batch: LoRABatch | None = None


def set_batch(batch: LoRABatch | None) -> None:
    global _batch
    _batch = batch


class LoRAWeights:
    def __init__(self, num_slots: int, rank: int, num_parts: int, in_features: int,
                 out_features: int, dtype: torch.dtype, device: torch.device):
        self.rank = rank  # per part
        self.a = torch.zeros(num_slots, num_parts * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, num_parts * rank, dtype=dtype, device=device)


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoRAWeights) -> torch.Tensor:
    """y += each token's low-rank update, in place (tokens without an adapter: nothing)."""
    batch = _batch
    if batch is None:
        return y
    if y.is_cuda:
        if batch.token_slots is not None and not batch.tiles.shape[0]:
            return y  # an eager step without adapter tokens
        return lora_triton(y, x, w.a, w.b, batch.order, batch.tiles)
    return lora_ref(y, x, w.a, w.b, batch.token_slots)


def projections(layer) -> list:
    """A layer's LoRA-capable projections: attention's, and its MLP's where it has them (a
    mixture of experts has none: its experts take no adapter)."""
    return [layer.get_submodule(path) for path in dict.fromkeys(m for m, _ in MODULES.values())
            if not path.startswith("mlp.") or hasattr(layer.mlp, "gate_up_proj")]


def attach(model, num_slots: int, rank: int, dtype: torch.dtype | None = None) -> None:
    """Give every LoRA-capable projection of this stage's layers its slots, in `dtype` (by
    default the projection's own; an FP8 model's adapters are in its activations' dtype)."""
    for layer in model.layers.values():
        for module in projections(layer):
            out_features, in_features = module.out_features, module.in_features  # (an INT4
            # weight on the GPU is stored tiled: its shape is not the features')
            module.lora = LoRAWeights(num_slots, rank, len(getattr(module, "parts", [0])),
                                      in_features, out_features, dtype or module.weight.dtype,
                                      module.weight.device)


def load_adapter(model, slot: int, weights, scale: float) -> None:
    """Fill `slot` with an adapter: `weights`, its PEFT safetensors file's bytes (or their
    ray.put ref), whose tensors the scheduler checked against the model; this stage's layers
    and this rank's shards; B takes the scale."""
    import ray
    from safetensors.torch import load
    layers = list(model.layers.values())
    for layer in layers:
        for module in projections(layer):
            module.lora.a[slot].zero_()
            module.lora.b[slot].zero_()
    if isinstance(weights, ray.ObjectRef):
        weights = ray.get(weights)
    for key, tensor in load(weights).items():
        if of_vision_tower(key):
            continue  # (text only: the vision tower is not loaded)
        names = key.split(".")
        kind = next(n for n in names if n in ("lora_A", "lora_B"))
        layer_id = names[names.index("layers") + 1]
        target = names[names.index(kind) - 1]
        if layer_id not in model.layers:
            continue  # another pipeline stage's layer
        parts = FUSED.get(target, (target,))  # (Phi-3's fused: A for each part, B split)
        module = model.layers[layer_id].get_submodule(MODULES[parts[0]][0])
        tensor = tensor.to(module.lora.a.dtype)
        if target in FUSED and kind == "lora_B":
            pieces = tensor.split([heads * size for heads, size in module.parts])
        else:
            pieces = [tensor] * len(parts)
        for target_part, piece in zip(parts, pieces):
            _write(module, slot, kind, MODULES[target_part][1], piece, scale)


def _write(module, slot: int, kind: str, part: int, tensor: torch.Tensor, scale: float) -> None:
    """One part's A [r, in] or B [out, r] into a slot: this rank's shard, B times the scale."""
    lora = module.lora
    if kind == "lora_A":
        r = tensor.shape[0]
        if hasattr(module, "local_columns"):  # row-parallel: this rank's inputs
            tensor = module.local_columns(tensor)
        lora.a[slot, part * lora.rank:part * lora.rank + r] = tensor
        return
    r = tensor.shape[1]
    cols = slice(part * lora.rank, part * lora.rank + r)
    tensor = tensor * scale
    if hasattr(module, "local_rows"):  # column-parallel: this rank's outputs
        start, rows = module.local_rows(tensor, part)
        lora.b[slot, start:start + rows.shape[0], cols] = rows
    else:
        lora.b[slot, :, cols] = tensor
