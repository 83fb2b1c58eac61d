"""Offline throughput on ORCA's trace, systems side by side in one run.

    python -m load_tests.bench_offline --model llama-8b --out bench.json

Systems (all on the same weights and trace, EOS ignored, greedy):
  orca         this engine, through the scheduler actor and the worker actor (Ray), as served
  hf-static    transformers generate() on FCFS batches of 32 (request-level scheduling)
  hf-cb        transformers continuous batching, library defaults
  hf-cb-tuned  transformers continuous batching with CUDA graphs and 16384-token batches
Per system: elapsed seconds, generated tokens/s, requests/s, and MFU =
2 * params * (prompt + generated tokens) / elapsed / measured bf16 matmul rate.
The CPU smoke run (`--device cpu --model tiny-random-llama`) exercises the same code.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import time

import torch

from load_tests.traces import TraceRequest, orca_trace
from load_tests.report import save_json

SYSTEMS = ["orca", "hf-static", "hf-cb", "hf-cb-tuned"]
TUNED_CB = dict(use_cuda_graph=True, max_batch_tokens=16384, default_compile_level=1)


def _sampling(r: TraceRequest):
    from engine_actors.request import SamplingParams
    return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)


async def _replay(actor, trace: list[TraceRequest], adapters: list[str] = ()
                  ) -> tuple[float, list[list[int]]]:
    """Submit every request at t=0 in one call, wait for the last token; (seconds, outputs).
    With adapters, request i runs on adapter i mod len(adapters)."""
    from engine_actors.messages import EngineRequest
    from engine_actors.output_stream import run_requests
    requests = [EngineRequest(f"r{i}", r.prompt_token_ids, _sampling(r),
                              lora_name=adapters[i % len(adapters)] if adapters else None)
                for i, r in enumerate(trace)]
    start = time.perf_counter()
    results = await run_requests(actor, requests)
    elapsed = time.perf_counter() - start
    return elapsed, [results[f"r{i}"].token_ids for i in range(len(trace))]


def offline_traces(args) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """ORCA's trace (seed 0) and the warm-up requests (seed 1), token ids in the model's
    vocabulary; args: model, num_requests, prompt_len, output_len, warmup."""
    from engine_actors.checkpoint import load_hf_config, resolve_model_path
    vocab = load_hf_config(resolve_model_path(args.model)).vocab_size
    lengths = dict(prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len))
    return (orca_trace(args.num_requests, vocab, seed=0, **lengths),
            orca_trace(args.warmup, vocab, seed=1, **lengths))


def run_orca(engine_args: dict, trace: list[TraceRequest], warmup: list[TraceRequest]) -> dict:
    import ray

    from engine_actors.config import EngineConfig
    from engine_actors.scheduler_actor import SchedulerActor
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=True)
    try:
        cfg = EngineConfig.from_args(engine_args)
        actor = ray.remote(SchedulerActor).options(num_cpus=0, max_concurrency=10_000).remote(cfg)

        async def run():
            started = time.perf_counter()
            info = await actor.ready.remote()
            startup = time.perf_counter() - started
            adapters = sorted(engine_args.get("lora_modules") or {})
            await _replay(actor, warmup, adapters)
            await actor.executor_call.remote("gpu_timeline", True)
            timed_from = time.time()
            elapsed, outputs = await _replay(actor, trace, adapters)
            timeline = await actor.executor_call.remote("gpu_timeline")
            stats = await actor.stats.remote()
            traces = await actor.executor_call.remote("step_traces")
            return info, startup, elapsed, outputs, timeline, stats, traces, timed_from

        info, startup, elapsed, outputs, timeline, stats, traces, timed_from = asyncio.run(run())
        try:
            ray.get(actor.shutdown.remote())  # frees the workers' GPUs for the next system
        except ray.exceptions.RayActorError:
            pass
    finally:
        ray.shutdown()
    result = {"system": "orca", "elapsed_s": elapsed, "startup_s": startup,
              "timed_from_unix_s": timed_from,
              "kv_blocks": stats["num_blocks"], "engine_args": engine_args,
              "worker_step_trace": _trace_summary(traces)}
    if timeline and timeline[0]:
        result["alloc_retries"] = [t.get("alloc_retries") for t in timeline]
        t = timeline[-1]  # the sampling worker
        result.update(num_steps=t["num_steps"], gpu_busy_s=t["gpu_busy_ms"] / 1e3,
                      gpu_idle_between_steps_s=t["gpu_idle_between_steps_ms"] / 1e3)
        # the timed steps of the sampling worker (its trace keeps the last 256): host time
        # to enqueue each, and from its launch (or the previous step's end) to its end
        steps = traces[-1][-t["num_steps"]:]
        result["step_enqueue_ms"] = [round((s[3] - s[2]) * 1e3, 2) for s in steps]
        result["step_ms"] = [round((s[4] - max(s[2], p[4])) * 1e3, 2)
                             for p, s in zip(steps, steps[1:])]
    return result, outputs


def _trace_summary(traces: list[list[tuple]]) -> list[list[list[float]]]:
    """Per worker, the first and last 8 recorded steps: (step, arrived, launched, enqueued,
    done) in ms since the earliest of them, to see whether pipeline stages overlap."""
    recent = [t[:8] + t[-8:] for t in traces]
    t0 = min((s[1] for t in recent for s in t), default=0.0)
    return [[[s[0]] + [round((x - t0) * 1e3, 2) for x in s[1:]] for s in t] for t in recent]


def load_hf_model(model: str, device: str):
    """The transformers model with exactly the engine's weights."""
    from transformers import AutoModelForCausalLM

    from engine_actors.checkpoint import (RANDOM_MARKER, iter_checkpoint_tensors,
                                          load_hf_config, resolve_model_path)
    path = resolve_model_path(model)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if not os.path.isfile(os.path.join(path, RANDOM_MARKER)):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(load_hf_config(path), dtype=dtype)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, tensor in iter_checkpoint_tensors(path, device):
            params[name].copy_(tensor)
    return hf.eval()


