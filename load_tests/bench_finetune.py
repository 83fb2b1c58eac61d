"""Fine-tuning in idle time beside serving, through HTTP (the server started as `make serve`
starts it, with `enable_finetuning: true`).

    python -m load_tests.bench_finetune --model llama-8b --rate 8 --out results/finetune.json

Training data: --examples prompt/completion lines of random letters, their lengths drawn as
ORCA's trace draws prompts and outputs. Runs, in order:
  dedicated  the same training in this process, a Trainer alone on the device: tokens/s
  warm-up    --warmup-s s of the same load, not timed
  serve      ORCA's trace online at --rate (Poisson) for --duration s, no job: TTFT p99 and
             median normalized latency
  serve+ft   the same load while a job trains: the same metrics, and the job's tokens/s
  idle       the job with no inference arriving, for --idle-s s: tokens/s
--rate should be half the rate the server sustains (load_tests/load_sweep.sh finds it).
Every --sample-s a sampler records the job's steps and trained tokens and the engine's
running and waiting requests; `--plot FILE` draws them over time with the load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import string
import threading
import time

import httpx

from engine_actors.config import EngineConfig
from load_tests.bench_http import launched
from load_tests.bench_prefix import wait_healthy
from load_tests.finetune_report import plot, table
from load_tests.load_client import LoadConfig, sweep
from load_tests.metrics import ratio_interval
from load_tests.traces import orca_trace
from load_tests.report import save_json

# 50 epochs (the API's most) of 256 examples outlast every phase: ~10 s an epoch on an H200 (llama-8b)
HYPER = {"n_epochs": 50, "batch_size": 16, "learning_rate": 1e-4}


def training_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def text(k):
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(k))
    return [{"prompt": text(rng.randint(32, 512)), "completion": text(rng.randint(1, 128))}
            for _ in range(n)]


def dedicated_tokens_per_s(model: str, device: str, lines: list[dict], seconds: float,
                           max_tokens: int, profile: bool = False) -> float:
    """A Trainer alone on the device, the server's micro-batching: trained tokens/s."""
    import torch

    from deployments.training_data import parse_training_file
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.finetune import Trainer
    from engine_actors.finetune_job import Job
    from engine_actors.model_runner import ModelRunner
    path = resolve_model_path(model)
    data = "\n".join(json.dumps(line) for line in lines).encode()
    examples = parse_training_file(data, load_tokenizer(path), max_tokens)
    runner = ModelRunner(path, device, torch.bfloat16 if device == "cuda" else torch.float32,
                         4096, 16, 8, 0)
    trainer = Trainer(runner.model, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"],
                      HYPER["learning_rate"])
    job = Job("dedicated", model, "", examples, HYPER["n_epochs"], HYPER["batch_size"],
              HYPER["learning_rate"], {}, None, 0)
    tokens, start, elapsed = 0, None, []
    while start is None or time.perf_counter() - start < seconds:
        micro, loss_tokens, last = job.next_micro(max_tokens)
        out = trainer.micro_step([examples[i][0] for i in micro],
                                 [examples[i][1] for i in micro], loss_tokens, last)
        if start is None:  # the first step warms up
            start = time.perf_counter()
            continue
        tokens += out["tokens"]
        elapsed.append(out["elapsed_s"])
    rate = tokens / (time.perf_counter() - start)
    if elapsed:
        print(f"dedicated: {len(elapsed)} micro-batches of {tokens / len(elapsed):.0f} tokens, "
              f"{sum(elapsed) / len(elapsed) * 1e3:.1f} ms each", flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                micro, loss_tokens, last = job.next_micro(max_tokens)
                trainer.micro_step([examples[i][0] for i in micro],
                                   [examples[i][1] for i in micro], loss_tokens, last)
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    del trainer, runner
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


def ttft_totals(text: str) -> tuple[float, float]:
    """orca:time_to_first_token_seconds' sum and count in a /metrics answer."""
    from prometheus_client.parser import text_string_to_metric_families
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name.startswith("orca:time_to_first_token_seconds_")}
    return got.get("orca:time_to_first_token_seconds_sum", 0.0), \
        got.get("orca:time_to_first_token_seconds_count", 0.0)


