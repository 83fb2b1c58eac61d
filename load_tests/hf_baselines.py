"""The two transformers baselines of the offline throughput benchmark (ORCA section 6.2).

* `run_static_batches`: request-level scheduling, the FasterTransformer-style baseline of the ORCA
  paper. Requests are taken first-come-first-served in fixed batches and a batch holds its slots
  until its longest request finishes.
* `run_continuous_batching`: transformers' own continuous batching (`init_continuous_batching`),
  with every request present at t=0.

Both are greedy and ignore EOS the way every system replaying a trace does: EOS is an ordinary
token that neither stops a request nor is suppressed, so each request yields exactly `max_tokens`
tokens and both baselines produce the same tokens as per-request `model.generate`.

Written against the API surface shared by transformers 5.17 (benchmark GPU image) and 5.23 (local
CPU venv); where the two differ (ContinuousBatchingConfig's `block_size` became `page_size`), the
config keys are translated, and a missing entry point fails with a clear error.
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import time
from dataclasses import dataclass, field

import torch

from load_tests.traces import TraceRequest

# EOS id that never matches a real token, continuous batching's "no EOS": nothing stops on it.
NO_EOS = -1
# ContinuousBatchingConfig fields renamed between supported transformers versions (5.17 -> 5.23).
_CB_RENAMED = {"block_size": "page_size", "page_size": "block_size"}


@dataclass
class BaselineResult:
    name: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    outputs: list[list[int]] = field(repr=False)  # generated ids per request, in trace order


def _sync(model) -> None:
    """Wait for queued GPU work so the wall clock covers all of it."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _warmup_requests(trace: list[TraceRequest], n: int, vocab_size: int) -> list[TraceRequest]:
    """The first n requests with every token id shifted by one: the same shapes (what compile and
    CUDA graphs care about) but different prompts, so no prefix cache can make the timed run cheap."""
    return [TraceRequest([(t + 1) % vocab_size for t in r.prompt_token_ids], r.max_tokens)
            for r in trace[:n]]


def _result(name: str, trace: list[TraceRequest], elapsed_s: float,
            outputs: list[list[int]]) -> BaselineResult:
    return BaselineResult(name, elapsed_s, len(trace),
                          sum(len(r.prompt_token_ids) for r in trace),
                          sum(len(o) for o in outputs), outputs)


# ---------------------------------------------------------------- static (request-level) batches

def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def _out_of_vocab_id(model) -> int:
    """A token id the model can never produce (past both the config vocab and the LM head)."""
    head = model.get_output_embeddings()
    return max(model.config.vocab_size, getattr(head, "out_features", 0) or 0)


def _generate_batch(model, batch: list[TraceRequest], pad_id: int) -> list[list[int]]:
    """One request-level batch: left-pad to the longest prompt and decode until the longest
    request is done (the waste the ORCA paper measures); each output is cut to its max_tokens."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - n:] = 1
    steps = max(r.max_tokens for r in batch)
    # An id past the vocabulary disables EOS like NO_EOS does (never stops, masks no logit, so
    # min_new_tokens is a no-op guard) without generate's per-call warning about negative ids.
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                         eos_token_id=_out_of_vocab_id(model), pad_token_id=pad_id)
    new = out[:, width:].tolist()
    return [new[i][:r.max_tokens] for i, r in enumerate(batch)]


def run_static_batches(model, trace: list[TraceRequest], batch_size: int = 32,
                       warmup: int = 0) -> BaselineResult:
    """Request-level scheduling: FCFS batches of `batch_size`, each run to its longest request.

    `warmup` requests (shifted copies of the first ones, one untimed batch) run first so that
    kernel selection and allocator growth are not charged to the timed trace.
    """
    pad_id = _pad_id(model)
    if warmup > 0:
        _generate_batch(model, _warmup_requests(trace, min(warmup, batch_size),
                                                model.config.vocab_size), pad_id)
    _sync(model)
    start = time.perf_counter()
    outputs: list[list[int]] = []
    for i in range(0, len(trace), batch_size):
        outputs.extend(_generate_batch(model, trace[i:i + batch_size], pad_id))
    _sync(model)
    return _result(f"hf-static-b{batch_size}", trace, time.perf_counter() - start, outputs)


# ---------------------------------------------------------------- continuous batching

def _cb_config(cb_config: dict | None):
    """ContinuousBatchingConfig(**cb_config), translating keys renamed between versions and
    naming the valid keys when one is unknown; None keeps the library defaults."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError as e:
        raise RuntimeError("this transformers has no ContinuousBatchingConfig (needs >= 5.17)") from e
    if cb_config is None:
        return None
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs = {}
    for key, value in cb_config.items():
        if key not in fields and _CB_RENAMED.get(key) in fields:
            key = _CB_RENAMED[key]
        if key not in fields:
            raise ValueError(f"unknown ContinuousBatchingConfig key {key!r}; valid: {sorted(fields)}")
        kwargs[key] = value
    return ContinuousBatchingConfig(**kwargs)


