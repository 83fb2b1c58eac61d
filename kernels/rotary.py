"""Rotary position embedding (the rotate-half form of Llama / GPT-NeoX), per-token positions."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D]; cos, sin [T, D/2] for each token's own position.

    Each request's positions restart at 0 (TCB's per-request positional encoding), so the
    caller gathers cos/sin rows by position; this function never sees request boundaries.
    """
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    return rotate(q), rotate(k)


@triton.jit
def _rotate(x_ptr, out_ptr, stride_xt, t, cos, sin, NUM_HEADS: tl.constexpr,
            HEADS_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF_P2)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    base = t * stride_xt + heads * (2 * HALF) + dims
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0)
    # same rounding as the reference: cos/sin in x's dtype, products and sums in x's dtype
    c = cos.to(x1.dtype)
    s = sin.to(x1.dtype)
    out_base = t * (NUM_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(out_ptr + out_base, x1 * c - x2 * s, mask=mask)
    tl.store(out_ptr + out_base + HALF, x2 * c + x1 * s, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, stride_qt, stride_kt,
                   stride_ct, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   Q_HEADS_P2: tl.constexpr, K_HEADS_P2: tl.constexpr, HALF: tl.constexpr,
                   HALF_P2: tl.constexpr):
    t = tl.program_id(0)
    # half a head that is not a power of two (40, 48, 56, ...) is padded, masked
    dims = tl.arange(0, HALF_P2)[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + t * stride_ct + dims, mask=dims < HALF, other=0.0)
    _rotate(q_ptr, q_out_ptr, stride_qt, t, cos, sin, NUM_Q_HEADS, Q_HEADS_P2, HALF, HALF_P2)
    _rotate(k_ptr, k_out_ptr, stride_kt, t, cos, sin, NUM_K_HEADS, K_HEADS_P2, HALF, HALF_P2)


def rotary_triton(q, k, cos, sin):
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(1) == head_dim and k.stride(1) == head_dim and q.stride(2) == 1
    assert cos.stride(1) == 1 and cos.stride() == sin.stride()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)
    _rotary_kernel[(num_tokens,)](q, k, cos, sin, q_out, k_out, q.stride(0), k.stride(0),
                                  cos.stride(0), NUM_Q_HEADS=num_q_heads,
                                  NUM_K_HEADS=num_k_heads,
                                  Q_HEADS_P2=triton.next_power_of_2(num_q_heads),
                                  K_HEADS_P2=triton.next_power_of_2(num_k_heads),
                                  HALF=head_dim // 2,
                                  HALF_P2=triton.next_power_of_2(head_dim // 2))
    return q_out, k_out


def rotary(q, k, cos, sin):
    fn = rotary_triton if q.is_cuda else rotary_ref
    return fn(q, k, cos, sin)
