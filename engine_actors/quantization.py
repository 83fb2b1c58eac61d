"""Quantized weights: FP8 checkpoints (float8 e4m3), bf16 ones quantized to FP8 as they load,
and INT4 or INT8 checkpoints (engine_actors/int4_format.py, W8A8 INT8 ones too; GPTQ's and
AWQ's: gptq_format.py, awq_format.py).

What config.json's `quantization_config` may say (anything else is refused at start):
- `quant_method: "fp8"`, transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3): each
  projection's `weight` in e4m3 and `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], one
  scale per `weight_block_size` [bn, bk] block; activations quantized at run time.
- `quant_method: "compressed-tensors"` with 8-bit float weights (llm-compressor's FP8 and
  FP8-dynamic): `weight_scale` per output channel, per tensor or per block. Activations are
  always quantized at run time per token and group (a static `input_scale` is not used).
With EngineConfig.quantization "fp8" an unquantized checkpoint is quantized as each
projection loads, one scale per output channel (vLLM's `--quantization fp8`).

Only the decoder layers' projections are quantized: embeddings, the LM head and norms keep
the model's dtype. On the GPU the matmuls run on FP8 tensor cores (kernels/fp8.py, compute
capability 8.9 or later); on CPU the weights are dequantized for each matmul, a reference
path for tests rather than a fast one.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine_actors import awq_format, gptq_format, int4_format
from kernels.fp8_quantize import FP8, FP8_MAX, GROUP

# a checkpoint's names of a projection's quantized weight and scales -> the layer's
SCALE_NAMES = {"weight_scale": "weight_scale", "weight_scale_inv": "weight_scale",
               "weight_packed": "weight"}
# a static activation scale (FP8's activations are quantized per token; integer weights'
# activations stay in the model's dtype) and zero point; a packed weight's shape (the layer
# knows it)
UNUSED = ("input_scale", "input_zero_point", "weight_shape")
# an FP8 KV cache's per-tensor scales (kernels/kv_write.py): `self_attn.k_scale` and
# `v_scale` (compressed-tensors' kv_cache_scheme), `k_proj`/`v_proj.output_scale`, or one
# `kv_scale` for both (an older format, as vLLM reads it)
KV_SCALE = re.compile(r"(.*self_attn)\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)")
# scales of FP8 attention arithmetic (queries, probabilities): attention runs in the model's
# dtype here
UNUSED_ATTENTION = re.compile(r".*self_attn\.(?:q_scale|prob_scale)")
# what an ignore list may name: modules that are never quantized here, or not served
# (a name, or llm-compressor's "re:" pattern such as "re:.*mlp.gate$"; a MoE's router is
# mlp.gate, Mixtral's block_sparse_moe.gate, AutoAWQ's bare "gate")
NEVER_QUANTIZED = re.compile(r"lm_head|embed|(mlp|block_sparse_moe)\.gate$|^gate$|"
                             r"shared_expert_gate|vision|visual|multi_modal")


@dataclass(frozen=True, slots=True)
class Fp8Format:
    # (rows, columns) of the weight blocks that share a scale; None: a scale per output row
    block: tuple[int, int] | None = None
    online: bool = False  # quantized here as it loads (from an unquantized checkpoint)

    @property
    def group(self) -> int:
        """Activation columns per scale: the blocks' width, else kernels.fp8_quantize.GROUP."""
        return self.block[1] if self.block else GROUP


# vLLM's `quantization` names that only say what the checkpoint is: the quant_methods each
# accepts (moe_wna16: vLLM's kernel for GPTQ's and AWQ's experts)
CHECKPOINT_METHODS = {"gptq": ("gptq",), "gptq_marlin": ("gptq",), "awq": ("awq",),
                      "awq_marlin": ("awq",), "compressed-tensors": ("compressed-tensors",),
                      "moe_wna16": ("gptq", "awq")}
METHOD_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors"}


