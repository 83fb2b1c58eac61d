"""The OpenAI routes: POST /v1/completions and POST /v1/chat/completions (and, through
`submit`, `collect` and `stream_response`, the Responses API of responses_api.py).

A request is validated and tokenized (`Frontend`), its choices are submitted to the
scheduler actor in one call, and their token streams are turned back into text
(incrementally, stop strings included) as one JSON body or as server-sent events.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.beam_search import BeamSearch, check as check_beam_search
from deployments.chat_protocol import ChatCompletionRequest
from deployments.choice import new_choice
from deployments.completion_protocol import CompletionRequest
from deployments.engine_client import EngineUnavailable, RequestRefused
from deployments.frontend import Frontend, bad_word_ids, refusal_error, unavailable
from deployments.http_metrics import RequestTimer
from deployments.logprobs import resolve_logprobs
from deployments.protocol import APIError
from deployments.reasoning import output_parser, think_token_ids, thinking_budget
from deployments.responses import (SSEResponse, SSEWriter, StreamWriter, deadline_error,
                                   response_body, timeout_error)
from deployments.structured import grammar_for, tool_grammar
from engine_actors.checkpoint import ModelInfo
from engine_actors.messages import EngineRequest


class OpenAIRoutes:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.metrics = frontend.metrics
        self.fingerprint = f"fp_{frontend.cfg.fingerprint()}"  # (OpenAI's: the engine's args)

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    async def completions(self, request: Request):
        arrival = time.monotonic()
        try:
            req = await self.frontend.parse(request, CompletionRequest)
            info = await self.frontend.ready()
            prompts = req.prompt
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            if not prompts:
                raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
            self.frontend.refuse_over_queue(len(prompts) * req.n,
                                            f"{len(prompts)} prompts with n={req.n}", "prompt")
            ids = await self.frontend.prompt_ids(prompts, info, ["prompt"] * len(prompts),
                                                 req.add_special_tokens)
            prompts = [(p if isinstance(p, str) else None, i) for p, i in zip(prompts, ids)]
            # echo only: one token is computed with the prompt's logprobs and dropped (vLLM's)
            return await self._generate(req, prompts, 1 if req.echo_only else req.max_tokens,
                                        info, False, arrival, grammar_for(req))
        except APIError as e:
            return e.response()

    async def chat_completions(self, request: Request):
        arrival = time.monotonic()
        try:
            req = await self.frontend.parse(request, ChatCompletionRequest)
            info = await self.frontend.ready()
            ids, grammar, parser = await self.chat_prompt(req, info)
            return await self._generate(req, [(None, ids)], req.max_new_tokens(), info,
                                        True, arrival, grammar, parser)
        except APIError as e:
            return e.response()

    async def chat_prompt(self, req: ChatCompletionRequest, info: ModelInfo
                          ) -> tuple[list[int], tuple[str, str] | None, str | None]:
        """A chat request's prompt token ids, the grammar its output must follow (its
        response_format, or a forced tool call), and the tool-call parser (with tools)."""
        if req.uses_tools and not req.forces_tool_calls and \
                not self.frontend.cfg.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice requires enable_auto_tool_choice, which '
                                "this server has off: give tool_choice none, required or a "
                                "function", "tool_choice", "invalid_value")
        tools = req.rendered_tools(self.frontend.cfg.exclude_tools_when_tool_choice_none)
        ids = await self.frontend.chat_ids(req.messages, tools,
                                           req.add_generation_prompt, req.add_special_tokens,
                                           template_kwargs=req.template_variables(),
                                           continue_final_message=req.continue_final_message,
                                           documents=req.documents, template=self.frontend
                                           .request_template(req.chat_template))
        reasoning = output_parser(req, self.frontend.cfg.reasoning_parser)
        think_ids = think_token_ids(self.frontend.tokenizer) if reasoning else (None, None)
        grammar = grammar_for(req, reasoning, think_ids)
        parser = self.frontend.tool_parser(info) if req.uses_tools else None
        forced = tool_grammar(req.tools, req.tool_choice, parser, req.max_tool_calls() != 1,
                              reasoning, think_ids) if parser and req.forces_tool_calls else None
        if grammar is not None and forced is not None:
            raise APIError(400, "a tool_choice that forces a call cannot be combined with "
                                "response_format or guided_*", "tool_choice", "invalid_value")
        return list(ids), grammar or forced, parser

    async def _generate(self, req, prompts, max_tokens, info: ModelInfo, chat: bool,
                        arrival: float, grammar: tuple[str, str] | None = None,
                        tool_parser: str | None = None):
        prefix, unique = "chatcmpl-" if chat else "cmpl-", uuid.uuid4().hex
        base_id = prefix + unique  # (its engine requests' ids: never shared)
        group, choices, timeout = await self.submit(base_id, req, prompts, max_tokens, info,
                                                    chat, arrival, grammar, tool_parser)
        model = self.frontend.reported_model(req)
        answer_id = prefix + (req.request_id or unique)
        if req.stream:
            return self.stream_response(group, choices, SSEWriter(answer_id, model, chat, req),
                                        req, timeout)
        await self.collect(group, choices, req, timeout)
        body = response_body(answer_id, model, chat, choices, req.return_token_ids)
        return JSONResponse({**body, "system_fingerprint": self.fingerprint})

    async def submit(self, base_id: str, req, prompts, max_tokens, info: ModelInfo,
                     chat: bool, arrival: float, grammar: tuple[str, str] | None = None,
                     tool_parser: str | None = None):
        """Submit the request's choices to the engine: (their RequestGroup, their Choice
        by engine request id, the time limit in s or None)."""
        limit = info.max_model_len
        resolve_logprobs(req, self.frontend.cfg.max_logprobs, info.vocab_size)
        if beams := getattr(req, "use_beam_search", False):
            check_beam_search(req, grammar)
        bad_words = await bad_word_ids(self.frontend, req.bad_words, info.vocab_size) \
            if req.bad_words else None
        priority = req.priority or 0  # interactive by default
        thinking = thinking_budget(req, self.frontend.cfg.reasoning_parser,
                                   self.frontend.tokenizer)
        subs = []  # (engine request, choice index, prompt text, prompt ids)
        searches = []  # with use_beam_search: (choice id prefix, prompt ids, max_tokens)
        for p_idx, (text, ids) in enumerate(prompts):
            kept = req.truncate(ids, limit)
            if len(kept) < len(ids):
                ids, text = kept, None  # echo shows the kept tokens
            if len(ids) >= limit:
                raise PromptTooLong(len(ids), limit, "messages" if chat else "prompt")
            # unset max_tokens: the checkpoint's default, or the rest of the context; one
            # past the context is cut to its rest (vLLM's: Claude Code asks for 32,000)
            rest = limit - len(ids)
            n_new = min(max_tokens or info.sampling_defaults.get("max_tokens", rest), rest)
            if beams:
                searches.append((f"{base_id}-{p_idx}", ids, n_new))
            for j in range(req.n):
                sampling = req.sampling_params(n_new, j, info.sampling_defaults, info.vocab_size,
                                               # (one cut to the context's rest is a
                                               # cap, not an estimate: no KV reservation)
                                               max_tokens_given=max_tokens is not None
                                               and max_tokens <= rest,
                                               grammar=grammar, bad_words=bad_words,
                                               thinking_budget=thinking,
                                               **req.logprob_fields())
                engine_req = EngineRequest(f"{base_id}-{p_idx}-{j}", ids, sampling, priority,
                                           req.deadline_ms, self.frontend.adapter(req),
                                           cache_salt=req.cache_salt or "")
                subs.append((engine_req, p_idx * req.n + j, text, ids))
        # before submitting: nothing between the submission and the caller's close may fail
        choices = {r.request_id: new_choice(
            self.frontend, req, index, text, ids, r, chat, RequestTimer(self.metrics, arrival),
            tool_parser, info.eos_token_ids) for r, index, text, ids in subs}
        self.frontend.refuse_if_draining()
        try:
            if beams:  # the engine runs the searches' steps, not the choices
                group = BeamSearch(self.frontend.client, searches, req.n, info.eos_token_ids,
                                   req.ignore_eos, req.include_stop_str_in_output,
                                   req.length_penalty, priority, self.frontend.adapter(req),
                                   req.logprob_fields()["logprobs"], req.cache_salt)
                await group.start()
            else:  # a non-streamed response without stop strings needs only each end
                group = await self.frontend.client.submit(
                    [s[0] for s in subs], wake_each_update=bool(req.stream or req.stop_list()))
        except RequestRefused as e:
            self.metrics.failure(e.code)
            adapter = e.code in ("invalid_adapter", "lora_disabled")  # (a dynamic load's)
            raise refusal_error(e.code, str(e), "model" if adapter else "max_tokens") from None
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            raise unavailable(str(e)) from None
        limits = [t for t in (req.timeout_s, self.frontend.cfg.request_timeout_s) if t is not None]
        timeout = min(limits) if limits else None  # a request may only shorten the limit
        return group, choices, timeout

    def stream_response(self, group, choices, writer, req, timeout: float | None):
        """The submitted request as server-sent events that `writer` (SSEWriter, or
        response_output.ResponseEvents) formats; its requests end however the response does."""
        return SSEResponse(self.stream_events(group, choices, writer, req, timeout),
                           on_close=group.close)

    async def collect(self, group, choices, req, timeout: float | None) -> None:
        """Wait for every choice to finish (non-streamed); APIError when one failed, the
        time ran out, or every choice missed its deadline."""
        try:
            async for rid, update in within(group, timeout):
                choice = choices[rid]
                choice.consume(update, group.arrivals.pop(rid, None))
                if choice.text_stream.is_stopped:
                    group.finish(rid)
        except TimeoutError:
            self.metrics.failure("timeout")
            raise timeout_error(timeout) from None
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            raise unavailable(f"request failed: {e}") from None
        except asyncio.CancelledError:
            self.metrics.failure("client_disconnect")
            raise
        finally:
            group.close()
        failed = next((c.error for c in choices.values() if c.error), None)
        if failed:
            self.metrics.failure("engine_failure")
            raise unavailable(f"request failed: {failed}")
        if all(c.finish_reason == "deadline" for c in choices.values()):
            raise deadline_error(req.deadline_ms)

    async def stream_events(self, group, choices, sse: StreamWriter, req,
                            timeout: float | None):
        try:
            for event in sse.start(choices):
                yield event
            # the time limit applies to waiting for the engine, not to writing to the client
            async for rid, update in within(group, timeout):
                choice = choices[rid]
                delta = choice.consume(update)
                if choice.text_stream.is_stopped:
                    group.finish(rid)
                if choice.error:
                    self.metrics.failure("engine_failure")
                    yield sse.error(choice.error)
                    continue
                for event in sse.update(choice, delta):
                    yield event
                if choice.finish_reason == "deadline":
                    yield sse.error_event(deadline_error(req.deadline_ms))
            for event in await sse.finish(choices):
                yield event
        except TimeoutError:
            self.metrics.failure("timeout")
            yield sse.error_event(timeout_error(timeout))
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            yield sse.error(f"request failed: {e}")
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.failure("client_disconnect")
            raise
        finally:
            group.close()
        for event in sse.done():
            yield event


class PromptTooLong(APIError):
    def __init__(self, num_tokens: int, limit: int, param: str):
        super().__init__(400, f"This model's maximum context length is {limit} tokens. "
                              f"However, your prompt has {num_tokens} tokens.", param,
                         "context_length_exceeded")
        self.num_tokens, self.limit = num_tokens, limit


async def within(group, timeout_s: float | None):
    """The group's items; TimeoutError once timeout_s have passed while waiting for them.
    Time the caller spends between items (writing to a slow client) does not count."""
    if timeout_s is None:
        async for item in group:
            yield item
        return
    clock = asyncio.get_running_loop().time
    left = timeout_s
    while True:
        if left <= 0:
            raise TimeoutError
        started = clock()
        try:
            item = await asyncio.wait_for(group.__anext__(), left)
        except StopAsyncIteration:
            return
        left -= clock() - started
        yield item
