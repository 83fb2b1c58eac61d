"""The transformers baselines behind a tiny OpenAI-style HTTP server, so the load client
measures them exactly as it measures orca-serve.

    python -m load_tests.hf_server --model llama-8b --device cuda --mode cb --port 8100
    python -m load_tests.hf_server --model llama-8b --device cuda --mode static --max-batch-size 32

Only the subset the load client uses: POST /v1/completions with one prompt (token ids, or
text), max_tokens, ignore_eos, stream (+ stream_options.include_usage), greedy only;
GET /v1/models and /health. Weights are the engine's (`bench_offline.load_hf_model`).
Bodies are validated with orca-serve's own schema (`deployments.protocol.CompletionRequest`),
so a request the engine would refuse is refused here too, with the same error object.

Modes (a small interface, two implementations):
  static  request-level scheduling, the FasterTransformer-style baseline of ORCA's paper:
          whatever is queued when the model is free (FCFS, up to --max-batch-size) becomes
          one batch, run with model.generate until its longest request is done; each request
          gets all its tokens when its batch ends, so its TTFT equals its end-to-end latency.
          The batch runs with EOS disabled; a request without ignore_eos is cut at its first
          EOS afterwards (its batch still ran to the longest max_tokens).
  cb      transformers' continuous batching (init_continuous_batching), requests added as
          they arrive and streamed token by token; --cb-config takes ContinuousBatchingConfig
          keys as JSON (e.g. '{"use_cuda_graph": true, "max_batch_tokens": 16384}').
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.completion_protocol import CompletionRequest
from deployments.protocol import APIError
from deployments.request_body import parse_body
from engine_actors.detokenizer import TextStream
from load_tests.hf_backends import Backend, ContinuousBackend, GenRequest, StaticBackend


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


def parse_request(raw: bytes, tokenizer, vocab_size: int,
                  max_model_len: int) -> tuple[GenRequest, bool, bool]:
    """(request, stream, include_usage) from the bytes of a /v1/completions body, or an
    APIError(400) naming the param."""
    req = parse_body(raw, CompletionRequest)
    # The schema also takes lists of prompts; the baselines serve one prompt per request.
    prompt = req.prompt
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    elif all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        ids = []
    if not ids:
        raise _bad("prompt must be a non-empty string or list of token ids (one prompt per "
                   "request here)", "prompt")
    if any(not 0 <= t < vocab_size for t in ids):
        raise _bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    # no max_tokens (null): up to the context length, as orca-serve does
    max_tokens = req.max_tokens or max(max_model_len - len(ids), 1)
    if len(ids) + max_tokens > max_model_len:
        raise _bad(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) is over the model's "
                   f"{max_model_len} tokens", "max_tokens")
    # the baselines decode greedily: a request that sets a non-zero temperature is refused
    if req.temperature not in (None, 0):
        raise _bad("the transformers baselines are greedy: temperature must be 0",
                   "temperature")
    if req.n != 1:
        raise _bad("n must be 1", "n")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return GenRequest(ids, max_tokens, req.ignore_eos), req.stream, include_usage


def build_app(backend: Backend, tokenizer, model_name: str, vocab_size: int,
              max_model_len: int) -> Starlette:
    async def completions(request: Request):
        try:
            req, stream, include_usage = parse_request(await request.body(), tokenizer,
                                                       vocab_size, max_model_len)
        except APIError as e:
            return e.response()
        await backend.submit(req)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model_name}
        if stream:
            return EventSourceResponse(_sse(backend, req, tokenizer, base, include_usage),
                                       sep="\n")
        text, finish, error = [], None, None
        async for delta, finish, error in _deltas(backend, req, tokenizer):
            text.append(delta)
        if error:
            return APIError(500, error).response()
        return JSONResponse({**base, "choices": [{"index": 0, "text": "".join(text),
                                                  "logprobs": None, "finish_reason": finish}],
                             "usage": _usage(req)})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "transformers",
             "max_model_len": max_model_len}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "mode": backend.name})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)],
                     lifespan=lifespan)


async def _deltas(backend: Backend, req: GenRequest, tokenizer):
    """(text delta, finish_reason or None, error or None) as the backend produces tokens;
    the request is cancelled if the consumer stops early (client gone)."""
    text = TextStream(tokenizer)
    try:
        while True:
            update = await req.updates.get()
            if update.error:
                yield "", None, update.error
                return
            req.num_output_tokens += len(update.token_ids)
            is_final = update.finish_reason is not None
            delta = text.add(update.token_ids, is_final)
            if delta or is_final:
                yield delta, update.finish_reason, None
            if is_final:
                return
    finally:
        if not req.is_finished:
            backend.cancel(req)


async def _sse(backend: Backend, req: GenRequest, tokenizer, base: dict, include_usage: bool):
    """The events' data (sse-starlette frames them)."""
    async for delta, finish, error in _deltas(backend, req, tokenizer):
        if error:
            body = APIError(500, error).body()
        else:
            body = {**base, "choices": [{"index": 0, "text": delta, "logprobs": None,
                                         "finish_reason": finish}]}
        yield json.dumps(body, ensure_ascii=False)
    if include_usage:
        yield json.dumps({**base, "choices": [], "usage": _usage(req)})
    yield "[DONE]"


def _usage(req: GenRequest) -> dict:
    n_prompt = len(req.prompt_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": req.num_output_tokens,
            "total_tokens": n_prompt + req.num_output_tokens}


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import resolve_model_path
    from load_tests.bench_offline import load_hf_model

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random-llama")
    p.add_argument("--served-model-name", help="name in /v1/models (default: --model)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--mode", required=True, choices=["static", "cb"])
    p.add_argument("--max-batch-size", type=int, default=32, help="static: requests per batch")
    p.add_argument("--cb-config", type=json.loads,
                   help="cb: ContinuousBatchingConfig keys as JSON. The defaults size the KV "
                        "cache from free memory (~15 GB of RAM on CPU); on CPU pass e.g. "
                        "'{\"num_blocks\": 64, \"max_batch_tokens\": 256}'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    args = p.parse_args(argv)

    model = load_hf_model(args.model, args.device)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    backend = (StaticBackend(model, args.max_batch_size) if args.mode == "static"
               else ContinuousBackend(model, args.cb_config))
    app = build_app(backend, tokenizer, args.served_model_name or args.model,
                    model.config.vocab_size, model.config.max_position_embeddings)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