def read_format(hf_config, requested: str | None
                ) -> Fp8Format | int4_format.Int4Format | int4_format.W8A8Format | None:
    """The checkpoint's FP8 or INT4 format (or online FP8 quantization if `requested` is
    "fp8" for an unquantized checkpoint); None: unquantized. ValueError for a format not
    served."""
    config = getattr(hf_config, "quantization_config", None)
    config = config if isinstance(config, dict) or config is None else config.to_dict()
    method = (config or {}).get("quant_method")
    if requested in CHECKPOINT_METHODS and method not in CHECKPOINT_METHODS[requested]:
        raise ValueError(f"quantization {requested} serves "
                         f"{' or '.join(METHOD_NAMES[m] for m in CHECKPOINT_METHODS[requested])} "
                         f"checkpoints; this one is {method or 'unquantized'} (leave "
                         "quantization unset)")
    if config is None:
        return Fp8Format(online=True) if requested == "fp8" else None
    if config.get("transform_config"):
        raise ValueError("quantized checkpoints with transforms (transform_config: rotations "
                         "applied at run time, as QuIP or SpinQuant) are not supported")
    sparsity = (config.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise ValueError(f"compressed-tensors sparsity format {sparsity!r} is not supported")
    if method == "fp8":
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints with static activation scales are not supported")
        block, ignore = config.get("weight_block_size"), config.get("modules_to_not_convert")
        if block is None:
            raise ValueError("fp8 checkpoints need a weight_block_size")
    elif method == "compressed-tensors" and int4_format.is_int4(config):
        if requested == "fp8":
            raise ValueError("quantization fp8 quantizes an unquantized checkpoint as it loads; "
                             "this checkpoint's weights are integers already (leave "
                             "quantization unset)")
        check_kv_cache_scheme(config)
        check_ignored(config.get("ignore"))
        return int4_format.read(config, experts=bool(
            getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0)))
    elif method == "compressed-tensors":
        block, ignore = _compressed_tensors(config), config.get("ignore")
    elif method == "awq":
        if requested == "fp8":
            raise ValueError("quantization fp8 quantizes an unquantized checkpoint as it loads; "
                             "this checkpoint is AWQ (INT4) already (leave quantization unset)")
        check_ignored(config.get("modules_to_not_convert"))
        return awq_format.read(config)
    elif method == "gptq":
        if requested == "fp8":
            raise ValueError("quantization fp8 quantizes an unquantized checkpoint as it loads; "
                             "this checkpoint is GPTQ (integer weights) already (leave "
                             "quantization unset)")
        return gptq_format.read(config)
    else:
        raise ValueError(f"quantized checkpoints ({method!r}) are not supported; served: "
                         "fp8 (weight_block_size), compressed-tensors FP8, "
                         "compressed-tensors INT4 and INT8 (W4A16, W8A16, pack-quantized; "
                         "W8A8, int-quantized), "
                         "GPTQ (4 and 8 bits) and AWQ (4 bits)")
    check_ignored(ignore)
    if block is not None:
        block = tuple(int(b) for b in block)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"unusable FP8 weight block size {list(block)}")
    return Fp8Format(block)


def check_ignored(ignore: list[str] | None) -> None:
    partial = [name for name in ignore or []
               if not NEVER_QUANTIZED.search(name.removeprefix("re:").removesuffix("$"))]
    if partial:
        raise ValueError(f"checkpoints with unquantized decoder projections are not "
                         f"supported (not quantized: {partial[:4]})")


def kv_scale_name(name: str) -> tuple[str, list[str]] | None:
    """(attention module path, the scales it sets: "k_scale", "v_scale" or both) if `name`
    is a KV cache scale."""
    m = KV_SCALE.fullmatch(name)
    return (m[1], [f"{c}_scale" for c in m[2] or m[3]]) if m else None