def run_hf(system: str, model, trace, warmup: int) -> tuple[dict, list[list[int]]]:
    from load_tests.hf_baselines import run_continuous_batching, run_static_batches
    if system == "hf-static":
        res = run_static_batches(model, trace, batch_size=32, warmup=warmup)
    else:
        res = run_continuous_batching(model, trace, TUNED_CB if system == "hf-cb-tuned" else None,
                                      warmup=warmup)
    return {"system": system, "elapsed_s": res.elapsed_s}, res.outputs


def summarise(result: dict, trace, outputs, num_params: int, ceilings: dict) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in trace)
    generated = sum(len(o) for o in outputs)
    expected = sum(r.max_tokens for r in trace)
    elapsed = result["elapsed_s"]
    result.update(num_requests=len(trace), prompt_tokens=prompt, generated_tokens=generated,
                  all_tokens_generated=generated == expected,
                  generated_tok_s=generated / elapsed, requests_s=len(trace) / elapsed)
    if ceilings.get("matmul_bf16_tflops"):
        flops = 2 * num_params * (prompt + generated)
        result["mfu"] = flops / elapsed / (ceilings["matmul_bf16_tflops"] * 1e12)
        result["compute_floor_s"] = flops / (ceilings["matmul_bf16_tflops"] * 1e12)
    if ceilings.get("copy_gbs") and "gpu_busy_s" in result \
            and result["engine_args"].get("pipeline_parallel_size", 1) == 1:
        result["pp2_ceiling_x"] = pp_ceiling(result, 2 * num_params, ceilings["copy_gbs"], 2)
    return result


