"""INT4 weights (W4A16), and INT8 ones (W8A16): compressed-tensors' pack-quantized
checkpoints, as llm-compressor writes them (RedHatAI's `quantized.w4a16` and `w8a16`
releases).

Each decoder projection stores `weight_packed` [N, ceil(K / P)] int32 (P = 8 four-bit or 4
eight-bit values a word, kernels/int4_layout.py has the layout), `weight_scale` [N,
ceil(K / group)] (strategy "group") or [N, 1] ("channel"), and `weight_shape`; w ~ q *
scale, q in [-8, 7] or [-128, 127] (symmetric); actorder "group" ones also store
`weight_g_idx` [K], each column's group; asymmetric ones also store `weight_zero_point`
[ceil(N / P), groups], packed along N as the weights are along K (`translate` unpacks it),
w ~ (q - zero point) * scale. 8-bit weights may also be stored one int8 each
(`int-quantized`, as llm-compressor writes W8A8 INT8: RedHatAI's `quantized.w8a8` releases):
`weight` [N, K] int8 and `weight_zero_point` [N, groups] int8, which `translate` packs as
above. Activations stay in the model's dtype (W4A16, W8A16), except for W8A8Format below:
a checkpoint's 8-bit int activation scheme is not applied otherwise, and its `input_scale`
and `input_zero_point` are never read. Served: 4- and 8-bit int weights by group (a power
of two, at least 16) or channel, with any activation ordering (actorder "group" at
tensor_parallel_size 1). Refused at start: float activations, other bit widths.

W8A8 INT8 checkpoints of a dense model (int-quantized, symmetric 8-bit weights per channel,
8-bit int activations, no act-order) are served as W8A8Format: int8 weights kept as stored,
activations quantized per token at run time (kernels/int8.py), whatever static scale or
zero point the checkpoint gives them, as FP8's are. Other int-quantized checkpoints (zero
points, groups, a mixture's experts) are packed and served as W8A16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int4_layout import pack


# compressed-tensors' activation orderings and their aliases: the weights' columns in order
# ("weight"), or a g_idx of each column's group ("group": act-order)
STATIC_ORDER, GROUP_ORDER = ("weight", "static"), ("group", "dynamic", True)


@dataclass(frozen=True, slots=True)
class Int4Format:
    group: int | None  # columns per scale; None: one per row (strategy "channel")
    bits: int = 4  # 4 (INT4) or 8 (INT8): the same layout, P = 32 / bits values a word
    online: bool = False  # (never: INT4 comes from checkpoints only)
    # the checkpoint's format: compressed-tensors', or one translated to it as it loads
    # ("gptq": gptq_format.py, "awq": awq_format.py)
    source: str = "compressed-tensors"
    gptq_zero: int | None = None  # a GPTQ checkpoint's symmetric zero point, as stored
    # asymmetric: a zero point z per scale, w ~ (u - z) * scale for the stored unsigned u
    # (AWQ's, GPTQ's sym false); without, z is 2^(bits - 1) (q = u - 8 for 4 bits)
    zero_points: bool = False
    # act-order (GPTQ's desc_act, compressed-tensors' actorder "group"): a `weight_g_idx`
    # [K] per projection gives each input column's group (kernels.int4_layout.sort_columns)
    act_order: bool = False
    # the weights as stored: packed in int32 words (pack-quantized, GPTQ's, AWQ's), or one
    # int8 each (int-quantized: `translate` packs them as they load)
    packed: bool = True

    @property
    def per_word(self) -> int:
        """Values packed in an int32 word."""
        return 32 // self.bits

    @property
    def name(self) -> str:
        return f"INT{self.bits}"

    @property
    def block(self) -> tuple[int, int] | None:
        """As FP8's blocks: (rows, columns) that share a scale; None: one per row."""
        return (1, self.group) if self.group else None


@dataclass(frozen=True, slots=True)
class W8A8Format:
    """Symmetric int8 weights [N, K] with a scale per output row, times activations
    quantized to int8 per token as they come (layers/linear.py, kernels/int8.py)."""
    block = None  # (a scale per row, as FP8's per-channel weights)
    online = False
    act_order = False
    name = "INT8 (W8A8)"


