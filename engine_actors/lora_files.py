"""A LoRA adapter's directory: its config and tensors, checked before it is served.

An adapter is a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`). Its
config is checked first. Its weights file is then read once, and its tensors' names, shapes,
dtypes and values are checked against the model's projections: an adapter of another model,
or a corrupt one, is refused when it is added, not in a worker's step (which would fail
every running request). Workers load slots from those bytes, not from the directory.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

# the projections an adapter may target (q/k/v/o and the MLP's gate/up/down)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused projections (its only ones in transformers): the targets they stack, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MLP_TARGETS = (*TARGETS[4:], "gate_up_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class LoRAError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA), folded into B when loaded
    targets: tuple[str, ...]
    id: int  # unique per registration
    # its weights file as read when it was added (bytes, or their ray.put ref): workers load
    # a slot from these, never from the path again
    weights: object = field(default=None, compare=False, repr=False)

    @property
    def cache_salt(self) -> str:
        return f"lora-{self.id}"


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) features in the model (whole, before any sharding)."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    if hf_config.model_type == "phi3":
        shapes.update({fused: (hidden, sum(shapes[p][1] for p in parts))
                       for fused, parts in FUSED.items()})
    return shapes


def read_weights(info: AdapterInfo) -> bytes:
    """The adapter's weights file, read once when it is added: what is served is what was
    there then (a file changed or removed later does not matter)."""
    try:
        with open(os.path.join(info.path, WEIGHTS_FILE), "rb") as f:
            return f.read()
    except OSError as e:
        raise LoRAError(f"LoRA adapter {info.name!r}: cannot read {WEIGHTS_FILE}: {e}") from None


# module names of a mixture of experts' MLP (Qwen-MoE's and Mixtral's, per expert or shared)
EXPERT_MODULES = {"experts", "shared_expert", "shared_expert_gate", "block_sparse_moe"}


def of_vision_tower(key: str) -> bool:
    """A tensor of a multimodal model's vision tower or projector (peft's default targets
    adapt them too): the server runs text only, so it never applies them."""
    return "vision_tower" in key or "multi_modal_projector" in key


def check_tensors(info: AdapterInfo, data: bytes, shapes: dict[str, tuple[int, int]],
                  num_layers: int, moe_layers: tuple[int, ...] = ()) -> None:
    """LoRAError unless every tensor in `data` (the weights file) is a finite float LoRA A
    [r, in] or B [out, r] of one of the adapter's targets in one of the model's layers (an
    MLP target not in a layer of experts), or of a vision tower (left out)."""
    from safetensors.torch import load

    def refuse(why: str):
        raise LoRAError(f"LoRA adapter {info.name!r}: {why}")
    try:
        tensors = load(data)
    except Exception as e:  # a truncated or corrupt file: safetensors' own error types
        refuse(f"cannot read {WEIGHTS_FILE}: {e}")
    for key, tensor in tensors.items():
        if of_vision_tower(key):
            continue
        names = key.split(".")
        if EXPERT_MODULES & set(names):
            refuse(f"tensor {key} adapts a mixture of experts' experts, which LoRA is not "
                   "supported on (adapters of its attention and dense MLP layers are)")
        kind = next((n for n in names if n in ("lora_A", "lora_B")), None)
        layer = names[names.index("layers") + 1] if "layers" in names[:-1] else ""
        target = names[names.index(kind) - 1] if kind else ""
        if not (layer.isascii() and layer.isdigit()) or int(layer) >= num_layers \
                or target not in info.targets:
            refuse(f"tensor {key} is not a LoRA weight of its target modules in the model's "
                   f"{num_layers} layers; was it trained for this model?")
        if target not in shapes:
            refuse(f"tensor {key} adapts {target}, which this model does not have (its "
                   f"projections: {', '.join(shapes)})")
        if target in MLP_TARGETS and int(layer) in moe_layers:
            refuse(f"tensor {key} adapts the MLP of layer {layer}, a mixture of experts, "
                   "which LoRA is not supported on")
        if tensor.dtype not in FLOAT_DTYPES:
            refuse(f"tensor {key} has dtype {tensor.dtype}, not a float")
        d_in, d_out = shapes[target]
        want = [info.rank, d_in] if kind == "lora_A" else [d_out, info.rank]
        if list(tensor.shape) != want:
            refuse(f"tensor {key} has shape {list(tensor.shape)}, not {want} (r={info.rank}); "
                   "was it trained for this model?")
        scale = info.scale if kind == "lora_B" else 1.0  # B is served times the scale
        if tensor.numel() and not math.isfinite(_peak(tensor) * scale):
            refuse(f"tensor {key} holds values that are not finite (times the scale "
                   f"{info.scale:g}, for B)")


def _peak(tensor: torch.Tensor) -> float:
    """The largest magnitude in a float tensor (nan or inf if one is not finite). In numpy:
    torch's CPU kernels took seconds for an 80 MiB adapter here, numpy 0.1 s."""
    if tensor.dtype == torch.bfloat16:  # numpy has none: a bfloat16 is a float32's top half
        values = (tensor.view(torch.int16).numpy().astype(np.uint32) << 16).view(np.float32)
    else:
        values = tensor.numpy()
    return float(np.abs(values).max())