def pp_ceiling(result: dict, weight_bytes: int, copy_gbs: float, stages: int) -> float:
    """The most `stages` pipeline stages could gain over this one-GPU run. Each step's GPU
    time splits into reading the weights (weight_bytes at the copy bandwidth) and the
    rest. With one batch per stage in flight, every batch still reads all weights (a stage
    reads its share once per batch), so only the rest divides by the stages; the host time
    outside the GPU's steps stays."""
    busy, elapsed = result["gpu_busy_s"], result["elapsed_s"]
    weights = min(busy, result["num_steps"] * weight_bytes / (copy_gbs * 1e9))
    return elapsed / (elapsed - busy + weights + (busy - weights) / stages)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(1, 128))
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of this engine")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size of this engine")
    p.add_argument("--label", default="orca", help="name of this engine's row")
    p.add_argument("--warmup", type=int, default=32, help="untimed requests before each system")
    p.add_argument("--adapters", type=int, nargs="+", default=[0],
                   help="run this engine once per count, requests spread over that many random "
                        "rank-16 LoRA adapters (0: the base model, LoRA off)")
    p.add_argument("--out", help="write the JSON results here")
    args = p.parse_args(argv)

    trace, warmup = offline_traces(args)
    ceilings = {}
    if args.device == "cuda":
        from load_tests.gpu_ceilings import measure
        ceilings = measure()
    results, outputs, failed = [], {}, []
    systems = args.systems.split(",")
    for count in args.adapters if "orca" in systems else []:
        engine_args = dict(model=args.model, device=args.device, max_batch_size=args.max_batch_size,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
        label = args.label + (f"-lora{count}" if count else "")
        with tempfile.TemporaryDirectory() as tmp:
            if count:
                from engine_actors.checkpoint import resolve_model_path
                from load_tests.bench_lora import save_random_adapters
                engine_args.update(enable_lora=True, max_loras=count, max_lora_rank=16,
                                   lora_modules=save_random_adapters(
                                       resolve_model_path(args.model), tmp, count, 16))
            res, outputs[label] = run_orca(engine_args, trace, warmup)
        res["system"] = label
        results.append(res)
    hf_systems = [s for s in systems if s.startswith("hf-")]
    num_params = 0
    if hf_systems or "orca" in systems:
        model = load_hf_model(args.model, args.device)
        num_params = sum(p.numel() for p in model.parameters())
        for system in hf_systems:
            try:
                res, outputs[system] = run_hf(system, model, trace, args.warmup)
                results.append(res)
            except Exception as e:  # report it and go on with the other systems
                failed.append({"system": system, "error": f"{type(e).__name__}: {e}"[:500]})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        del model
    for res in results:
        summarise(res, trace, outputs[res["system"]], num_params, ceilings)
        if "hf-static" in outputs:  # informational: bf16 greedy on random weights is fragile
            res["same_tokens_as_hf_static"] = sum(
                a == b for a, b in zip(outputs[res["system"]], outputs["hf-static"])) / len(trace)
    report = {"model": args.model, "num_params": num_params, "ceilings": ceilings,
              "trace": {"name": "orca", "num_requests": len(trace), "seed": 0,
                        "prompt_len": args.prompt_len, "output_len": args.output_len},
              "results": results, "failed": failed}
    save_json(args.out, report)
    print(format_table(report))
    return report


def format_table(report: dict) -> str:
    base = {r["system"]: r["elapsed_s"] for r in report["results"]}
    ref = base.get("hf-cb")
    lines = [f"model {report['model']} ({report['num_params'] / 1e9:.2f}B params), "
             f"{report['trace']['num_requests']} requests; ceilings {report['ceilings']}",
             "| system | elapsed s | gen tok/s | req/s | MFU | vs hf-cb | GPU idle between steps |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
        speedup = f"{ref / r['elapsed_s']:.2f}x" if ref else "-"
        idle = (f"{r['gpu_idle_between_steps_s'] * 1e3:.0f} ms over {r['num_steps']} steps"
                if "gpu_idle_between_steps_s" in r else "-")
        lines.append(f"| {r['system']} | {r['elapsed_s']:.2f} | {r['generated_tok_s']:.0f} | "
                     f"{r['requests_s']:.1f} | {mfu} | {speedup} | {idle} |"
                     + (f" P=2 ceiling {r['pp2_ceiling_x']:.2f}x" if "pp2_ceiling_x" in r else "")
                     + (f" alloc retries {r['alloc_retries']}" if "alloc_retries" in r else ""))
    lines += [f"| {f['system']} | failed: {f['error'][:200]} |" for f in report["failed"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