def _check_cb_api(model) -> None:
    """Fail early and clearly if this transformers lacks the continuous batching calls used here."""
    if not hasattr(model, "init_continuous_batching"):
        raise RuntimeError(f"{type(model).__name__} has no init_continuous_batching; "
                           "transformers >= 5.17 is needed for the continuous batching baseline")
    params = inspect.signature(model.init_continuous_batching).parameters
    if "continuous_batching_config" not in params:
        raise RuntimeError("init_continuous_batching takes no continuous_batching_config; "
                           f"its parameters are {list(params)}")


def _cb_run(mgr, trace: list[TraceRequest], tag: str, timeout_s: float) -> list[list[int]]:
    """Add every request at once, then collect all of them; returns outputs in trace order."""
    ids = [f"{tag}-{i}" for i in range(len(trace))]
    for rid, r in zip(ids, trace):
        if mgr.add_request(r.prompt_token_ids, request_id=rid, max_new_tokens=r.max_tokens,
                           eos_token_id=NO_EOS) is None:
            raise RuntimeError(f"continuous batching refused request {rid}")
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        res = mgr.get_result(timeout=0.5)
        if res is None:
            if not mgr.is_running() or time.monotonic() > deadline:
                raise RuntimeError(f"continuous batching stopped with {len(done)}/{len(ids)} "
                                   "requests finished")
            continue
        if res.error is not None:
            raise RuntimeError(f"continuous batching request {res.request_id} failed: {res.error}")
        if res.is_finished():
            done[res.request_id] = list(res.generated_tokens)
    return [done[rid] for rid in ids]


def run_continuous_batching(model, trace: list[TraceRequest], cb_config: dict | None = None,
                            warmup: int = 0, timeout_s: float = 3600.0) -> BaselineResult:
    """transformers continuous batching over the whole trace, all requests added at t=0.

    `cb_config`: kwargs for ContinuousBatchingConfig (None = library defaults). Untimed: the
    manager's own warmup (CUDA graph capture / compile at the largest shapes) and then `warmup`
    requests (shifted copies of the first ones) through the same manager, since the first calls
    after compile or graph capture are slow.

    Caution, seen with transformers 5.17 on an H200 without flash-attn (attention falls back to
    paged sdpa, whose mask is query tokens x KV tokens read): the defaults and
    max_batch_tokens=16384 returned wrong tokens for large prefill batches, and the default
    cache size made the warmup run out of memory. dict(num_blocks=1024, max_batch_tokens=4096,
    use_cuda_graph=True, default_compile_level=1) matched run_static_batches on the ORCA trace.
    Compare the outputs with run_static_batches before trusting a timing.
    """
    from transformers import GenerationConfig

    _check_cb_api(model)
    # The library sizes the KV cache from free memory, and a previous manager that failed can still
    # pin its cache (its error traceback forms a reference cycle): collect it first.
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    gen_config = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=_pad_id(model),
                                  max_new_tokens=max((r.max_tokens for r in trace), default=1))
    kwargs = {"generation_config": gen_config, "continuous_batching_config": _cb_config(cb_config)}
    if "workload_hints" in inspect.signature(model.init_continuous_batching).parameters:
        # The same sizing hints generate_batch gives (max requests per batch, blocks per request).
        from transformers.generation.continuous_batching.utils import WorkloadHints
        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max((len(r.prompt_token_ids) for r in trace), default=0),
            max_generated_length=gen_config.max_new_tokens, num_requests=len(trace))
    mgr = model.init_continuous_batching(**kwargs)
    try:
        mgr.warmup()
        mgr.start()
        if warmup > 0:
            _cb_run(mgr, _warmup_requests(trace, warmup, model.config.vocab_size), "warmup",
                    timeout_s)
        _sync(model)
        start = time.perf_counter()
        outputs = _cb_run(mgr, trace, "req", timeout_s)
        _sync(model)
        elapsed = time.perf_counter() - start
    finally:
        mgr.stop(block=True)  # also restores the model's original attention implementation
        mgr.destroy()  # as continuous_batching_context_manager does for a non-persistent manager
    return _result("hf-continuous-batching", trace, elapsed, outputs)
