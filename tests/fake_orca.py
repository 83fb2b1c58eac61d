"""A stand-in for an orca-serve server: the batch API (/orca/v1/batches...) and streaming
chat, with timings set by the caller, for the CLI's tests and for trying the CLI by hand:

    python -m tests.fake_orca --port 8000 --delays 6,2,4    # batch k's requests take delays[k] s

Each batch request is answered with its prompt upper-cased (a token-id prompt: its ids
joined by spaces) once its delay has passed (later indices a little later); a prompt "FAIL"
fails; a chat answer is "t0 t1 ..." up to max_tokens, slowly when the last message contains
"slow", cut by an error event after its first token when it contains "break". With
`api_key`, every request needs `Authorization: Bearer <key>`, checked by the real server's
middleware (401 with an OpenAI error object otherwise).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from deployments.auth import APIKeyMiddleware

PROMPT_TOKENS = 3  # every prompt counts as this many tokens
MAX_MODEL_LEN = 2048


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": None}}, status_code=status)


class FakeOrca:
    """Batch API + chat streaming. `delays[batch number]` is the time its requests take."""

    def __init__(self, delays: list[float] | None = None, token_delay_s: float = 0.005,
                 api_key: str | None = None):
        self.delays = delays or [0.05]
        self.token_delay_s = token_delay_s
        self.bodies: list[dict] = []  # every POST body, in arrival order
        self.polled: list[str] = []  # the batches whose status or results were asked for
        self.batches: dict[str, dict] = {}
        self.chat_streams: list[dict] = []  # {"body", "completed"} per chat request
        self.app = Starlette(routes=[
            Route("/v1/models", self.models), Route("/orca/v1/batches", self.create,
                                                    methods=["POST"]),
            Route("/orca/v1/batches/{id}", self.status, methods=["GET", "DELETE"]),
            Route("/orca/v1/batches/{id}/results", self.results),
            Route("/v1/chat/completions", self.chat, methods=["POST"])])
        if api_key:
            self.app = APIKeyMiddleware(self.app, api_key)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

    async def create(self, request):
        body = await request.json()
        self.bodies.append(body)
        # a refusal the CLI cannot foresee (its schema check passes): the context length
        for i, r in enumerate(body.get("requests") or []):
            if PROMPT_TOKENS + r["max_tokens"] > MAX_MODEL_LEN:
                return _error(400, f"request {i}: prompt ({PROMPT_TOKENS} tokens) + max_tokens "
                                   f"({r['max_tokens']}) exceeds the context length "
                                   f"{MAX_MODEL_LEN}", f"requests.{i}.max_tokens")
        now = time.monotonic()
        delay = self.delays[min(len(self.batches), len(self.delays) - 1)]
        bid = f"batch-{uuid.uuid4().hex[:8]}"
        self.batches[bid] = {"reqs": body["requests"], "created": int(time.time()),
                             "finish_at": [now + delay * (1 + 0.1 * i)
                                           for i in range(len(body["requests"]))],
                             "cancelled": set()}
        return JSONResponse(self._status(bid))

    def _status(self, bid: str) -> dict:
        b, now = self.batches[bid], time.monotonic()
        done = [i for i, t in enumerate(b["finish_at"]) if t <= now or i in b["cancelled"]]
        failed = [i for i in done if b["reqs"][i]["prompt"] == "FAIL" or i in b["cancelled"]]
        n = len(b["reqs"])
        status = ("cancelled" if b["cancelled"] else "completed") if len(done) == n \
            else "in_progress"
        return {"id": bid, "object": "orca.batch", "status": status, "num_requests": n,
                "num_completed": len(done) - len(failed), "num_failed": len(failed),
                "created": b["created"]}

    async def status(self, request):
        bid = request.path_params["id"]
        self.polled.append(bid)
        if bid not in self.batches:
            return _error(404, f"no batch {bid}", "id")
        if request.method == "DELETE":
            b = self.batches[bid]
            b["cancelled"] = {i for i, t in enumerate(b["finish_at"]) if t > time.monotonic()}
        return JSONResponse(self._status(bid))

    async def results(self, request):
        bid = request.path_params["id"]
        self.polled.append(bid)
        if bid not in self.batches:
            return _error(404, f"no batch {bid}", "id")
        b = self.batches[bid]

        async def events():
            yield ": ping\n\n"  # a keep-alive comment, as sse-starlette sends them
            sent = set()
            while len(sent) < len(b["reqs"]):
                now = time.monotonic()
                ready = sorted((t, i) for i, t in enumerate(b["finish_at"])
                               if i not in sent and (t <= now or i in b["cancelled"]))
                for _, i in ready:
                    sent.add(i)
                    yield f"data: {json.dumps(self._result(bid, i))}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    def _result(self, bid: str, i: int) -> dict:
        req = self.batches[bid]["reqs"][i]
        error = None
        if i in self.batches[bid]["cancelled"]:
            error = {"message": "cancelled", "type": "cancelled", "param": None, "code": None}
        elif req["prompt"] == "FAIL":
            error = {"message": "engine failed", "type": "server_error", "param": None,
                     "code": None}
        n = req["max_tokens"]
        prompt = req["prompt"]
        text = prompt.upper() if isinstance(prompt, str) else " ".join(map(str, prompt))
        return {"batch_id": bid, "index": i, "text": None if error else text,
                "finish_reason": None if error else "length", "error": error,
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                          "total_tokens": PROMPT_TOKENS + n}}

    async def chat(self, request):
        body = await request.json()
        record = {"body": body, "completed": False}
        self.chat_streams.append(record)
        last = body["messages"][-1]["content"]
        slow, fail = "slow" in last, "break" in last

        # Framed with CRLF, sse-starlette's default (the real server uses LF, like the batch
        # results here): a client must read both.
        async def events():
            for i in range(body["max_tokens"]):
                # slow: 5 s between tokens, room for a Ctrl-C on a loaded machine
                await asyncio.sleep((5.0 if i else 0.2) if slow else self.token_delay_s)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(chunk)}\r\n\r\n"
                if fail:  # an error event, as the server sends when a request fails mid-way
                    error = {"message": "engine failed", "type": "server_error",
                             "param": None, "code": None}
                    yield f"data: {json.dumps({'error': error})}\r\n\r\n"
                    return
            record["completed"] = True
            yield "data: [DONE]\r\n\r\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def main() -> None:
    import uvicorn
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--delays", default="2", help="seconds per batch, comma-separated")
    p.add_argument("--api-key", help="require this key on every request")
    args = p.parse_args()
    server = FakeOrca([float(x) for x in args.delays.split(",")], api_key=args.api_key)
    uvicorn.run(server.app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
