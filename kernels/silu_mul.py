"""SiLU-and-multiply of the merged gate/up projection (Llama's MLP activation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0)
    # silu in fp32, rounded to the input dtype before the multiply, as F.silu(g) * u does
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + t * I + offs, act * up, mask=mask)


def silu_mul_triton(gate_up):
    num_tokens, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0),
                                                             I=inter, BLOCK=block)
    return out


def silu_mul(gate_up):
    return silu_mul_triton(gate_up) if gate_up.is_cuda else silu_mul_ref(gate_up)
