"""What training rows would cost inside a decode step's matrix products, llama-8b's shapes.

    python -m load_tests.bench_rows --model llama-8b --decode-rows 18 --train-rows 0 16 24 32 48 64 96 128

Issue 17 asks for training at half its dedicated speed beside serving at half load, within
10% of serving's latency. At that load the engine runs decode steps of ~18 rows back to
back (BENCHMARKS.md, 2026-11-25), and their matrix products are bound by reading the
weights. Training rows could ride on those reads:
  - a forward row is one more row of the same product X·Wᵀ (selective batching already
    flattens every request's tokens into it);
  - a backward row needs the input gradient dY·W, a product that reads W the other way
    round: a second product reads all the weights again. One kernel that reads each tile of W
    once for both (two reductions, over K and over N) does not exist here; its time can only
    be bounded from below, by the larger of one read of the weights and the arithmetic at
    the product rate measured here.

This times the products of a whole step (every layer's qkv, o, gate_up and down, and the LM
head, each layer its own random weights so that nothing stays in L2), as one CUDA graph, at
D decode rows alone, at D + T (T training rows' forward), and with T rows of dY·W beside
them (the backward as a second product). Attention, norms, LoRA and the loss are not in it:
they would add to the training rows' cost, never take from it.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from load_tests.report import save_json


def shapes(model: str) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(N, K) of one layer's four products, the layer count, and the LM head's (N, K)."""
    from transformers import AutoConfig

    from engine_actors.checkpoint import resolve_model_path
    c = AutoConfig.from_pretrained(resolve_model_path(model))
    h, inter, d = c.hidden_size, c.intermediate_size, c.head_dim if getattr(
        c, "head_dim", None) else c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    return [(qkv, h), (h, c.num_attention_heads * d), (2 * inter, h), (h, inter)], \
        c.num_hidden_layers, (c.vocab_size, h)


def graph_ms(fn, replays: int = 20, repeats: int = 7) -> float:
    """Median ms of one call of `fn`, captured as a CUDA graph and replayed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def ceilings() -> dict:
    """The device's two rates, measured: a large copy (bytes read + written per second) and
    a large bf16 product (flop/s)."""
    a = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    b = torch.empty_like(a)
    copy_ms = graph_ms(lambda: b.copy_(a), replays=5)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = graph_ms(lambda: x @ x, replays=5)
    del a, b
    return {"copy_gb_s": 2 * 2 * 2**30 / copy_ms / 1e6, "mm_tflop_s": 2 * 8192**3 / mm_ms / 1e9}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--decode-rows", type=int, default=18)
    p.add_argument("--train-rows", type=int, nargs="+", default=[0, 16, 24, 32, 48, 64, 96, 128])
    p.add_argument("--out")
    args = p.parse_args(argv)
    layer, num_layers, head = shapes(args.model)
    torch.manual_seed(0)
    peak = ceilings()
    weights = [[torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for n, k in layer]
               for _ in range(num_layers)] + [[torch.randn(*head, dtype=torch.bfloat16,
                                                            device="cuda") * 0.02]]
    params = sum(w.numel() for ws in weights for w in ws)
    d, most = args.decode_rows, max(args.train_rows)
    xs = {k: torch.randn(d + most, k, dtype=torch.bfloat16, device="cuda") for _, k in layer + [head]}
    grads = {n: torch.randn(most, n, dtype=torch.bfloat16, device="cuda") for n, _ in layer + [head]}

    def step(rows: int, backward_rows: int):
        def run():
            for ws in weights:
                for w in ws:
                    F.linear(xs[w.shape[1]][:rows], w)
                    if backward_rows:
                        torch.mm(grads[w.shape[0]][:backward_rows], w)
        return run

    alone = graph_ms(step(d, 0))
    rows = []
    for t in args.train_rows:
        fwd = graph_ms(step(d + t, 0))
        both = graph_ms(step(d + t, t)) if t else fwd
        # a fused kernel reads W once and does the arithmetic of d + 2t rows: bounded by the
        # larger of one read (decode alone) and that arithmetic at the product rate, and
        # stood in for by one product of d + 2t rows (cuBLAS's efficiency at that size)
        bound = max(alone, 2 * (d + 2 * t) * params / (peak["mm_tflop_s"] * 1e9))
        like = graph_ms(step(d + 2 * t, 0)) if t else fwd
        rows.append({"train_rows": t, "decode_ms": alone, "forward_ms": fwd,
                     "forward_backward_ms": both, "fused_bound_ms": bound,
                     "fused_as_one_product_ms": like})
        print(f"T {t:4d}  decode {alone:6.3f}  +fwd {fwd / alone - 1:+6.1%}  +fwd+bwd, two "
              f"products {both / alone - 1:+6.1%}  fused: bound {bound / alone - 1:+6.1%}, "
              f"as one product of D+2T rows {like / alone - 1:+6.1%}", flush=True)
    result = {"model": args.model, "decode_rows": d, "params": params, "ceilings": peak,
              "device": torch.cuda.get_device_name(), "rows": rows}
    print(f"{params / 1e9:.2f} B params in the products; decode alone reads them at "
          f"{2 * params / alone / 1e9:.2f} TB/s; copy {peak['copy_gb_s']:.0f} GB/s "
          f"(read + written), product {peak['mm_tflop_s']:.0f} TFLOP/s")
    save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
