"""Decode step time at a given batch size against its memory floor.

    python -m load_tests.bench_decode --model llama-8b --batch-size 64 --context-len 512
    python -m load_tests.bench_decode --model llama-8b --batch-size 64 --tp 2   # via Ray
    python -m load_tests.bench_decode --context-len 4096 --kv-cache-dtype fp8 --variants

A decode step must read every weight once and every cached key/value of the batch once,
so (weight bytes + KV bytes) / measured copy bandwidth is its floor. Steps are launched
back to back through ModelRunner.launch, as the worker does (CUDA graph when captured),
and timed with CUDA events over many steps. With --tp, the same runs on every rank of a
tensor-parallel worker group (Ray actors in a placement group, NCCL all-reduces), and the
floor counts each rank's share of the weights and KV.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.cuda_graphs import BATCH_SIZES
from engine_actors.kv_cache import cdiv
from engine_actors.messages import NewRequest, ProcessorSettings, StepInput
from engine_actors.model_runner import ModelRunner
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json


def weight_bytes(model) -> int:
    """Bytes a decode step reads: all weights, except the input embedding table when it is not
    also the LM head (a step reads only its batch's rows of it)."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or not name.startswith("embed_tokens"))


# A JSON schema that never has to end: an array of records, each with free text, a number
# and a list of strings (string, number and structure states all come up).
RECORDS_SCHEMA = json.dumps({"type": "array", "items": {
    "type": "object", "required": ["name", "id", "tags"],
    "properties": {"name": {"type": "string"}, "id": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}})

# what every request of the batch asks for, besides greedy decoding
VARIANTS = {
    "plain": {},
    "logprobs": dict(logprobs=5),  # the sampled token's logprob and the top 5
    "penalties": dict(processors=True),  # repetition, presence and frequency penalties
    "sampled": dict(sampled=True),  # temperature 1 (against which vllm_fields compares)
    # temperature 1 with min_p 0.05, allowed_token_ids (16,000) and bad_words (16 of three
    # tokens)
    "vllm_fields": dict(sampled=True, vllm_fields=True),
    # every other request under the JSON schema (structured output, issue 14)
    "json_half": dict(grammar=("json_schema", RECORDS_SCHEMA), every=2),
    # the same schema after a reasoning model's thinking (deployments/structured.py's
    # reasoning_grammar): the random model stays in the free text before </think>
    "json_half_reasoning": dict(grammar=("json_schema", RECORDS_SCHEMA), every=2,
                                reasoning="deepseek_r1"),
    # the same where </think> is one token (as in DeepSeek-R1's and Qwen3's vocabularies):
    # the engine masks nothing until that token
    "json_half_thinking": dict(grammar=("json_schema", RECORDS_SCHEMA), every=2,
                               reasoning="deepseek_r1", think_token=True),
}
GRAMMAR_VARIANTS = {"json_half": "json", "json_half_reasoning": "json_reasoning",
                    "json_half_thinking": "json_thinking"}  # -> prefix of their host times


def new_request(row: int, variant: str, context_len: int, lora_slot: int = -1,
                tokenizer_dir: str | None = None) -> NewRequest:
    extra = dict(VARIANTS[variant])
    if extra.pop("processors", False):
        extra["processors"] = ProcessorSettings(context_len, presence_penalty=0.5,
                                                frequency_penalty=0.5, repetition_penalty=1.1)
    if extra.pop("sampled", False):
        fields = extra.pop("vllm_fields", False)
        processors = ProcessorSettings(
            context_len, allowed_ids=tuple(range(0, 32_000, 2)),
            bad_words=tuple((i, i + 1, i + 2) for i in range(100, 116))) if fields else None
        return NewRequest(row, 1.0, 1.0, 0, None, 0.05 if fields else 0.0,
                          processors=processors, lora_slot=lora_slot)
    parser = extra.pop("reasoning", None)
    think_ids = (None, None)
    if extra.pop("think_token", False):
        from deployments.reasoning import think_token_ids
        from engine_actors.checkpoint import load_tokenizer
        think_ids = think_token_ids(load_tokenizer(tokenizer_dir))
        assert think_ids[1] is not None, "the tokenizer has no </think> token"
    if row % extra.pop("every", 1):
        extra.pop("grammar")
    elif parser is not None:
        from deployments.structured import reasoning_grammar
        extra["grammar"] = reasoning_grammar(extra["grammar"], parser, think_ids=think_ids)
    return NewRequest(row, 0.0, 1.0, 0, None, lora_slot=lora_slot, **extra)


def bpe_tokenizer_dir(vocab_size: int) -> str:
    """A byte-level BPE tokenizer of `vocab_size` - 2 tokens (<think> and </think> among
    them, as in reasoning models' vocabularies), trained on this Python's standard library:
    the built-in models' byte tokenizer has 258 tokens, and a grammar mask's cost grows with
    the tokens it has to check (Llama 3 has 128k)."""
    import glob
    import os
    import sysconfig
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    path = os.path.join(tempfile.gettempdir(), f"orca-serve-bpe-think-{vocab_size}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2,
                                      special_tokens=["<s>", "</s>", "<think>", "</think>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(
            (open(f, encoding="utf-8", errors="ignore").read() for f in files), trainer)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>") \
            .save_pretrained(path)
    return path


def graph_size(batch: int) -> int:
    """The decode graph a batch replays, as in the server (graphs up to max_batch_size): the
    smallest captured size that holds it."""
    return next((b for b in BATCH_SIZES if b >= batch), batch)


def time_decode(runner: ModelRunner, batch: int, context_len: int, iters: int,
                variant: str = "plain", lora_slots: list[int] | None = None,
                drafts: int = 0) -> float:
    """Mean ms per step over `iters` back-to-back steps, after warm-up; lora_slots: each
    request's LoRA adapter slot (default: the base model); drafts: each request's draft
    tokens per step, verified as speculative decoding's (1 + drafts query tokens)."""
    q = 1 + drafts
    blocks_each = cdiv(context_len + (iters + 8) * q, runner.block_size)
    slots = lora_slots or [-1] * batch
    tokenizer_dir = runner.head.grammars.model_path
    first = StepInput(new_requests=[new_request(r, variant, context_len, slots[r], tokenizer_dir)
                                    for r in range(batch)],
                      rows=list(range(batch)), context_lens=[context_len] * batch,
                      query_lens=[1] * batch, sample=[True] * batch, token_ids=[1] * batch,
                      table_rows=[r for r in range(batch) for _ in range(blocks_each)],
                      table_cols=list(range(blocks_each)) * batch,
                      table_blocks=list(range(batch * blocks_each)))
    runner.launch(first).wait()

    def step(i):  # (a draft's tokens are known ids; a plain decode continues on the device)
        return StepInput(rows=list(range(batch)), context_lens=[context_len + i * q] * batch,
                         query_lens=[q] * batch, sample=[True] * batch,
                         token_ids=[7] * (q * batch) if drafts else [-1] * batch,
                         num_drafts=[drafts] * batch if drafts else [])

    for i in range(5):
        runner.launch(step(i)).wait()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pending = [runner.launch(step(i)) for i in range(iters)]
    stop.record()
    pending[-1].wait()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def _time_grammar_host(head) -> dict:
    """Host time of each step's grammar work: the whole mask (waiting for the previous
    step's tokens, advancing the matchers, filling, copying) and the fill alone."""
    spent = {"json_mask_host_ms": [0.0, 0], "json_fill_host_ms": [0.0, 0]}

    def timed(fn, key):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key][0] += time.perf_counter() - start
                spent[key][1] += 1
        return call
    head._grammar_mask = timed(head._grammar_mask, "json_mask_host_ms")
    head.grammars.bitmask = timed(head.grammars.bitmask, "json_fill_host_ms")
    return spent


def _bench_worker_class():
    """A worker (same setup: process group, shard loading) that times decode steps."""
    from engine_actors.worker import Worker

    class DecodeBenchWorker(Worker):
        grammar_threads: list[int] = []
        variants: list[str] | None = None  # those to time beside plain (None: all)

        def run_decode(self, batch: int, context_len: int, iters: int) -> dict:
            runner = self.runner
            runner.allocate_kv_cache(batch * cdiv(context_len + iters + 8, runner.block_size))
            for k, v in runner.kv_caches:  # (an FP8 pool takes them converted)
                k.copy_(torch.randn(k.shape, device=k.device))
                v.copy_(torch.randn(v.shape, device=v.device))
            eager = time_decode(runner, batch, context_len, iters)
            runner.capture_cuda_graphs(graph_size(batch))
            graph = time_decode(runner, batch, context_len, iters)
            kv = batch * (context_len + iters // 2) * runner.kv_bytes_per_block() \
                // runner.block_size
            # grammar masks against a realistic vocabulary, not the byte tokenizer
            runner.head.grammars.model_path = bpe_tokenizer_dir(runner.hf_config.vocab_size)
            variants, spent = {}, {}
            for v in [v for v in VARIANTS if v != "plain" and (
                    self.variants is None or v in self.variants)]:
                if v == "json_half":  # the grammar variants' steps count in the host times
                    spent = _time_grammar_host(runner.head)
                for key in spent:  # each variant's own
                    spent[key][:] = [0.0, 0]
                variants[v] = time_decode(runner, batch, context_len, iters, v)
                if v in GRAMMAR_VARIANTS:
                    prefix = GRAMMAR_VARIANTS[v]
                    matchers = runner.head.grammars.matchers.values()  # still under it
                    variants[f"{prefix}_rows_active"] = sum(not m.is_terminated()
                                                            for m in matchers)
                    for key, (seconds, calls) in spent.items():  # per step with grammar rows
                        variants[key.replace("json", prefix, 1)] = seconds / max(calls, 1) * 1e3
            for threads in self.grammar_threads:  # the same with a set number of fill threads
                runner.head.grammars.threads, runner.head.grammars._batch = threads, None
                for key in spent:
                    spent[key][:] = [0.0, 0]
                variants[f"json_half_t{threads}"] = time_decode(runner, batch, context_len,
                                                                iters, "json_half")
                seconds, calls = spent["json_fill_host_ms"]
                variants[f"json_fill_host_ms_t{threads}"] = seconds / max(calls, 1) * 1e3
            return {"eager_ms": eager, "graph_ms": graph, "weight_bytes": weight_bytes(runner.model),
                    "kv_bytes": kv, "variants_ms": variants}

    return DecodeBenchWorker


def run_tensor_parallel(model: str, batch: int, ctx: int, iters: int, tp: int,
                        nccl_only: bool = False, quantization: str | None = None,
                        kv_cache_dtype: str = "auto") -> dict:
    import os

    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engine_actors.config import EngineConfig
    from engine_actors.executor import WORKER_ENV
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False)
    cfg = EngineConfig.from_args(dict(model=model, device="cuda", tensor_parallel_size=tp,
                                      max_batch_size=graph_size(batch),
                                      disable_custom_all_reduce=nccl_only,
                                      quantization=quantization, kv_cache_dtype=kv_cache_dtype))
    pg = placement_group([{"GPU": 1, "CPU": 1}] * tp, strategy="STRICT_PACK")
    ray.get(pg.ready())
    cls = ray.remote(_bench_worker_class())
    workers = [cls.options(num_gpus=1, num_cpus=1, runtime_env={"env_vars": WORKER_ENV},
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i))
               .remote(cfg, "cuda", i) for i in range(tp)]
    address = ray.get(workers[0].address.remote())
    ray.get([w.setup.remote(8192, address) for w in workers])
    results = ray.get([w.run_decode.remote(batch, ctx, iters) for w in workers])
    ray.shutdown()
    return {"eager_ms": max(r["eager_ms"] for r in results),
            "graph_ms": max(r["graph_ms"] for r in results),
            "weight_bytes": results[0]["weight_bytes"], "kv_bytes": results[0]["kv_bytes"]}


def decode_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments every decode-step benchmark takes (this one, bench_lora)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    return p


def main(argv=None) -> dict:
    p = decode_arguments(__doc__)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="every all-reduce through NCCL (the engine arg of that name)")
    p.add_argument("--grammar-threads", type=int, nargs="*", default=[],
                   help="also json_half with xgrammar filling masks on this many threads")
    p.add_argument("--quantization", choices=["fp8"],
                   help="the engine arg: the projections quantized as they load")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                   help="the engine arg: keys and values stored in 8 bits")
    p.add_argument("--variants", nargs="*", choices=sorted(VARIANTS),
                   help="time only these beside plain (given without names: none)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth_gbs()
    batch, ctx = args.batch_size, args.context_len
    if args.tp > 1:
        r = run_tensor_parallel(args.model, batch, ctx, args.iters, args.tp,
                                args.disable_custom_all_reduce, args.quantization,
                                args.kv_cache_dtype)
    else:
        runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16, 8192, 16,
                             graph_size(batch), 0, quantization=args.quantization,
                             kv_cache_dtype=args.kv_cache_dtype)
        holder = _Holder(runner)
        holder.grammar_threads, holder.variants = args.grammar_threads, args.variants
        r = _bench_worker_class().run_decode.__get__(holder)(batch, ctx, args.iters)
    floor_ms = (r["weight_bytes"] + r["kv_bytes"]) / (bandwidth * 1e9) * 1e3
    report = {"model": args.model, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "batch_size": batch,
              "context_len": ctx, "tp": args.tp,
              "custom_all_reduce": args.tp > 1 and not args.disable_custom_all_reduce,
              "copy_gbs": bandwidth, "weight_gb_per_rank": r["weight_bytes"] / 1e9,
              "kv_gb_per_rank": r["kv_bytes"] / 1e9, "floor_ms": floor_ms,
              "eager_ms": r["eager_ms"], "graph_ms": r["graph_ms"],
              "graph_over_floor": r["graph_ms"] / floor_ms}
    variants = dict(r.get("variants_ms", {}))
    for prefix in GRAMMAR_VARIANTS.values():  # rows active at the end; host ms per step
        for key in ("rows_active", "mask_host_ms", "fill_host_ms"):
            report[f"{prefix}_{key}"] = variants.pop(f"{prefix}_{key}", None)
    for key in [k for k in variants if k.startswith("json_fill_host_ms_t")]:
        report[key] = variants.pop(key)
    for variant, ms in variants.items():  # every request (json_half: every other) asking
        report[f"{variant}_ms"] = ms
        report[f"{variant}_over_plain"] = ms / r["graph_ms"]
    print(json.dumps(report, indent=2))
    save_json(args.out, report)
    return report


class _Holder:
    """Lets the single-GPU path call run_decode on a bare runner."""

    def __init__(self, runner):
        self.runner = runner


if __name__ == "__main__":
    main()
