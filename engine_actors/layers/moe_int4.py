"""A mixture of experts' INT4 (or INT8) experts (the mixin of layers/moe.py's SparseMoE).

Built inside quantization.fp8_weights with an INT4 format (int4_format.py: compressed-
tensors', GPTQ's or AWQ's), the experts hold 4-bit (8-bit) weights packed 8 (4) to an int32
along their input features (`w13`, `w2` [E, N, K / P]), a scale per row and group (`w13_scale`,
`w2_scale` [E, N, groups]) and, if asymmetric, zero points shaped alike (`w13_zero_point`,
`w2_zero_point`). Tensor parallelism shards gate's and up's rows and the down projection's
words and groups (a group a rank's share would split is refused). On the GPU they are
stored tiled and group by group once loaded, and the fused kernel (kernels/moe.py) unpacks
and scales each tile as it loads; on CPU they are dequantized for each step. Act-order
experts are refused.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_actors.layers.linear import cdiv, copy_checked
from kernels.int4 import dequantize
from kernels.int4_layout import by_group, tile_experts


class Int4Experts:
    """SparseMoE's INT4 parts: built by make_int4, loaded by load_int4, read by kernels.moe
    (int4_args) on the GPU and by int4_dequantized on CPU."""

    def make_int4(self, num_experts: int, hidden: int, inter: int, local: int) -> None:
        """Packed weights, scales (and zero points) per row and group; a rank's share of
        the down projection's input features starts on a group (and a word)."""
        if self.quant.act_order:
            raise ValueError(f"act-order {self.quant.name} experts (a g_idx) are not "
                             f"supported; served: {self.quant.name} experts without act-order")
        group = self.quant.group or None
        for name, (n, k) in (("w13", (2 * local, hidden)), ("w2", (hidden, local))):
            setattr(self, name, nn.Parameter(torch.empty(
                num_experts, n, cdiv(k, self.quant.per_word), dtype=torch.int32),
                requires_grad=False))
            groups = cdiv(k, group) if group else 1
            for kind in ("scale", "zero_point")[:1 + self.quant.zero_points]:
                setattr(self, f"{name}_{kind}", nn.Parameter(torch.empty(
                    num_experts, n, groups, dtype=torch.float32), requires_grad=False))
        unit = group or self.quant.per_word
        if local < inter and (self.inter_start % unit or local % unit):
            raise ValueError(f"{self.quant.name} expert groups of {unit} columns do not divide this "
                             f"model's experts' {inter} intermediate features into whole "
                             f"groups (a rank's {local} from {self.inter_start})")

    def finish_loading(self) -> None:
        """Once loaded, INT4 experts on the GPU are stored as the fused kernel reads them
        (kernels.int4_layout.tile_experts, by_group)."""
        if not (self.int4 and self.w13.is_cuda):
            return
        for name in ("w13", "w2"):
            getattr(self, name).data = tile_experts(getattr(self, name).data)
            for kind in ("scale", "zero_point")[:1 + self.quant.zero_points]:
                t = getattr(self, f"{name}_{kind}")
                t.data = by_group(t.data)

    def int4_args(self, name: str) -> tuple[int, torch.Tensor | None, int] | None:
        """INT4 experts' (columns per scale, zero points or None, bits) for kernels.moe."""
        if not self.int4:
            return None
        k = self.gate.shape[1] if name == "w13" else self.local
        return self.quant.group or k, getattr(self, f"{name}_zero_point", None), self.quant.bits

    def int4_dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The experts' INT4 weights `name` [E, N, K] times their scales, in dtype (CPU)."""
        w = getattr(self, name)
        e, n, _ = w.shape
        k = self.gate.shape[1] if name == "w13" else self.local
        zeros = getattr(self, f"{name}_zero_point", None)
        return dequantize(
            w.reshape(e * n, -1), self.scales(name).reshape(e * n, -1), self.quant.group or k,
            k, dtype, zeros=None if zeros is None else zeros.reshape(e * n, -1),
            bits=self.quant.bits).view(e, n, k)

    def load_int4(self, e: int, projection: str, kind: str, tensor: torch.Tensor) -> str:
        """One INT4 tensor of expert e's projection (kind: "weight", its packed words;
        "weight_scale"; "weight_zero_point"): this rank's rows of gate's and up's, its
        columns (words, or groups) of down's."""
        if kind not in ("weight", "weight_scale", "weight_zero_point"):
            raise ValueError(f"expert {e}'s {projection} has a {kind} tensor, which is not "
                             f"served for {self.quant.name} experts")
        if kind == "weight" and tensor.dtype != torch.int32:
            raise ValueError(f"an {self.quant.name} checkpoint's expert weight is stored as "
                             f"{tensor.dtype}, not int32 words of packed {self.quant.bits}-bit "
                             "values")
        if kind == "weight_zero_point" and not self.quant.zero_points:
            raise ValueError(f"expert {e}'s {projection} has zero points in a checkpoint whose "
                             "config says symmetric")
        w, rows, start = self.destination(projection)
        dst = getattr(self, w if kind == "weight" else f"{w}_{kind.removeprefix('weight_')}")
        dst = dst.data[e]
        if projection != "down_proj":
            src = tensor.reshape(tensor.shape[0], -1).narrow(*rows)
        elif kind == "weight":
            src = tensor.narrow(1, self.inter_start // self.quant.per_word, dst.shape[1])
        else:  # (one per row: every rank's; per group: this rank's groups)
            tensor = tensor.reshape(tensor.shape[0], -1)
            src = tensor if tensor.shape[1] == 1 else \
                tensor.narrow(1, self.inter_start // self.quant.group, dst.shape[1])
        copy_checked(dst.narrow(0, start, src.shape[0]), src)
        return f"{e}.{projection}" + f".{kind}" * (kind != "weight")