def read_adapter(name: str, path: str, max_rank: int, adapter_id: int) -> AdapterInfo:
    """Check a PEFT LoRA directory's config; LoRAError naming what is wrong."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoRAError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path!r}")
    try:
        with open(config_file) as f:
            cfg = json.load(f)
    except (ValueError, RecursionError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: "
                        f"{str(e)[:200]}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if type(rank) is not int or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: bad rank r={rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, over max_lora_rank "
                        f"{max_rank}; restart with a larger max_lora_rank")
    if cfg.get("target_parameters"):  # (peft's LoRA on parameters: a mixture's experts)
        raise LoRAError(f"LoRA adapter {name!r}: target_parameters "
                        f"{cfg['target_parameters']} (a mixture of experts' experts) not "
                        "supported; adapters of its attention and dense MLP layers are")
    unsupported = [k for k, bad in [("use_dora", True), ("fan_in_fan_out", True)]
                   if cfg.get(k) is bad]
    if cfg.get("modules_to_save"):
        unsupported.append("modules_to_save")
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        unsupported.append("rank_pattern/alpha_pattern")
    if unsupported:
        raise LoRAError(f"LoRA adapter {name!r}: {', '.join(unsupported)} not supported")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = [*TARGETS, *FUSED]  # (the model's own are checked with the tensors)
    if not isinstance(targets, list) or not targets \
            or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"LoRA adapter {name!r}: target_modules must list module names, "
                        f"got {targets!r}")
    others = sorted(set(targets) - set(TARGETS) - set(FUSED))
    if others:
        raise LoRAError(f"LoRA adapter {name!r}: target modules {others} not supported "
                        f"(supported: {', '.join([*TARGETS, *FUSED])})")
    alpha = cfg.get("lora_alpha", rank)
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a finite number, "
                        f"got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterInfo(name, os.path.abspath(path), rank, float(scale),
                       tuple(t for t in (*TARGETS, *FUSED) if t in targets), adapter_id)


OWNER_FILE = ".orca-owner"  # "host pid" of the engine whose temp directory it is


def temp_adapter_dir() -> tempfile.TemporaryDirectory:
    """A temp directory for the adapters of finished jobs, marked with this host and
    process. Such directories of this user whose process is gone on this host (a scheduler
    killed before its teardown) are removed first; nothing without the mark is touched."""
    host = socket.gethostname()
    for path in pathlib.Path(tempfile.gettempdir()).glob("orca-finetune-*"):
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            owner_host, pid = (path / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    temp = tempfile.TemporaryDirectory(prefix="orca-finetune-")
    (pathlib.Path(temp.name) / OWNER_FILE).write_text(f"{host} {os.getpid()}")
    return temp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
