"""Decode steps and LoRA training on one GPU at the same time: what each costs the other.

    python -m load_tests.bench_colocate --model llama-8b --batch-size 32 --sms 16 32 64

Issue 17 asks for training at half of its dedicated speed while serving at half load, with
latency within 10%. Taking turns cannot do that (a decode step is busy for all of its
~6 ms), so this measures sharing the GPU instead: decode steps run as the worker runs them
(CUDA graph, two in flight, the next launched when the oldest is done) on the main thread,
on a high-priority stream over the whole GPU, while a `Trainer` runs micro-batches back to
back on a second thread and its own stream:
  - a low-priority stream over the whole GPU;
  - a stream of a CUDA green context of k SMs (`--sms`): training confined to those SMs,
    decode free to use every SM. The SMs a green stream's kernels actually ran on are
    counted (each block of a probe kernel records its SM id) and reported.
The trainer is the server's: a micro-batch's ops launched from Python, so the decode
thread may wait for the GIL; `--switch-ms` sets how long at most (Python's switch interval). (One CUDA graph of
a micro-batch's forward and backward trained 5% faster alone on an H200, and hung beside
the decode steps: not used.) Each run reports the decode step's wall time (p50, p99) and
trained tokens/s over the micro-batches finished in the run's window. The decode batch's
KV positions wrap within a window, so every step attends over context-len to context-len +
256 tokens.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import json
import threading
import time

import torch
import torch.nn.functional as F

from engine_actors.checkpoint import resolve_model_path
from engine_actors.finetune import Trainer
from engine_actors.kv_cache import cdiv
from engine_actors.messages import StepInput
from engine_actors.model_runner import ModelRunner
from load_tests.bench_decode import new_request
from load_tests.report import save_json

WRAP = 256
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Decoder:
    """A decode batch of `batch` rows, stepped in a closed loop from the calling thread."""

    def __init__(self, runner: ModelRunner, batch: int, context_len: int):
        self.runner, self.batch, self.ctx, self.i = runner, batch, context_len, 0
        blocks_each = cdiv(context_len + WRAP + 8, runner.block_size)
        runner.allocate_kv_cache(batch * blocks_each, lendable=False)
        runner.capture_cuda_graphs(batch)
        runner.launch(StepInput(
            new_requests=[new_request(r, "plain", context_len) for r in range(batch)],
            rows=list(range(batch)), context_lens=[context_len] * batch,
            query_lens=[1] * batch, sample=[True] * batch, token_ids=[1] * batch,
            table_rows=[r for r in range(batch) for _ in range(blocks_each)],
            table_cols=list(range(blocks_each)) * batch,
            table_blocks=list(range(batch * blocks_each)))).wait()

    def run(self, seconds: float, stream) -> dict:
        times, pending, b = [], collections.deque(), self.batch
        with torch.cuda.stream(stream):
            end = time.perf_counter() + seconds
            last = time.perf_counter()
            while time.perf_counter() < end:
                self.i += 1
                pending.append(self.runner.launch(StepInput(
                    rows=list(range(b)), context_lens=[self.ctx + self.i % WRAP] * b,
                    query_lens=[1] * b, sample=[True] * b, token_ids=[-1] * b)))
                if len(pending) == 2:
                    pending.popleft().result()
                    now = time.perf_counter()
                    times.append((now - last) * 1e3)
                    last = now
            while pending:
                pending.popleft().result()
        times.sort()
        return {"decode_p50_ms": times[len(times) // 2],
                "decode_p99_ms": times[int(len(times) * 0.99)], "decode_steps": len(times)}


class TrainLoop:
    """Micro-batches of `tokens` tokens (sequences of 256, the second half trained on), an
    AdamW step after each, back to back on a thread."""

    def __init__(self, trainer: Trainer, tokens: int):
        self.trainer, self.tokens = trainer, tokens
        gen = torch.Generator().manual_seed(0)
        lens = [min(256, tokens - s) for s in range(0, tokens, 256)]
        seqs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lens]
        masks = [[False] * (n // 2) + [True] * (n - n // 2) for n in lens]
        self.inputs = trainer.inputs(seqs, masks)
        self.loss_tokens = self.inputs[-1].numel()

    def _forward_backward(self):
        with torch.enable_grad():
            logits, targets = self.trainer.forward_tensors(*self.inputs)
            (F.cross_entropy(logits, targets, reduction="sum") / self.loss_tokens).backward()

    def start(self, stream):
        self.stop, self.done = threading.Event(), []
        self.thread = threading.Thread(target=self._loop, args=(stream,), daemon=True)
        self.thread.start()

    def _loop(self, stream):
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                self._forward_backward()
                self.trainer.optimizer.step()
                self.trainer.optimizer.zero_grad(set_to_none=False)
                stream.synchronize()
                self.done.append(time.perf_counter())

    def finish(self, t0: float, t1: float) -> float:
        """Trained tokens/s between the first and the last micro-batch finished in [t0, t1]
        (whole micro-batches counted over the window would round to them)."""
        self.stop.set()
        self.thread.join()
        ends = [t for t in self.done if t0 <= t <= t1]
        if len(ends) < 2:
            raise RuntimeError(f"{len(ends)} micro-batches finished in {t1 - t0:.1f} s: "
                               "use longer --seconds or smaller --train-tokens")
        return (len(ends) - 1) * self.tokens / (ends[-1] - ends[0])


class Hog:
    """Work of one kind beside the decode steps, on a thread, in place of the trainer: to
    tell which of the trainer's demands slows them. "gemm": bf16 4096^3 matmuls (compute,
    ~6% of the memory bandwidth); "copy": copies of 1 GiB (memory bandwidth only)."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "gemm":
            self.a, self.b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
                              for _ in range(2))
            self.c = torch.empty_like(self.a)
        else:
            self.a = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
            self.c = torch.empty_like(self.a)

    def _op(self):
        if self.kind == "gemm":
            torch.mm(self.a, self.b, out=self.c)
        else:
            self.c.copy_(self.a)

    def start(self, stream):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(stream,), daemon=True)
        self.thread.start()

    def _loop(self, stream):
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                for _ in range(8):
                    self._op()
                stream.synchronize()

    def finish(self, t0: float, t1: float) -> None:
        self.stop.set()
        self.thread.join()


