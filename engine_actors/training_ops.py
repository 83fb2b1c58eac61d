"""The trainer's differentiable pieces beside the model's own (engine_actors/finetune.py):
causal attention over a micro-batch's flattened sequences, and the collectives of tensor
parallelism as autograd functions (Megatron's f and g)."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's attention builds a plan for every new sequence length (about 1 ms of host time
# per call in the backward pass); training sequences come in every length
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]


@functools.cache
def varlen_attention():
    """torch's variable-length flash attention (torch.nn.attention.varlen, 2.9 and later),
    causal: one call for all sequences of a micro-batch; None where torch lacks it.
    Imported at the first training step: the module pulls in torch._dynamo, ~1.5 s of
    every worker's start on a small CPU."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # 2.11 and later
        return functools.partial(varlen_attn, window_size=(-1, 0))
    if "is_causal" in params:
        return functools.partial(varlen_attn, is_causal=True)
    return None


def varlen_gqa() -> bool:
    """Whether the varlen call takes fewer key/value heads than query heads itself (2.12
    and later), not repeated first."""
    fn = varlen_attention()
    return fn is not None and "enable_gqa" in inspect.signature(fn.func).parameters


def rms_norm(x, weight, eps: float, residual=None):
    """kernels/rmsnorm.py's reference in fewer host ops (the trainer's step is host-bound):
    norm(x) in fp32, cast back before the weight multiply; with `residual`, (norm(x + r),
    x + r)."""
    if residual is not None:
        x = residual = x + residual
    out = weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_tables(rotary, positions, dtype):
    """cos and sin of each token's positions for `rotate`, [T, 1, D], sin's first half
    negated: computed once per forward pass, not per layer."""
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    return (torch.cat((cos, cos), -1)[:, None].to(dtype),
            torch.cat((-sin, sin), -1)[:, None].to(dtype))


def rotate(x, cos, signed_sin):
    """kernels/rotary.py's reference (the same products and sum) in fewer host ops: its
    rotated half (-x2, x1) is x rolled by half times the signed sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class CopyToRanks(torch.autograd.Function):
    """Identity; the backward pass sums the gradient over the ranks (a replicated input of
    a projection whose outputs are sharded)."""

    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.parallel.all_reduce(grad.clone()), None


class SumOverRanks(torch.autograd.Function):
    """Sum of partial results over the ranks; the gradient (replicated) passes as it is."""

    @staticmethod
    def forward(ctx, x, parallel):
        return parallel.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_parallel(module) -> bool:
    return hasattr(module, "local_columns")


def causal_attention(q, k, v, lens: list[int], cu: torch.Tensor | None):
    """Causal attention within each sequence: q, k, v [T, H, D], the sequences' `lens`
    back to back. `cu` (their int32 starts and the end): one variable-length flash call;
    None: a call per sequence."""
    if cu is not None:
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return varlen_attention()(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu,
                                max(lens), max(lens), **gqa)
    outs, start = [], 0
    with sdpa_kernel(ATTENTION_BACKENDS):  # not cuDNN: it plans each new length anew
        for n in lens:  # per sequence: [1, H, n, D]
            qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0]
                        .transpose(0, 1))
            start += n
    return torch.cat(outs)