def check_kv_cache_scheme(config: dict) -> None:
    """compressed-tensors' kv_cache_scheme: per-tensor FP8 scales are served (by an FP8 pool,
    kv_cache_dtype "fp8"; other pools ignore them)."""
    scheme = config.get("kv_cache_scheme")
    if scheme and ((scheme.get("num_bits"), scheme.get("type")) != (8, "float")
                   or scheme.get("strategy", "tensor") != "tensor"
                   or scheme.get("dynamic", False) or not scheme.get("symmetric", True)):
        raise ValueError(f"kv_cache_scheme {scheme} is not supported; served: static "
                         "symmetric 8-bit float scales per tensor (strategy \"tensor\")")


def _compressed_tensors(config: dict) -> tuple[int, int] | None:
    """The weight blocks of an FP8 compressed-tensors config (None: per channel or tensor)."""
    check_kv_cache_scheme(config)
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups")
    blocks = set()
    for group in groups:
        stored = group.get("format") or config.get("format")
        if stored not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {stored!r} is not supported; served: "
                             "float-quantized (FP8 weights stored as FP8)")
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("num_bits"), weights.get("type")) != (8, "float") or \
                not weights.get("symmetric", True) or \
                (inputs and (inputs.get("num_bits"), inputs.get("type")) != (8, "float")):
            raise ValueError(f"compressed-tensors {weights.get('type')} weights of "
                             f"{weights.get('num_bits')} bits are not supported; served: "
                             "symmetric 8-bit float (FP8)")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 weights by {strategy!r} are not "
                             "supported; served: tensor, channel, block")
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"compressed-tensors groups targeting {group.get('targets')} are "
                             "not supported; served: every Linear layer (targets [\"Linear\"])")
        blocks.add(tuple(weights["block_structure"]) if strategy == "block" else None)
    if len(blocks) > 1:
        raise ValueError("compressed-tensors groups with different weight blocks are not "
                         "supported")
    return blocks.pop()


def check_device(fmt, device: torch.device) -> None:
    """FP8 matmuls need Ada or Hopper tensor cores, and block widths the kernel can tile;
    W8A8 INT8 ones, Ampere's int8 tensor cores or later."""
    if fmt is None or device.type != "cuda":
        return
    if isinstance(fmt, int4_format.W8A8Format) and \
            torch.cuda.get_device_capability(device) < (8, 0):
        raise ValueError("W8A8 INT8 weights need a GPU of compute capability 8.0 or later")
    if not isinstance(fmt, Fp8Format):
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("FP8 weights need a GPU of compute capability 8.9 or later")
    width = fmt.group
    if width < 32 or width > 256 or width & (width - 1):
        raise ValueError(f"FP8 weight blocks {width} columns wide are not supported on the "
                         "GPU (a power of two from 32 to 256)")


def check_kv_device(kv_dtype: torch.dtype, device: torch.device) -> None:
    """An FP8 KV pool's conversions in Triton need compute capability 8.9 or later."""
    if kv_dtype.itemsize == 1 and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later "
                         "(Ada, Hopper)")


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [N]): each row's absolute maximum maps to 448."""
    scales = w.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX
    return (w.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def loaded_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as the model takes it: e4m3 weights and their fp32 scales as
    stored, everything else in the model's dtype."""
    if tensor.dtype == FP8 or not tensor.is_floating_point() \
            or name.rpartition(".")[2] in (*SCALE_NAMES, *UNUSED) \
            or kv_scale_name(name):
        return tensor
    return tensor.to(dtype)


_building: Fp8Format | int4_format.Int4Format | None = None


@contextmanager
def fp8_weights(fmt: Fp8Format | int4_format.Int4Format | None):
    """The projections built inside hold quantized weights in `fmt` (FP8 or INT4:
    layers/linear.py reads it)."""
    global _building
    _building = fmt
    try:
        yield
    finally:
        _building = None


def building_format() -> Fp8Format | int4_format.Int4Format | None:
    return _building
