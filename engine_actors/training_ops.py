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


def _varlen_causal():
    """torch's variable-length flash attention (torch.nn.attention.varlen, 2.9 and later),
    causal: one call for all sequences of a micro-batch; None where torch lacks it."""
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


VARLEN_ATTENTION = _varlen_causal()


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
        return VARLEN_ATTENTION(q.contiguous(), k.contiguous(), v, cu, cu, max(lens), max(lens))
    outs, start = [], 0
    with sdpa_kernel(ATTENTION_BACKENDS):  # not cuDNN: it plans each new length anew
        for n in lens:  # per sequence: [1, H, n, D]
            qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0]
                        .transpose(0, 1))
            start += n
    return torch.cat(outs)
