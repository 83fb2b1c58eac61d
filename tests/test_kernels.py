"""Kernel references against independent formulations, on random ragged data."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import paged_attention_ref
from kernels.kv_write import kv_write_ref
from kernels.rmsnorm import rmsnorm_ref
from kernels.rotary import rotary_ref
from kernels.act_mul import act_mul_ref


def random_paged_batch(seq_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                       seed=0):
    """Contiguous per-request K/V, plus the same data scattered into a shuffled block pool."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=g)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        block_tables[i, :n] = perm[used:used + n].int()
        used += n
        pos = torch.arange(s)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        ks.append(k_cache[slots].clone())
        vs.append(v_cache[slots].clone())
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=g)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return q, k_cache, v_cache, block_tables, cu, ks, vs


def dense_causal_attention(q, k, v, scale):
    """q [n, Hq, D] are the last n positions of a sequence with keys k [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    n, L = q.shape[0], k.shape[1]
    mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=L - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_paged_attention_ref_matches_dense(block_size, heads):
    seq_lens = [1, 7, 33, 16, 50]
    query_lens = [1, 7, 5, 1, 50]  # decode, full prefill, chunk, decode, prefill
    q, k_cache, v_cache, tables, cu, ks, vs = random_paged_batch(
        seq_lens, query_lens, heads[0], heads[1], 16, block_size)
    out = paged_attention_ref(q, k_cache, v_cache, torch.tensor(cu), torch.tensor(seq_lens),
                              tables, block_size, 0.25)
    for i in range(len(seq_lens)):
        ref = dense_causal_attention(q[cu[i]:cu[i + 1]], ks[i], vs[i], 0.25)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, rtol=1e-5, atol=1e-5)


def test_kv_write_ref_scatters_to_slots():
    k_cache, v_cache = torch.zeros(20, 2, 4), torch.zeros(20, 2, 4)
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    slots = torch.tensor([19, 0, 7, 3, 12])
    kv_write_ref(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s], k[t]) and torch.equal(v_cache[s], v[t])
    untouched = [s for s in range(20) if s not in slots.tolist()]
    assert k_cache[untouched].abs().sum() == 0


def test_rmsnorm_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x, r = torch.randn(9, 32), torch.randn(9, 32)
    hf = LlamaRMSNorm(32, eps=1e-5)
    hf.weight.data = torch.randn(32)
    torch.testing.assert_close(rmsnorm_ref(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)
    out, res = rmsnorm_ref(x, hf.weight, 1e-5, r)
    torch.testing.assert_close(res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, hf(x + r), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_ref_with_unit_offset_matches_gemma3s(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    x = torch.randn(9, 32).to(dtype)
    hf = Gemma3RMSNorm(32, eps=1e-6).to(dtype)
    hf.weight.data = torch.randn(32).to(dtype)
    torch.testing.assert_close(rmsnorm_ref(x, hf.weight, 1e-6, unit_offset=True), hf(x),
                               rtol=0, atol=0)


def test_rotary_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    T, D = 11, 16
    q, k = torch.randn(T, 4, D), torch.randn(T, 2, D)
    pos = torch.randint(0, 100, (T,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      emb.cos()[None], emb.sin()[None])
    q_out, k_out = rotary_ref(q, k, freqs.cos(), freqs.sin())
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1))
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1))


def test_act_mul_ref():
    x = torch.randn(5, 12)
    torch.testing.assert_close(act_mul_ref(x), F.silu(x[:, :6]) * x[:, 6:])
    gelu = 0.5 * x[:, :6] * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (
        x[:, :6] + 0.044715 * x[:, :6] ** 3)))  # (the tanh approximation's formula)
    torch.testing.assert_close(act_mul_ref(x, "gelu_tanh"), gelu * x[:, 6:])


# ---- Triton kernels against their references ------------------------------------------
# CPU: the Triton interpreter in fp32. GPU: compiled, in bf16 and fp32.
from kernels.attention import paged_attention_triton  # noqa: E402
from kernels.kv_write import kv_write_triton  # noqa: E402
from kernels.rmsnorm import rmsnorm_triton  # noqa: E402
from kernels.rotary import rotary_triton  # noqa: E402
from kernels.act_mul import act_mul_triton  # noqa: E402

TARGETS = [pytest.param("cpu", torch.float32, id="interpreter-fp32"),
           pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
           pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu)]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("heads,block_size,q_lens,s_lens", [
    ((4, 4), 16, [1, 1, 1, 1], [5, 70, 1, 16]),  # decode only
    ((8, 2), 1, [1, 7, 5, 1, 50], [1, 7, 33, 16, 50]),  # mixed, token-level blocks
    ((6, 2), 4, [3, 1, 130], [40, 9, 200]),  # group of 3, chunked prefill
    ((4, 1), 16, [65], [65]),  # MQA, one prompt over a tile boundary
])
def test_paged_attention_kernel(device, dtype, heads, block_size, q_lens, s_lens):
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, heads[0],
                                                               heads[1], 64, block_size)
    args = [t.to(device) for t in (q, k_cache, v_cache)]
    args = [a.to(dtype) for a in args]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor(s_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    out = paged_attention_triton(*args, cu_t, lens, tables, block_size, 0.125, max(q_lens))
    ref = paged_attention_ref(*[a.float() for a in args], cu_t, lens, tables, block_size, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("window", [1, 24, 70])
def test_paged_attention_kernel_with_a_sliding_window(device, dtype, window):
    """Mixed decodes and a chunked prompt over several tiles; windows of one token, of
    less than a tile, and of more (the kernel starts at the first block a tile can see)."""
    q_lens, s_lens = [1, 7, 130, 1], [90, 7, 200, 24]
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, 6, 2, 64, 4)
    args = [t.to(device).to(dtype) for t in (q, k_cache, v_cache)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor(s_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    out = paged_attention_triton(*args, cu_t, lens, tables, 4, 0.125, max(q_lens),
                                 window=window)
    ref = paged_attention_ref(*[a.float() for a in args], cu_t, lens, tables, 4, 0.125,
                              window=window)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    full = paged_attention_ref(*[a.float() for a in args], cu_t, lens, tables, 4, 0.125)
    assert not torch.allclose(ref, full)  # the window changed the answer


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [
    (5, 4, 2, 16),  # decode-sized: an expert with no pair, most blocks mostly padding
    (70, 8, 2, 16),  # an expert with more than a block
    (40, 6, 3, 64),  # prompt-sized blocks
    (90, 2, 2, 128),  # the largest blocks
])
def test_expert_matmul_kernel(device, dtype, tokens, num_experts, top_k, block_m):
    """Both of a mixture of experts' matmuls through the fused kernel (a token's row for
    each of its k pairs, then each pair's own row), in pair order, against one pair at a
    time; every pair's row written (the output starts uninitialised)."""
    from kernels.moe import align_pairs, expert_matmul, expert_matmul_ref
    g = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                           for _ in range(tokens)])
    experts[:, 0] = torch.where(experts[:, 0] == 1, 0, experts[:, 0])  # (fewer on expert 1)
    experts = experts.to(device)
    x = torch.randn(tokens, 96, generator=g).to(device, dtype)
    w13 = torch.randn(num_experts, 40, 96, generator=g).to(device, dtype)
    w2 = torch.randn(num_experts, 96, 40, generator=g).to(device, dtype)
    pair_ids, block_experts = align_pairs(experts, num_experts, block_m)
    hidden = expert_matmul(x, w13, pair_ids, block_experts, tokens * top_k, top_k, block_m)
    ref = expert_matmul_ref(x.float(), w13.float(), experts, top_k)
    tol = {**TOL[dtype], "atol": 0.5} if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(hidden.float(), ref, **tol)
    out = expert_matmul(hidden, w2, pair_ids, block_experts, tokens * top_k, 1, block_m)
    torch.testing.assert_close(out.float(), expert_matmul_ref(hidden.float(), w2.float(),
                                                              experts, 1), **tol)