class Sampler(threading.Thread):
    """Every `period` s: (t, job steps, trained tokens, running, waiting, KV blocks lent to
    training, TTFT sum and count so far)."""

    def __init__(self, url: str, period: float):
        super().__init__(daemon=True)
        self.url, self.period, self.job_id = url, period, None
        self.rows: list[tuple] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.wait(self.period):
                health = client.get("/health").json()
                job = client.get(f"/v1/fine_tuning/jobs/{self.job_id}").json() \
                    if self.job_id else {}
                self.rows.append((round(time.monotonic() - self.t0, 2),
                                  job.get("steps_done", 0), job.get("trained_tokens", 0),
                                  health.get("num_running", 0), health.get("num_waiting", 0),
                                  health.get("num_lent_blocks", 0),
                                  *ttft_totals(client.get("/metrics").text)))


def piece_seconds(url: str) -> tuple[float, float]:
    """Device time of the training pieces run so far beside requests, and in gaps between
    them (finetune_busy.py)."""
    health = httpx.get(f"{url}/health", timeout=30).json()["finetuning"]
    return health["busy_piece_s"], health["gap_piece_s"]


def job_tokens(url: str, job_id: str) -> tuple[float, int]:
    job = httpx.get(f"{url}/v1/fine_tuning/jobs/{job_id}", timeout=30).json()
    if job["status"] not in ("queued", "running"):
        raise RuntimeError(f"the job ended: {job}")
    return time.monotonic(), job["trained_tokens"]


