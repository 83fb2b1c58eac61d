"""A fine-tuning micro-batch whole against the same in pieces (engine_actors/finetune_pieces.py),
back to back on one device, no inference beside: what cutting it into pieces costs.

    python -m load_tests.bench_pieces --model llama-8b --piece-flops 2e12 1e12

Per piece kind (forward, head, backward): count, device time (CUDA events around the
piece) and host time (launching it), averaged over --micro-batches micro-batches."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine_actors.finetune import Trainer
from engine_actors.finetune_pieces import Pieces
from load_tests.bench_finetune import HYPER, training_lines
from load_tests.report import save_json

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--tokens", type=int, default=2048, help="a micro-batch's most tokens")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--piece-flops", type=float, nargs="+", default=[2e12])
    p.add_argument("--sync-debug", action="store_true",
                   help="list the operations of a micro-batch in pieces that wait for the device")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from deployments.training_data import parse_training_file
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.finetune_job import Job
    from engine_actors.model_runner import ModelRunner
    path = resolve_model_path(args.model)
    data = "\n".join(json.dumps(line) for line in training_lines(256)).encode()
    examples = parse_training_file(data, load_tokenizer(path), args.tokens)
    model = ModelRunner(path, "cuda", torch.bfloat16, 4096, 16, 8, 0).model
    trainer = Trainer(model, 8, 16, TARGETS, HYPER["learning_rate"])
    job = Job("bench", args.model, "", examples, HYPER["n_epochs"], HYPER["batch_size"],
              HYPER["learning_rate"], {}, None, 0)
    batches = [job.next_micro(args.tokens) for _ in range(args.micro_batches + 1)]
    batches = [([examples[i][0] for i in m], [examples[i][1] for i in m], n, last)
               for m, n, last in batches]
    report = {"args": vars(args), "tokens": [sum(map(len, b[0])) for b in batches[1:]]}
    trainer.micro_step(*batches[0])  # warm-up
    if args.sync_debug:
        report["syncs"] = syncs(trainer, batches[0])
    walls = []
    for b in batches[1:]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.micro_step(*b)
        walls.append(time.perf_counter() - start)
    report["whole_ms"] = statistics.mean(walls) * 1e3
    print(f"whole: {report['whole_ms']:.1f} ms a micro-batch of "
          f"{statistics.mean(report['tokens']):.0f} tokens", flush=True)
    for flops in args.piece_flops:
        kinds: dict[str, list] = {}
        walls = []
        for i, b in enumerate(batches):
            pieces = Pieces(trainer, *b, piece_flops=flops)
            torch.cuda.synchronize()
            start, done, timed = time.perf_counter(), False, []
            while not done:
                kind = pieces.todo[0][0]
                events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                events[0].record()
                host = time.perf_counter()
                done = pieces.run_next()
                host = time.perf_counter() - host
                events[1].record()
                timed.append((kind, host, events))
            torch.cuda.synchronize()
            if i:  # the first warms up
                walls.append(time.perf_counter() - start)
                for kind, host, (e0, e1) in timed:
                    kinds.setdefault(kind, []).append((e0.elapsed_time(e1), host * 1e3))
        row = {"whole_ms": statistics.mean(walls) * 1e3, "pieces": sum(map(len, kinds.values()))
               // len(walls), "kinds": {k: {"n": len(v) // len(walls),
                                            "device_ms": statistics.mean(x for x, _ in v),
                                            "host_ms": statistics.mean(h for _, h in v)}
                                        for k, v in kinds.items()}}
        report[f"pieces_{flops:g}"] = row
        print(f"pieces at {flops:g} flops: {row['whole_ms']:.1f} ms a micro-batch in "
              f"{row['pieces']} pieces; " + "; ".join(
                  f"{k} x{v['n']}: device {v['device_ms']:.2f} ms, host {v['host_ms']:.2f} ms"
                  for k, v in row["kinds"].items()), flush=True)
    save_json(args.out, report)
    return report


def syncs(trainer, batch) -> list[str]:
    """Where a micro-batch in pieces waits for the device (torch's sync debug mode): each
    place once, with how often."""
    import collections
    import warnings
    places = collections.Counter()
    pieces = Pieces(trainer, *batch)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = False
        while not done:
            done = pieces.run_next()
    torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        places[f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"] += 1
    out = [f"{n} x {place}" for place, n in places.most_common()]
    print("waits for the device:", *out or ["none"], sep="\n  ", flush=True)
    return out


if __name__ == "__main__":
    main()