def is_int4(config: dict) -> bool:
    """Does a compressed-tensors config quantize weights to integers (of any width)?"""
    return any((group.get("weights") or {}).get("type") == "int"
               for group in (config.get("config_groups") or {}).values())


def read(config: dict, experts: bool = False) -> Int4Format | W8A8Format:
    """The format of a compressed-tensors config with int weights (experts: of a mixture
    of experts); ValueError naming what is not served."""
    groups = list(config["config_groups"].values())
    formats, int8_inputs = set(), all(g.get("input_activations") for g in groups)
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        bits, kind = weights.get("num_bits"), weights.get("type")
        stored = group.get("format") or config.get("format")
        if kind != "int" or bits not in (4, 8):
            raise ValueError(f"compressed-tensors {kind} weights of {bits} bits are not "
                             "supported; served: symmetric 8-bit float (FP8), and 4- and "
                             "8-bit int (W4A16, W8A16)")
        if inputs and (inputs.get("type"), inputs.get("num_bits")) != ("int", 8):
            raise ValueError(f"INT{bits} weights with {inputs.get('type')} activations of "
                             f"{inputs.get('num_bits')} bits are not supported; served: "
                             f"none (W{bits}A16) or 8-bit int ones, computed in the "
                             "model's dtype")
        packed = stored == "pack-quantized"
        if not packed and (bits != 8 or stored not in ("int-quantized", "naive-quantized")):
            raise ValueError(f"compressed-tensors format {stored!r} is not supported for "
                             f"{bits}-bit int weights; served: pack-quantized"
                             + ", int-quantized" * (bits == 8))
        if weights.get("actorder") not in (None, False, *STATIC_ORDER, *GROUP_ORDER):
            raise ValueError(f"INT{bits} weights with actorder {weights.get('actorder')!r} are "
                             "not supported; served: null, \"weight\", \"group\"")
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"compressed-tensors groups targeting {group.get('targets')} are "
                             "not supported; served: every Linear layer (targets [\"Linear\"])")
        strategy, size = weights.get("strategy"), weights.get("group_size")
        if strategy == "group" and (not size or size < 16 or size & (size - 1)):
            raise ValueError(f"INT{bits} groups of {size} columns are not supported; served: a "
                             "power of two, at least 16")
        if strategy not in ("group", "channel"):
            raise ValueError(f"INT{bits} weights by {strategy!r} are not supported; served: "
                             "group, channel")
        formats.add(Int4Format(size if strategy == "group" else None, bits,
                               zero_points=not weights.get("symmetric", True),
                               act_order=weights.get("actorder") in GROUP_ORDER,
                               packed=packed))
    if len(formats) > 1:
        raise ValueError("compressed-tensors groups with different int formats are not "
                         "supported")
    fmt = formats.pop()
    if int8_inputs and not experts and fmt == Int4Format(None, 8, packed=False):
        return W8A8Format()  # (symmetric, per channel, no act-order)
    return fmt


def translate(name: str, tensor: torch.Tensor, fmt: Int4Format) -> tuple[str, torch.Tensor]:
    """An asymmetric checkpoint's packed zero points [ceil(N / P), groups] as the layer holds
    them: [N, groups], unsigned (the stored value: zero point + 2^(bits - 1)); an
    int-quantized checkpoint's int8 weights packed as pack-quantized's, its zero points
    unsigned."""
    if not fmt.packed and name.endswith(".weight") and tensor.dtype == torch.int8:
        values = tensor.to(torch.int32) + 128  # ([..., N, K]: a projection's, or experts')
        words = pack(values.reshape(-1, values.shape[-1]), 8)
        return f"{name}_packed", words.view(*values.shape[:-1], -1)
    if not name.endswith(".weight_zero_point"):
        return name, tensor
    if not fmt.packed:
        return name, tensor.float() + 128
    shifts = torch.arange(0, 32, fmt.bits, dtype=torch.int32, device=tensor.device)
    values = (tensor.unsqueeze(1) >> shifts[None, :, None]) & ((1 << fmt.bits) - 1)
    return name, values.reshape(-1, tensor.shape[1]).float()  # ([words, P, groups] flat)