GREEN_CONTEXTS = []  # kept alive while their streams are in use


def green_stream(num_sms: int):
    """A stream whose kernels run on `num_sms` SMs only (a CUDA green context; the driver
    may round the count up). Every context of torch's API starts at the same SMs, so only
    one is made at a time: the trainer's."""
    from torch.cuda.green_contexts import GreenContext
    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    except TypeError:  # torch 2.10's positional signature
        ctx = GreenContext.create(num_sms, torch.cuda.current_device())
    if not hasattr(ctx, "Stream"):
        raise RuntimeError("this torch's green contexts give no stream (torch >= 2.11)")
    GREEN_CONTEXTS.append(ctx)
    return ctx.Stream()


def sms_used(stream) -> int:
    """How many SMs the kernels of `stream` ran on: 16 blocks per SM of the device each
    record the SM they ran on."""
    import triton
    import triton.language as tl

    @triton.jit
    def record_sm(out_ptr):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    blocks = 16 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(blocks, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        record_sm[(blocks,)](out)
    stream.synchronize()
    return int(out.unique().numel())


def measure(label, decoder, loop, seconds, decode_stream, train_stream) -> dict:
    row = {"run": label}
    if loop is not None:
        loop.start(train_stream)
        time.sleep(1.0)  # its first micro-batches
    t0 = time.perf_counter()
    if decoder is not None:
        row.update(decoder.run(seconds, decode_stream))
    else:
        time.sleep(seconds)
    t1 = time.perf_counter()
    if loop is not None:
        rate = loop.finish(t0, t1)
        if rate is not None:
            row["train_tokens_per_s"] = rate
    torch.cuda.synchronize()
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--train-tokens", type=int, default=2048, help="tokens per micro-batch")
    p.add_argument("--sms", type=int, nargs="*", default=[16, 32, 64],
                   help="SMs of the trainer's green context, one set of runs each")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--switch-ms", type=float, nargs="*", default=[5.0],
                   help="Python's thread switch interval (sys.setswitchinterval; 5 ms is its "
                        "default), one set of shared runs each: how long the decode thread "
                        "may wait for the GIL that the trainer's thread holds")
    p.add_argument("--hogs", nargs="*", default=[], choices=["gemm", "copy"],
                   help="also run decode beside each kind of work alone (class Hog), on "
                        "each --sms green context")
    p.add_argument("--out")
    args = p.parse_args(argv)
    runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16, 8192, 16,
                         args.batch_size, 0)
    decoder = Decoder(runner, args.batch_size, args.context_len)
    trainer = Trainer(runner.model, 8, 16, TARGETS, 1e-4)
    loop = TrainLoop(trainer, args.train_tokens)
    lo_p, hi_p = torch.cuda.Stream.priority_range()
    high, low = torch.cuda.Stream(priority=hi_p), torch.cuda.Stream(priority=lo_p)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    s, rows = args.seconds, []
    rows.append(measure("decode alone", decoder, None, s, high, None))
    rows.append(measure("train alone", None, loop, s, None, low))
    greens = {}
    for k in args.sms:
        greens[k] = green_stream(k)
        used = sms_used(greens[k])
        rows.append(measure(f"train alone on {k} SMs ({used} used)", None, loop, s, None,
                            greens[k]))
    for ms in args.switch_ms:
        sys.setswitchinterval(ms / 1e3)
        at = f", switch {ms:g} ms"
        rows.append(measure("both, train on a low-priority stream" + at, decoder, loop, s,
                            high, low))
        for k, train in greens.items():
            rows.append(measure(f"both, training on {k} SMs" + at, decoder, loop, s, high,
                                train))
    sys.setswitchinterval(0.005)
    for kind in args.hogs:
        hog = Hog(kind)
        where = [("a low-priority stream", low)] + [(f"{k} SMs", g) for k, g in greens.items()]
        for name, stream in where:
            rows.append(measure(f"both, a {kind} loop on {name} instead", decoder, hog, s,
                                high, stream))
        del hog
    rows.append(measure("decode alone, again", decoder, None, s, high, None))
    base, base_p99 = rows[0]["decode_p50_ms"], rows[0]["decode_p99_ms"]
    dedicated = rows[1]["train_tokens_per_s"]  # on the whole GPU
    print(f"\n{args.model}, decode batch {args.batch_size}, context {args.context_len}+, "
          f"micro-batches of {args.train_tokens} tokens, {total} SMs")
    print("| run | decode p50 / p99 ms | decode p50 / p99 vs alone | trained tok/s | vs alone |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        d = (f"{r['decode_p50_ms']:.2f} / {r['decode_p99_ms']:.2f} | "
             f"{r['decode_p50_ms'] / base:.2f}x / {r['decode_p99_ms'] / base_p99:.2f}x"
             ) if "decode_p50_ms" in r else "- | -"
        t = r.get("train_tokens_per_s")
        t = f"{t:,.0f} | {t / dedicated:.2f}" if t is not None else "- | -"
        print(f"| {r['run']} | {d} | {t} |")
    save_json(args.out, {"args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # green contexts torn down before the tensors on them abort the exit
