"""GPTQ checkpoints (`quant_method: "gptq"`, as AutoGPTQ, GPTQModel and optimum write them:
TheBloke's, Qwen's `-GPTQ-Int4` and `-GPTQ-Int8` releases), served as the INT4 (or INT8)
weights of int4_format.py.

Each projection stores, for K input and N output features, groups of G columns and b bits
(4 or 8; P = 32 / b values a word):
- `qweight` [K / P, N] int32: column n's values k = P i .. P i + P - 1 in word i, value
  P i + j at bits b j, unsigned (q + 2^(b-1)). That is compressed-tensors' `weight_packed`
  [N, K / P] transposed, word for word;
- `scales` [K / G, N] (fp16): transposed, `weight_scale`;
- `qzeros` [K / G, N / P], packed along N (column P c + j at bits b j of word c): the zero
  point of every group and column, stored minus 1 in the original format
  (`checkpoint_format` "gptq", the default; its runtimes add the 1 back, unmasked) and as
  is in "gptq_v2". A symmetric checkpoint's are all 2^(b-1): checked, then dropped; an
  asymmetric one's (`sym: false`) become `weight_zero_point` [N, K / G];
- `g_idx` [K]: each column's group. Without act-order it is k // G: checked, then dropped;
  with act-order (`desc_act: true`) it becomes `weight_g_idx`, and the layer stores each
  projection's columns sorted by group (kernels.int4_layout.sort_columns).
`translate` turns each tensor into its compressed-tensors name and layout as it loads, so the
rest (tensor-parallel shards, fused Phi-3 tensors, the kernels) is INT4's.
Served: 4 and 8 bits, symmetric or not, with act-order or without (with: at tensor_parallel_size
1), groups of a power of two of at least 16 columns or one per row (group_size -1).
Refused at start: other widths, a quantized LM head, per-module overrides (`dynamic`), partial quantization
(`modules_in_block_to_quantize`), other checkpoint formats (Marlin, BitBLAS).
"""
from __future__ import annotations

import torch

from engine_actors.int4_format import Int4Format

# a symmetric zero point (2^(bits - 1)) as each format stores it
ZERO_OFFSET = {"gptq": -1, "gptq_v2": 0}


def read(config: dict) -> Int4Format:
    """The INT4 or INT8 format of a GPTQ quantization_config; ValueError naming what is not
    served."""
    bits, group = config.get("bits"), config.get("group_size", -1)
    stored = config.get("checkpoint_format") or "gptq"
    if bits not in (4, 8):
        raise ValueError(f"GPTQ weights of {bits} bits are not supported; served: 4 and 8 "
                         "bits")
    if stored not in ZERO_OFFSET:
        raise ValueError(f"GPTQ checkpoint_format {stored!r} is not supported; served: "
                         "gptq, gptq_v2")
    if config.get("lm_head"):
        raise ValueError("GPTQ checkpoints with a quantized LM head are not supported")
    if config.get("dynamic") or config.get("modules_in_block_to_quantize"):
        raise ValueError("GPTQ checkpoints with per-module settings (dynamic, "
                         "modules_in_block_to_quantize) are not supported; served: every "
                         "projection of every layer alike")
    if group != -1 and (not isinstance(group, int) or group < 16 or group & (group - 1)):
        raise ValueError(f"GPTQ groups of {group} columns are not supported; served: a "
                         "power of two, at least 16, or -1 (one per row)")
    return Int4Format(None if group == -1 else group, bits, source="gptq",
                      gptq_zero=(1 << (bits - 1)) + ZERO_OFFSET[stored],
                      zero_points=not config.get("sym", True),
                      act_order=bool(config.get("desc_act")) and group != -1)


def translate(name: str, tensor: torch.Tensor, fmt: Int4Format
              ) -> tuple[str, torch.Tensor] | None:
    """A GPTQ checkpoint tensor as compressed-tensors' INT4 (name, tensor); None for one
    that is only checked. ValueError if it holds what is not served."""
    stem, _, param = name.rpartition(".")
    if param == "qweight":
        return f"{stem}.weight_packed", tensor.t().contiguous()
    if param == "scales":
        return f"{stem}.weight_scale", tensor.t().float().contiguous()
    if param == "qzeros":
        shifts = torch.arange(0, 32, fmt.bits, dtype=torch.int32, device=tensor.device)
        values = ((tensor.unsqueeze(-1) >> shifts) & ((1 << fmt.bits) - 1)
                  ).reshape(tensor.shape[0], -1)
        if fmt.zero_points:  # [N, groups], as stored plus the 1 that "gptq" takes off
            return f"{stem}.weight_zero_point", \
                (values.t().float() + ((1 << (fmt.bits - 1)) - fmt.gptq_zero)).contiguous()
        if not bool((values == fmt.gptq_zero).all()):
            raise ValueError(f"{name}: zero points other than the symmetric "
                             f"{fmt.gptq_zero} (an asymmetric checkpoint) are not supported")
        return None
    if param == "g_idx" and fmt.act_order:
        return f"{stem}.weight_g_idx", tensor.to(torch.int32)
    if param == "g_idx":
        k = tensor.shape[0]
        expected = torch.arange(k, device=tensor.device) // (fmt.group or k)
        if not torch.equal(tensor.to(expected.dtype), expected):
            raise ValueError(f"{name}: columns out of their groups' order (act-order) in a "
                             "checkpoint whose config says desc_act false")
        return None
    return name, tensor