@pytest.mark.parametrize("one_launch", [False, True], ids=["torch", "triton"])
def test_pairs_aligned_by_expert(one_launch):
    """Each expert's pairs in a run of whole blocks, in pair order, padded with the pair
    count; each block names its run's expert, and the blocks past the last name none."""
    from kernels.moe import align_pairs, align_pairs_triton
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5: experts 2 0 2 3 0 2
    pair_ids, block_experts = align_pairs_triton(experts, 4, 2, 7) if one_launch \
        else align_pairs(experts, 4, 2)
    assert pair_ids.tolist() == [1, 4, 0, 2, 5, 6, 3, 6] + [6] * 6  # expert 0, 2 (two), 3
    assert block_experts.tolist() == [0, 2, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [
    (1, 128, 8, 16), (64, 128, 8, 16), (37, 6, 2, 16), (300, 12, 4, 64), (500, 8, 2, 128),
    (700, 8, 2, 16), (1, 1, 1, 16), (0, 4, 2, 16), (5, 2, 1, 16)])
def test_one_launch_alignment_against_torch(device, tokens, num_experts, top_k, block_m):
    """The one-launch alignment (more pairs than one chunk, expert counts that are not
    powers of two, experts with no pair) gives the torch ops' layout exactly."""
    from kernels.moe import align_pairs, align_pairs_triton
    g = torch.Generator().manual_seed(tokens)
    experts = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    want = align_pairs(experts, num_experts, block_m)  # (CPU: the torch ops)
    num_blocks = want[1].shape[0]
    got = align_pairs_triton(experts.to(device), num_experts, block_m, num_blocks)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_experts_on_cpu_against_a_loop():
    """The CPU path (torch._grouped_mm over pairs sorted by expert, put back in pair order)
    against each pair's SwiGLU MLP."""
    from engine_actors.layers.moe import grouped_experts
    experts = torch.tensor([[1, 0], [1, 3], [0, 1], [3, 1]])
    x, w13, w2 = torch.randn(4, 32), torch.randn(4, 24, 32), torch.randn(4, 32, 12)
    out = grouped_experts(x, w13, w2, experts)
    for p, e in enumerate(experts.flatten().tolist()):
        gate, up = (w13[e] @ x[p // 2]).chunk(2)
        torch.testing.assert_close(out[p], w2[e] @ (F.silu(gate) * up), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("window", [0, 24])
def test_paged_attention_kernel_with_soft_capped_scores(device, dtype, window):
    """Gemma 2's soft-capping of the scores (c tanh(s / c)), alone and with a window."""
    q_lens, s_lens = [1, 7, 130, 1], [90, 7, 200, 24]
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, 6, 2, 64, 4)
    args = [(t * 3).to(device).to(dtype) for t in (q, k_cache, v_cache)]  # (scores that cap)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor(s_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    out = paged_attention_triton(*args, cu_t, lens, tables, 4, 0.125, max(q_lens),
                                 window=window, softcap=2.0)
    ref = paged_attention_ref(*[a.float() for a in args], cu_t, lens, tables, 4, 0.125,
                              window=window, softcap=2.0)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    plain = paged_attention_ref(*[a.float() for a in args], cu_t, lens, tables, 4, 0.125,
                                window=window)
    assert not torch.allclose(ref, plain, atol=1e-2)  # the cap changed the answer


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads,q_lens,s_lens,pad_requests,pad_tokens,bucket", [
    ((8, 2), [1, 7, 5, 1, 50], [1, 7, 33, 260, 300], 3, 17, 128),  # decodes and prompts
    ((4, 4), [1, 1], [9, 400], 6, 30, 32),  # decode rows only, most of the graph empty
    ((4, 1), [97], [120], 0, 0, 97),  # one chunk, every work item used
])
def test_paged_attention_kernel_from_a_work_list(device, dtype, splits, heads, q_lens, s_lens,
                                                 pad_requests, pad_tokens, bucket):
    """As a CUDA graph runs it: a fixed grid of work items built on the device, padding
    requests with no tokens and padding tokens that belong to no request; with `splits`,
    each decode row's keys in that many chunks (one item each) beside the prompts' tiles."""
    from kernels.attention import tile_shape, work_list
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, heads[0],
                                                               heads[1], 64, 4)
    real = q.shape[0]
    q = torch.cat([q, torch.randn(pad_tokens, heads[0], 64)])
    cu_pad = cu + [cu[-1]] * pad_requests
    lens = s_lens + [0] * pad_requests
    tables = torch.cat([tables, torch.zeros(pad_requests, tables.shape[1], dtype=torch.int32)])
    q, k_cache, v_cache = [t.to(device).to(dtype) for t in (q, k_cache, v_cache)]
    cu_t = torch.tensor(cu_pad, dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    block_m = tile_shape(heads[0], heads[1], 64, bucket)[0]
    num_work = -(-(real + pad_tokens) // block_m) + len(lens) * splits
    work = work_list(cu_t, block_m, num_work, splits)
    expected = [(i, t) for i, n in enumerate(q_lens)
                for t in range(splits if n == 1 else -(-n // block_m))]
    assert work[:len(expected)].tolist() == [list(e) for e in expected]
    assert (work[len(expected):, 0] == -1).all()
    out = paged_attention_triton(q, k_cache, v_cache, cu_t, lens_t, tables, 4, 0.125, bucket,
                                 work=work, splits=splits)
    ref = paged_attention_ref(q[:real].float(), k_cache.float(), v_cache.float(),
                              cu_t[:len(q_lens) + 1], lens_t[:len(q_lens)],
                              tables[:len(q_lens)], 4, 0.125)
    torch.testing.assert_close(out[:real].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("splits,window,softcap,dim", [
    (2, 0, 0.0, 64), (4, 24, 0.0, 64), (16, 0, 30.0, 80), (16, 100, 0.0, 64)])
def test_decode_step_split_into_chunks_of_keys(device, dtype, splits, window, softcap, dim):
    """Flash decoding: each request's keys in `splits` chunks, merged by a second kernel.
    Requests longer and shorter than one chunk (the short ones leave chunks empty), one of a
    single token, a padding request with no query token (as a decode graph has), a window
    that starts inside a chunk, soft-capped scores, a head size that is not a power of 2."""
    s_lens = [300, 1, 70, 129]
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, [1] * 4, 8, 2, dim, 4)
    q, k_cache, v_cache = [t.to(device).to(dtype) for t in (q, k_cache, v_cache)]
    cu_t = torch.tensor(cu + [cu[-1]], dtype=torch.int32, device=device)
    lens = torch.tensor(s_lens + [0], dtype=torch.int32, device=device)
    tables = torch.cat([tables, tables[:1]]).to(device)
    args = (q, k_cache, v_cache, cu_t, lens, tables, 4, 0.125, 1)
    out = paged_attention_triton(*args, window=window, softcap=softcap, splits=splits)
    whole = paged_attention_triton(*args, window=window, softcap=softcap, splits=1)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), cu_t[:5], lens[:4],
                              tables[:4], 4, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(out.float(), whole.float(), **TOL[dtype])


def test_decode_splits_keep_about_four_programs_per_sm(monkeypatch):
    from kernels import split_kv
    monkeypatch.setattr(split_kv, "_num_sms", lambda device: 132)  # 528 programs at most
    batches = (1, 2, 4, 8, 16, 17, 32, 33, 66, 67, 512)
    assert [split_kv.decode_splits(b, 8, "cuda") for b in batches] == \
        [32, 32, 16, 8, 4, 2, 2, 2, 1, 1, 1]
    assert split_kv.decode_splits(1, 1, "cuda") == 32  # never past MAX_SPLITS
    assert split_kv.decode_splits(1, 8, "cpu") == 1  # (the reference attention)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("num_tokens,heads,dim", [(1, 1, 16), (13, 2, 64), (7, 8, 128)])
def test_kv_write_kernel(device, dtype, num_tokens, heads, dim):
    k = torch.randn(num_tokens, heads, dim, device=device).to(dtype)
    v = torch.randn(num_tokens, heads, dim, device=device).to(dtype)
    slots = torch.randperm(64, device=device)[:num_tokens]
    caches = [torch.randn(64, heads, dim, device=device).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    kv_write_triton(k, v, caches[0], caches[1], slots)
    kv_write_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# An FP8 pool (kv_cache_dtype "fp8", "fp8_e5m2"): the GPU only (the interpreter's FP8
# conversions do not round as the device does)
FP8_POOLS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2,
                                                                         id="e5m2")]


def test_kv_write_ref_into_an_fp8_pool_divides_and_saturates():
    k = torch.tensor([[[1.0, -3.0, 1e6, -1e6]]])
    k_cache, v_cache = torch.zeros(4, 1, 4, dtype=torch.float8_e5m2), torch.zeros(4, 1, 4)
    kv_write_ref(k, k, k_cache, v_cache, torch.tensor([2]), k_scale=0.5)
    assert k_cache[2].float().tolist() == [[2.0, -6.0, 57344.0, -57344.0]]  # e5m2's largest


@pytest.mark.parametrize("kv_dtype", FP8_POOLS)
def test_paged_attention_ref_reads_an_fp8_pool(kv_dtype):
    seq_lens, query_lens = [1, 33, 50], [1, 5, 50]
    q, k_cache, v_cache, tables, cu, ks, vs = random_paged_batch(seq_lens, query_lens, 8, 2,
                                                                 16, 4)
    k8, v8 = (k_cache * 2).to(kv_dtype), (v_cache / 3).to(kv_dtype)  # stored: k / 0.5, v / 3
    out = paged_attention_ref(q, k8, v8, torch.tensor(cu), torch.tensor(seq_lens), tables, 4,
                              0.25, k_scale=0.5, v_scale=3.0)
    for i, (k, v) in enumerate(zip(ks, vs)):
        k, v = (k * 2).to(kv_dtype).float() / 2, (v / 3).to(kv_dtype).float() * 3
        ref = dense_causal_attention(q[cu[i]:cu[i + 1]], k, v, 0.25)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", FP8_POOLS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (24, 0.0), (0, 30.0)])
@pytest.mark.parametrize("q_lens,splits", [([1, 7, 130, 1], None), ([1, 1, 1, 1], 8)])
def test_paged_attention_kernel_on_an_fp8_pool(dtype, kv_dtype, window, softcap, q_lens,
                                               splits):
    """Mixed steps, and decode steps split into chunks (v_scale applies at their merge)."""
    s_lens = [90, 7, 200, 24]
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, 8, 2, 128, 16)
    k8, v8 = (k_cache * 4).to(kv_dtype).cuda(), (v_cache * 0.5).to(kv_dtype).cuda()
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    lens = torch.tensor(s_lens, dtype=torch.int32, device="cuda")
    tables = tables.cuda()
    out = paged_attention_triton(q.cuda().to(dtype), k8, v8, cu_t, lens, tables, 16, 0.125,
                                 max(q_lens), window=window, softcap=softcap, k_scale=0.25,
                                 v_scale=2.0, splits=splits)
    ref = paged_attention_ref(q.cuda().to(dtype).float(), k8.float() * 0.25, v8.float() * 2.0,
                              cu_t, lens, tables, 16, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", FP8_POOLS)
def test_kv_write_kernel_into_an_fp8_pool(dtype, kv_dtype):
    k = (torch.randn(13, 2, 64, device="cuda") * 200).to(dtype)  # some beyond e4m3's 448
    v = torch.randn(13, 2, 64, device="cuda").to(dtype)
    slots = torch.randperm(64, device="cuda")[:13]
    caches = [torch.zeros(64, 2, 64, device="cuda").to(kv_dtype) for _ in range(4)]
    kv_write_triton(k, v, caches[0], caches[1], slots, k_scale=0.5, v_scale=0.01)
    kv_write_ref(k, v, caches[2], caches[3], slots, k_scale=0.5, v_scale=0.01)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert caches[0].float().isfinite().all()


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (9, 100), (33, 2048)])
def test_rmsnorm_kernel(device, dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    r = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), **TOL[dtype])
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6, unit_offset=True),
                               rmsnorm_ref(x, w, 1e-6, unit_offset=True), **TOL[dtype])
    out, res = rmsnorm_triton(x, w, 1e-6, r)
    ref_out, ref_res = rmsnorm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("num_tokens,width", [(1, 32), (5, 344), (17, 2 * 1408)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_kernel(device, dtype, num_tokens, width, act):
    x = torch.randn(num_tokens, width, device=device).to(dtype) * 3
    torch.testing.assert_close(act_mul_triton(x, act), act_mul_ref(x, act), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("num_tokens,q_heads,k_heads,dim", [(1, 1, 1, 16), (11, 6, 2, 64),
                                                            (5, 32, 8, 128)])
def test_rotary_kernel(device, dtype, num_tokens, q_heads, k_heads, dim):
    qkv = torch.randn(num_tokens, (q_heads + 2 * k_heads) * dim, device=device).to(dtype)
    q = qkv[:, :q_heads * dim].view(num_tokens, q_heads, dim)  # strided views, as in the model
    k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(num_tokens, k_heads, dim)
    angles = torch.rand(num_tokens, dim // 2, device=device) * 100
    q_out, k_out = rotary_triton(q, k, angles.cos(), angles.sin())
    q_ref, k_ref = rotary_ref(q, k, angles.cos(), angles.sin())
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


HEAD_SIZES = [16, 24, 64, 80, 96, 112, 128, 256]  # every size in use; non-powers of two masked


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_every_kernel_handles_every_head_size(device, dtype, dim):
    q_lens, s_lens, block_size = [1, 6, 3], [9, 6, 20], 4
    q, k_cache, v_cache, tables, cu, _, _ = random_paged_batch(s_lens, q_lens, 4, 2, dim,
                                                               block_size)
    q, k_cache, v_cache = [t.to(device).to(dtype) for t in (q, k_cache, v_cache)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor(s_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    scale = dim ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, cu_t, lens, tables, block_size, scale,
                                 max(q_lens))
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), cu_t, lens, tables,
                              block_size, scale)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])

    k = torch.randn(q.shape[0], 2, dim, device=device).to(dtype)
    angles = torch.rand(q.shape[0], dim // 2, device=device) * 100
    for got, want in zip(rotary_triton(q, k, angles.cos(), angles.sin()),
                         rotary_ref(q, k, angles.cos(), angles.sin())):
        torch.testing.assert_close(got, want, **TOL[dtype])

    slots = torch.randperm(64, device=device)[:q.shape[0]]
    caches = [torch.randn(64, 2, dim, device=device).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    kv_write_triton(k, k, caches[0], caches[1], slots)
    kv_write_ref(k, k, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

    heads = q.reshape(-1, dim)  # Qwen3's per-head norm: rows of one head each
    w = torch.randn(dim, device=device).to(dtype)
    torch.testing.assert_close(rmsnorm_triton(heads, w, 1e-6), rmsnorm_ref(heads, w, 1e-6),
                               **TOL[dtype])
