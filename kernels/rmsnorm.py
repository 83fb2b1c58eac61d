"""RMSNorm, optionally fused with the residual add that precedes it. `unit_offset`: Gemma's
form, whose weight multiplies as 1 + weight, in fp32 before the cast back."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, unit_offset: bool = False):
    """x [T, H]. Without residual returns norm(x); with it returns (norm(x + r), x + r).

    Computed in fp32 and cast back before the weight multiply, as transformers' Llama does
    (Gemma's: after it).
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(x.dtype) if unit_offset else weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, stride_x, stride_r, eps,
                    H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    UNIT_OFFSET: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0)  # in x's dtype
        tl.store(new_r_ptr + t * H + offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if UNIT_OFFSET:
        out = (h * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        out = w * h.to(x.dtype)
    tl.store(out_ptr + t * H + offs, out, mask=mask)


def rmsnorm_triton(x, weight, eps, residual=None, unit_offset=False):
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    r = residual if residual is not None else x
    _rmsnorm_kernel[(num_tokens,)](x, r, weight, out, new_residual, x.stride(0), r.stride(0), eps,
                                   H=hidden, BLOCK=triton.next_power_of_2(hidden),
                                   HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset)
    return out if residual is None else (out, new_residual)


def rmsnorm(x, weight, eps, residual=None, unit_offset=False):
    fn = rmsnorm_triton if x.is_cuda else rmsnorm_ref
    return fn(x, weight, eps, residual, unit_offset)
