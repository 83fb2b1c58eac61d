"""Step time of a mixed iteration: a few running requests' decode tokens plus one prompt.

    python -m load_tests.bench_mixed --model llama-8b --decode-rows 8 --prompt-lens 0 64 128 256 512
    python -m load_tests.bench_mixed --decode-rows 1 4 --context-len 32768 --max-splits 1

Online, a new request's prompt rides in the iteration of everyone's next token, so that
iteration is a gap in every running stream. This times it: D requests decode at context
--context-len while one more request prefills P prompt tokens in the same step, launched back
to back through ModelRunner.launch as the worker does, timed with CUDA events. P = 0 is the
decode-only step (a CUDA graph). Each mixed step is timed twice: replaying its mixed-step
CUDA graph, and eagerly (the graphs set aside), beside the decode-only step. --max-splits 1
turns off splitting decode rows' keys into chunks (kernels.split_kv.MAX_SPLITS), in
decode-only and mixed steps, to compare.
"""
from __future__ import annotations

import argparse

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.kv_cache import cdiv
from engine_actors.messages import NewRequest, StepInput
from engine_actors.model_runner import ModelRunner
from kernels import split_kv
from load_tests.report import save_json


def replays(runner: ModelRunner) -> int:
    return runner.num_graph_replays + runner.num_mixed_replays


def time_mixed(runner: ModelRunner, decode_rows: int, context_len: int, prompt_len: int,
               iters: int) -> tuple[float, bool]:
    """Mean ms per step, and whether the steps replayed a graph: rows 0..D-1 decode one
    token each, row D prefills prompt_len tokens (the same prompt again every step, into the
    same blocks)."""
    rows = decode_rows + (1 if prompt_len else 0)
    blocks_each = cdiv(max(context_len, prompt_len) + iters + 16, runner.block_size)
    runner.launch(StepInput(
        new_requests=[NewRequest(r, 0.0, 1.0, 0, None) for r in range(rows)],
        rows=list(range(decode_rows)), context_lens=[context_len] * decode_rows,
        query_lens=[1] * decode_rows, sample=[True] * decode_rows, token_ids=[1] * decode_rows,
        table_rows=[r for r in range(rows) for _ in range(blocks_each)],
        table_cols=list(range(blocks_each)) * rows,
        table_blocks=list(range(rows * blocks_each)))).wait()

    def step(i):
        prompt = [prompt_len] if prompt_len else []
        return StepInput(rows=list(range(rows)), context_lens=[context_len + i] * decode_rows
                         + [0] * len(prompt), query_lens=[1] * decode_rows + prompt,
                         sample=[True] * rows,
                         token_ids=[-1] * decode_rows + [7] * prompt_len)

    for i in range(3):
        runner.launch(step(i)).wait()
    before = replays(runner)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pending = [runner.launch(step(3 + i)) for i in range(iters)]
    stop.record()
    pending[-1].wait()
    stop.synchronize()
    return start.elapsed_time(stop) / iters, replays(runner) - before == iters


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--decode-rows", type=int, nargs="+", default=[8])
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[0, 64, 128, 256, 512])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--max-splits", type=int, default=split_kv.MAX_SPLITS,
                   help="chunks of a decode row's keys at most (1: whole)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    split_kv.MAX_SPLITS = args.max_splits
    max_rows = max(args.decode_rows) + 1
    longest = max(args.context_len, max(args.prompt_lens)) + args.iters + 16
    runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16,
                         max(8192, longest), 16, max_rows, 0)
    runner.allocate_kv_cache(max_rows * cdiv(longest, runner.block_size) + 1)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    runner.capture_cuda_graphs(max_rows, max(args.prompt_lens) + max_rows)
    mixed_graphs = runner.mixed
    report = {"model": args.model, "context_len": args.context_len,
              "max_splits": args.max_splits, "steps": []}
    for d in args.decode_rows:
        for plen in args.prompt_lens:
            row = {"decode_rows": d, "prompt_len": plen}
            for mode in ["graph", "eager"] if plen else ["graph"]:
                runner.mixed = mixed_graphs if mode == "graph" else None
                row[f"{mode}_ms"], row[f"{mode}_replayed"] = time_mixed(
                    runner, d, args.context_len, plen, args.iters)
            report["steps"].append(row)
            print(f"decode rows {d:4d}  prompt {plen:5d}  graph {row['graph_ms']:7.2f} ms "
                  f"({'replayed' if row['graph_replayed'] else 'eager'})  eager "
                  f"{row.get('eager_ms', float('nan')):7.2f} ms", flush=True)
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
