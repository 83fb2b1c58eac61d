"""All-reduce latency between the GPUs of one host: NCCL vs our one-shot kernel.

    python -m load_tests.bench_allreduce --world 2 [--out all_reduce.json]

Each rank is a Ray actor with one GPU, as the engine's workers are (Ray gives each its own
CUDA_VISIBLE_DEVICES). For bf16 messages of [tokens, 4096], it checks that the one-shot
kernel's sum equals the fp32 rank-order reference on every rank, then times, per call:
eager (200 calls between CUDA events) and inside a CUDA graph of 64 calls (as a decode
step's two all-reduces per layer run). Variants: `nccl` (torch.distributed), `one-shot`
(kernels/all_reduce.py), `one-shot-symm-barrier` (the same sum, ranks synchronized by
symmetric memory's own barrier instead of our flag exchange).
"""
from __future__ import annotations

import argparse
import os

import torch

from load_tests.report import save_json

SIZES = [1, 16, 64, 128, 256, 512, 1024]  # tokens of a [tokens, 4096] bf16 message


class Rank:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def address(self) -> str:
        from engine_actors.parallel import free_address
        return free_address()

    def run(self, address: str, max_bytes: int) -> dict:
        import ray
        import torch.distributed as dist

        from kernels.all_reduce import OneShotAllReduce, all_reduce_ref
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        own = str(ray.get_gpu_ids()[0])
        if visible and "," in visible:  # every GPU visible (--visible all): pick ours
            torch.cuda.set_device(visible.split(",").index(own))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=self.rank,
                                world_size=self.world, device_id=dev)
        group = dist.new_group(list(range(self.world)))
        one_shot = OneShotAllReduce(group, self.rank, self.world, max_bytes, dev)
        variants = {"nccl": lambda x: dist.all_reduce(x, group=group),
                    "one-shot": one_shot,
                    "one-shot-symm-barrier": lambda x: one_shot(x, exchange=False)}
        out = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "sizes": {}}
        gen = torch.Generator(device=dev).manual_seed(self.rank)
        for tokens in SIZES:
            x = torch.randn(tokens, 4096, device=dev, generator=gen).to(torch.bfloat16)
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=group)
            want = all_reduce_ref(parts)
            row = {}
            for name, fn in variants.items():
                if name != "nccl":
                    got = fn(x.clone())
                    row[f"{name}_exact"] = bool(torch.equal(got, want))
                row[f"{name}_eager_us"] = _time_eager(fn, x)
                row[f"{name}_graph_us"] = _time_graph(fn, x)
            out["sizes"][tokens] = row
        dist.destroy_process_group()
        return out


def _time_eager(fn, x, calls: int = 200) -> float:
    y = x.clone()
    for _ in range(10):
        fn(y)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(y)
    stop.record()
    stop.synchronize()
    return round(start.elapsed_time(stop) * 1e3 / calls, 2)


def _time_graph(fn, x, calls: int = 64, replays: int = 20) -> float:
    y = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(y)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return round(start.elapsed_time(stop) * 1e3 / (calls * replays), 2)


def main(argv=None) -> None:
    import ray
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=8 << 20)
    p.add_argument("--visible", choices=["own", "all"], default="own",
                   help="own: Ray's one GPU per rank; all: every rank sees every GPU")
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more environment variables for the ranks")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from engine_actors.executor import WORKER_ENV
    env = dict(WORKER_ENV, **dict(e.split("=", 1) for e in args.env))
    if args.visible == "all":
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    ray.init(include_dashboard=False, runtime_env={"env_vars": env})
    ranks = [ray.remote(num_gpus=1)(Rank).remote(r, args.world) for r in range(args.world)]
    address = ray.get(ranks[0].address.remote())
    results = ray.get([r.run.remote(address, args.max_bytes) for r in ranks])
    ray.shutdown()
    cols = ["nccl", "one-shot", "one-shot-symm-barrier"]
    print("visible devices per rank:", [r["visible"] for r in results])
    print("tokens | " + " | ".join(f"{c} eager/graph us" for c in cols) + " | exact")
    for tokens in SIZES:
        row = results[0]["sizes"][tokens]
        exact = all(r["sizes"][tokens][f"{c}_exact"] for r in results for c in cols[1:])
        print(f"{tokens} | " + " | ".join(f"{row[c + '_eager_us']} / {row[c + '_graph_us']}"
                                          for c in cols) + f" | {exact}")
    save_json(args.out, {"world": args.world, "ranks": results})


if __name__ == "__main__":
    main()