def run_load(url: str, args, label: str, seed: int) -> dict:
    """One phase of load; each phase its own prompts (`seed`), so that none hits the
    prefix cache that an earlier phase filled."""
    size = args.num_requests or math.ceil(args.rate * args.duration)  # no prompt twice
    trace = orca_trace(size, args.vocab_size, seed=seed)
    cfg = LoadConfig(url, num_warmup=args.warmup, duration_s=args.duration,
                     show_progress=False, drain_timeout_s=1800, keep_samples=True)
    [res] = asyncio.run(sweep(cfg, trace, [args.rate]))
    if res["failed"] or res["num_short_outputs"]:
        raise RuntimeError(f"{label}: {res['failed']} failed: {res['errors']}")
    print(f"{label}: TTFT p99 {res['ttft_ms']['p99']:.1f} ms, normalized latency p50 "
          f"{res['normalized_latency_ms']['median']:.2f} ms/token, "
          f"{res['completed']} requests, {res['cached_prompt_fraction']:.2f} of prompt tokens "
          "cached", flush=True)
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rate", type=float, required=True, help="requests/s of the online load")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each load run")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--num-requests", type=int, help="trace length of a phase (default: "
                   "what --rate sends in a phase, so that no prompt repeats; cut by time)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="seconds of load at --rate before the timed phases")
    p.add_argument("--finetune-max-tokens", type=int,
                   default=EngineConfig().finetune_max_tokens)
    p.add_argument("--finetune-deferral-ms", type=float, default=200.0,
                   help="FineInfer's deferral bound (the engine's default: 200)")
    p.add_argument("--busy-share", type=float, default=0.0,
                   help="the engine's finetune_busy_share: training's share of the time "
                   "while requests run (0: FineInfer's rule only)")
    p.add_argument("--dedicated-after", action="store_true",
                   help="run the dedicated trainer again after the server has stopped")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the engine's token budget per iteration (load_sweep.sh's default)")
    p.add_argument("--server-log", help="a file for the server's output")
    p.add_argument("--profile", action="store_true",
                   help="print the dedicated run's costliest device ops (torch profiler)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the server's share of the GPU (what is not the KV pool is the "
                   "memory training has without borrowing KV blocks)")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--plot")
    p.add_argument("--out")
    args = p.parse_args(argv)
    lines = training_lines(args.examples)
    report = {"args": vars(args), "hyperparameters": HYPER,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    report["dedicated_tokens_s"] = dedicated_tokens_per_s(
        args.model, args.device, lines, args.idle_s, args.finetune_max_tokens, args.profile)
    print(f"dedicated: {report['dedicated_tokens_s']:.0f} trained tokens/s", flush=True)
    engine_args = {"model": args.model, "device": args.device, "enable_finetuning": True,
                   "finetune_max_tokens": args.finetune_max_tokens,
                   "finetune_deferral_ms": args.finetune_deferral_ms,
                   "finetune_busy_share": args.busy_share,
                   "gpu_memory_utilization": args.gpu_memory_utilization,
                   "max_batch_size": args.max_batch_size,
                   "max_num_batched_tokens": args.max_num_batched_tokens}
    url = f"http://127.0.0.1:{args.port}"
    with launched(engine_args, 1, args.port, log=args.server_log) as server:
        wait_healthy(url, server)
        sampler = Sampler(url, args.sample_s)
        sampler.start()
        phases = {}
        mark = sampler.t0
        if args.warmup_s:  # the first seconds of load after start-up are slower: not timed
            run_load(url, argparse.Namespace(**{**vars(args), "duration": args.warmup_s}),
                     "warm-up", seed=1)
        phases["serve"] = [time.monotonic() - mark]
        report["serve"] = run_load(url, args, "serve", seed=2)
        phases["serve"].append(time.monotonic() - mark)
        with httpx.Client(base_url=url, timeout=120) as client:
            data = "\n".join(json.dumps(line) for line in lines).encode()
            file_id = client.post("/v1/files", data={"purpose": "fine-tune"},
                                  files={"file": ("train.jsonl", data)}).json()["id"]
            job = client.post("/v1/fine_tuning/jobs", json={
                "training_file": file_id, "model": args.model, "hyperparameters": HYPER,
                "lora": {"r": 8, "alpha": 16}}).json()
        sampler.job_id = job_id = job["id"]
        while job_tokens(url, job_id)[1] == 0:
            time.sleep(0.2)
        t0, n0 = job_tokens(url, job_id)
        p0 = piece_seconds(url)
        report["serve+ft"] = run_load(url, args, "serve+ft", seed=3)
        t1, n1 = job_tokens(url, job_id)
        # the share of the time that pieces took beside requests and between them, as the
        # engine measured
        report["piece_time_share"], report["gap_piece_time_share"] = (
            (x - y) / (t1 - t0) for x, y in zip(piece_seconds(url), p0))
        phases["serve+ft"] = [t0 - mark, t1 - mark]
        time.sleep(args.idle_s)
        t2, n2 = job_tokens(url, job_id)
        phases["idle"] = [t1 - mark, t2 - mark]
        report["finetuning_health"] = httpx.get(f"{url}/health", timeout=30).json().get(
            "finetuning")
        print("server's fine-tuning state:", report["finetuning_health"], flush=True)
        httpx.post(f"{url}/v1/fine_tuning/jobs/{job_id}/cancel", timeout=30)
        sampler.stop.set()
        report.update(loaded_tokens_s=(n1 - n0) / (t1 - t0), idle_tokens_s=(n2 - n1) / (t2 - t1),
                      phases_s=phases, timeline=sampler.rows, timeline_columns=[
                          "t_s", "steps_done", "trained_tokens", "num_running", "num_waiting",
                          "num_lent_blocks", "ttft_sum_s", "ttft_count"])
    # how well this one run decides the latency targets: ratios with 95% intervals
    # (requests resampled by the second they were sent in)
    a, b = (report[k].pop("samples_ms") for k in ("serve", "serve+ft"))
    seconds = tuple([int(t) for t in x["sent_s"]] for x in (a, b))
    report["intervals"] = {key: ratio_interval(a[name], b[name], q, seconds) for key, name, q in
                           (("ttft_p99", "ttft", 99),
                            ("normalized_latency_p50", "normalized_latency", 50))}
    if args.dedicated_after:  # the same GPU after minutes of load: is it as fast?
        report["dedicated_after_tokens_s"] = dedicated_tokens_per_s(
            args.model, args.device, lines, args.idle_s, args.finetune_max_tokens)
    print(table(report))
    save_json(args.out, report)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
