"""AWQ checkpoints (`quant_method: "awq"`, as AutoAWQ and llm-awq write them: Qwen's `-AWQ`
releases, hugging-quants', TheBloke's), served as the asymmetric INT4 weights of
int4_format.py.

Each projection stores, for K input and N output features and groups of G columns:
- `qweight` [K, N / 8] int32, packed along N: word c of row k holds columns 8 c + ORDER[j]
  at bits 4 j (AutoAWQ's GEMM order), unsigned values u in [0, 15];
- `qzeros` [K / G, N / 8], packed the same way: each group's zero point z per column;
- `scales` [K / G, N] (fp16); w ~ (u - z) * scale.
`translate` unpacks each as it loads and writes compressed-tensors' layout (int4_format.py:
`weight_packed` [N, K / 8] along K, `weight_scale` and `weight_zero_point` [N, K / G]), so
tensor-parallel shards, fused Phi-3 tensors and the kernels are INT4's.
Served: 4 bits with zero points (`zero_point: true`), `version: "gemm"`, groups of a power
of two of at least 16 columns. Refused at start: other widths, `zero_point: false`, the GEMV
and Marlin layouts, modules left unquantized beyond embeddings, the LM head and routers.
"""
from __future__ import annotations

import torch

from engine_actors.int4_format import Int4Format

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8 c + ORDER[j] is at bits 4 j of word c


def read(config: dict) -> Int4Format:
    """The INT4 format of an AWQ quantization_config; ValueError naming what is not served."""
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ weights of {bits} bits are not supported; served: 4 bits")
    if not config.get("zero_point", True):
        raise ValueError("AWQ weights without zero points (zero_point: false) are not "
                         "supported; served: zero_point true")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; served: gemm")
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        raise ValueError(f"AWQ groups of {group} columns are not supported; served: a power "
                         "of two, at least 16")
    return Int4Format(group, source="awq", zero_points=True)


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 in AWQ's order -> [R, N] unsigned values, columns in order."""
    shifts = torch.tensor([4 * ORDER.index(j) for j in range(8)], dtype=torch.int32,
                          device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[N, K] unsigned 4-bit values -> [N, ceil(K / 8)] int32, value k at bits 4 (k % 8) of
    word k // 8 (compressed-tensors' weight_packed)."""
    n, k = values.shape
    values = torch.nn.functional.pad(values.to(torch.int64), (0, -k % 8)).view(n, -1, 8)
    words = (values << torch.arange(0, 32, 4, device=values.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def translate(name: str, tensor: torch.Tensor, fmt: Int4Format
              ) -> tuple[str, torch.Tensor] | None:
    """An AWQ checkpoint tensor as compressed-tensors' INT4 (name, tensor)."""
    stem, _, param = name.rpartition(".")
    if param == "qweight":
        return f"{stem}.weight_packed", pack_rows(unpack_columns(tensor).t())
    if param == "qzeros":
        return f"{stem}.weight_zero_point", unpack_columns(tensor).t().float().contiguous()
    if param == "scales":
        return f"{stem}.weight_scale", tensor.t().float().contiguous()
    return name, tensor
