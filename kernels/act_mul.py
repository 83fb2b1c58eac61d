"""The activation-and-multiply of the merged gate/up projection: SiLU (Llama's MLP) or GELU
with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def act_mul_ref(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """gate_up [T, 2I] -> act(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr,
                    GELU: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0)
    # the activation in fp32, rounded to the input dtype before the multiply, as
    # F.silu(g) * u does; tanh(y) = 2 / (1 + exp(-2y)) - 1
    if GELU:
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * y)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t * I + offs, act.to(up.dtype) * up, mask=mask)


def act_mul_triton(gate_up, act: str = "silu"):
    num_tokens, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), I=inter, BLOCK=block, GELU=act == "gelu_tanh")
    return out


def act_mul(gate_up, act: str = "silu"):
    return act_mul_triton(gate_up, act) if gate_up.is_cuda else act_mul_ref(gate_up, act)
