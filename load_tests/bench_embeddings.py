"""Embeddings through HTTP (runner pooling, POST /v1/embeddings) beside transformers' batched
forward on the same weights, as sentence-transformers runs it (inputs sorted by length,
padded batches, the last real token's final hidden state, normalized).

    python -m load_tests.bench_embeddings --model llama-1b --num-inputs 4096

The inputs are token-id lists of 32-512 tokens (RAG chunks), all sent at t=0 in requests of
--inputs-per-request each, with the vectors as base64 (the openai client's default) and as
JSON floats, one server. Both systems embed the same inputs in bf16; the HTTP system's
vectors are checked against transformers' (cosine similarity).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import random
import time

import numpy as np
import torch
import torch.nn.functional as F

from load_tests.bench_http import _wait_healthy, launched
from load_tests.bench_offline import load_hf_model
from load_tests.report import save_json


def make_inputs(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run_hf(model, inputs: list[list[int]], batch_size: int) -> tuple[float, np.ndarray]:
    """Seconds to embed `inputs` (after one warm-up batch), and the embeddings in order."""
    base = model.model
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out = np.zeros((len(inputs), model.config.hidden_size), dtype=np.float32)

    def batch(ids: list[list[int]]) -> torch.Tensor:
        width = max(map(len, ids))
        tokens = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for r, p in enumerate(ids):  # right padding: the last real token is at len - 1
            tokens[r, :len(p)], mask[r, :len(p)] = torch.tensor(p), 1
        with torch.no_grad():
            hidden = base(input_ids=tokens.cuda(), attention_mask=mask.cuda()).last_hidden_state
        last = hidden[torch.arange(len(ids)), torch.tensor([len(p) - 1 for p in ids])]
        return F.normalize(last.float(), dim=-1)

    batch([inputs[i] for i in order[:batch_size]])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(0, len(order), batch_size):
        chosen = order[k:k + batch_size]
        out[chosen] = batch([inputs[i] for i in chosen]).cpu().numpy()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


async def run_http(url: str, inputs: list[list[int]], per_request: int,
                   encoding: str) -> tuple[float, np.ndarray]:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _wait_healthy(session, url)

        async def send(chunk: list[list[int]]) -> list[np.ndarray]:
            async with session.post(f"{url}/v1/embeddings", json={
                    "model": "bench", "input": chunk, "encoding_format": encoding}) as r:
                body = await r.json()
                assert r.status == 200, body
                return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                        if encoding == "base64" else np.asarray(d["embedding"], np.float32)
                        for d in body["data"]]
        chunks = [inputs[k:k + per_request] for k in range(0, len(inputs), per_request)]
        await asyncio.gather(*(send(c) for c in chunks[:8]))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(send(c) for c in chunks))
        elapsed = time.perf_counter() - start
    return elapsed, np.asarray([v for r in results for v in r], dtype=np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--num-inputs", type=int, default=4096)
    ap.add_argument("--lengths", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--inputs-per-request", type=int, default=16)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 128])
    # base64: what the openai client asks for unless told otherwise
    ap.add_argument("--encodings", nargs="+", default=["base64", "float"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = load_hf_model(args.model, "cuda")
    inputs = make_inputs(args.num_inputs, tuple(args.lengths), model.config.vocab_size)
    tokens = sum(map(len, inputs))
    rows, ref = [], None
    for bs in args.hf_batch_sizes:
        seconds, ref = run_hf(model, inputs, bs)
        rows.append({"system": f"transformers batch {bs}", "seconds": seconds})
    del model
    torch.cuda.empty_cache()
    engine = {"model": args.model, "runner": "pooling", "enable_prefix_caching": False,
              "max_batch_size": 256, "max_num_batched_tokens": args.max_num_batched_tokens}
    with launched(engine, port=8000):
        for encoding in args.encodings:
            seconds, got = asyncio.run(run_http("http://127.0.0.1:8000", inputs,
                                                args.inputs_per_request, encoding))
            cosine = (got * ref).sum(axis=1)
            rows.append({"system": f"orca-serve HTTP, {encoding}", "seconds": seconds,
                         "min_cosine_vs_transformers": float(cosine.min())})
    print(f"{args.num_inputs} inputs, {tokens} tokens, {args.model}, bf16")
    print("| system | s | inputs/s | tokens/s |\n| --- | --- | --- | --- |")
    for r in rows:
        r.update(inputs_per_s=args.num_inputs / r["seconds"], tokens_per_s=tokens / r["seconds"])
        print(f"| {r['system']} | {r['seconds']:.2f} | {r['inputs_per_s']:.0f} | "
              f"{r['tokens_per_s']:.0f} |")
    print("min cosine similarity, HTTP vs transformers: "
          f"{min(r['min_cosine_vs_transformers'] for r in rows if 'HTTP' in r['system']):.4f}")
    save_json(args.out, {"model": args.model, "num_inputs": args.num_inputs, "tokens": tokens,
                         "inputs_per_request": args.inputs_per_request, "rows": rows})


if __name__ == "__main__":
    main()
