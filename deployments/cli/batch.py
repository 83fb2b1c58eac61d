"""`orca-serve batch / results / status / cancel`: the batch API from the command line.

Submitting returns as soon as the server has queued a batch (it answers with an id before
any generation), so a long job never ties up the terminal. Following a batch reads its
results stream, where the server sends finished requests first and then each one as it
finishes; the CLI counts them on a progress bar and prints (or writes) a batch's results
together, in request order, the moment that batch is done, so output from several batches
never interleaves.
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from deployments.cli.batch_input import BatchInput
from deployments.cli.http import (DONE, CLIError, Server, aopen_events, check, event_json,
                                  json_body, printable, server_errors)

ROUTE = "/orca/v1/batches"


@dataclass(slots=True)
class Submitted:
    """A batch on the server; `prompts` (text or token ids) is known only for batches this
    process submitted."""
    id: str
    num_requests: int
    prompts: list[str | list[int]] | None = None


def submit(server: Server, batches: list[BatchInput], model: str | None,
           priority: int | None) -> list[Submitted]:
    """POST every batch; a failure names the batches already accepted, so none is orphaned."""
    done: list[Submitted] = []
    with server.client(30.0) as client:
        for batch in batches:
            body: dict = {"requests": batch.requests}
            if model is not None:
                body["model"] = model
            if priority is not None:
                body["priority"] = priority
            try:
                with server_errors(server.url):
                    resp = client.post(ROUTE, json=body)
                check(resp, f"the batch from {batch.source}")
                obj = json_body(resp, "a batch submission")
                if "id" not in obj:
                    raise CLIError(f"a batch submission was answered without an id: {obj}")
            except CLIError as e:
                if done:
                    e.args = (f"{e}\n(already submitted: {' '.join(b.id for b in done)})",)
                raise
            done.append(Submitted(obj["id"], int(obj.get("num_requests", len(batch.requests))),
                                  [r["prompt"] for r in batch.requests]))
    return done


def get_status(server: Server, batch_id: str, method: str = "GET") -> dict:
    """The batch's status object (DELETE cancels its unfinished requests first)."""
    with server.client(30.0) as client, server_errors(server.url):
        resp = client.request(method, f"{ROUTE}/{batch_id}")
    what = f"{'cancelling' if method == 'DELETE' else 'looking up'} {batch_id}"
    check(resp, what)
    return json_body(resp, what)


def status_line(obj: dict) -> str:
    done = obj.get("num_completed", 0) + obj.get("num_failed", 0)
    cancelled = obj.get("num_cancelled", 0)
    return (f"{obj.get('id')}  {obj.get('status')}  {done}/{obj.get('num_requests')} finished"
            f", {obj.get('num_failed', 0)} failed" + (f", {cancelled} cancelled"
                                                      if cancelled else ""))


class ResultSink:
    """Writes one finished batch at a time: readable text on stdout, or JSON Lines to a file."""

    def __init__(self, out_path: str | None):
        self.out_path = out_path
        self._file = open(out_path, "w", encoding="utf-8") if out_path else None
        self.num_failed = 0

    def close(self) -> None:
        if self._file:
            self._file.close()

    def write(self, batch: Submitted, status: str, results: dict[int, dict]) -> None:
        ordered = [results[i] for i in sorted(results)]
        failed = sum(1 for r in ordered if r.get("error"))
        self.num_failed += failed + max(batch.num_requests - len(ordered), 0)
        summary = (f"{batch.id}: {status}, {len(ordered) - failed} ok, {failed} failed"
                   + (f", {batch.num_requests - len(ordered)} without result"
                      if len(ordered) < batch.num_requests else ""))
        if self._file:
            for r in ordered:
                row = {"batch_id": batch.id, "index": r["index"]}
                if batch.prompts is not None and r["index"] < len(batch.prompts):
                    row["prompt"] = batch.prompts[r["index"]]
                row.update({k: r.get(k) for k in ("text", "finish_reason", "usage", "error")})
                self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self._file.flush()
            print(f"{summary} -> {self.out_path}", file=sys.stderr)
            return
        lines = [f"=== {summary} ==="]
        for r in ordered:
            head = f"--- [{r['index']}]"
            if batch.prompts is not None and r["index"] < len(batch.prompts):
                head += f" {_short(batch.prompts[r['index']])}"
            if r.get("error"):
                lines += [head, f"error: {_error_text(r['error'])}"]
            else:
                tokens = (r.get("usage") or {}).get("completion_tokens")
                lines += [f"{head} (finish: {r.get('finish_reason')}, {tokens} tokens)",
                          r.get("text") or ""]
        text = "\n".join(lines)
        print(printable(text) if sys.stdout.isatty() else text, flush=True)


def follow(server: Server, batches: list[Submitted], sink: ResultSink,
           show_progress: bool) -> None:
    """Follow every batch to its end (blocking); each is written by `sink` as it finishes."""
    bar = tqdm(total=sum(b.num_requests for b in batches), unit="req", file=sys.stderr,
               disable=not show_progress, desc=f"0/{len(batches)} batches", dynamic_ncols=True)
    try:
        asyncio.run(_follow_all(server, batches, sink, bar))
    except KeyboardInterrupt:
        bar.leave = False  # erase the bar rather than redraw it below the ^C
        raise
    finally:
        bar.close()


async def _follow_all(server: Server, batches: list[Submitted], sink: ResultSink,
                      bar) -> None:
    num_done = 0

    async def one(client: httpx.AsyncClient, batch: Submitted) -> None:
        nonlocal num_done
        results = await _read_results(client, batch, bar)
        resp = await client.get(f"{ROUTE}/{batch.id}")
        check(resp, f"looking up {batch.id}")
        num_done += 1
        bar.set_description(f"{num_done}/{len(batches)} batches")
        bar.clear()
        sink.write(batch, json_body(resp, f"looking up {batch.id}").get("status", "?"), results)
        bar.refresh()

    # No read timeout: a batch may legitimately take hours between two results.
    timeout = httpx.Timeout(30.0, read=None)
    async with server.async_client(timeout) as client:
        with server_errors(server.url):
            try:
                async with asyncio.TaskGroup() as group:
                    for batch in batches:
                        group.create_task(one(client, batch))
            except BaseExceptionGroup as eg:  # one batch failed and the others were cancelled:
                raise eg.exceptions[0] from None  # report the failure itself


async def _read_results(client: httpx.AsyncClient, batch: Submitted, bar) -> dict[int, dict]:
    results: dict[int, dict] = {}
    async with aopen_events(client, "GET", f"{ROUTE}/{batch.id}/results",
                            f"following {batch.id}") as events:
        async for sse in events.aiter_sse():
            if sse.data == DONE:
                return results
            event = event_json(sse)
            if "index" not in event:
                raise CLIError(f"{batch.id}: {_error_text(event.get('error', event))}")
            if event["index"] not in results:
                bar.update(1)
            results[event["index"]] = event
    raise CLIError(f"the results stream of {batch.id} ended early ({len(results)} of "
                   f"{batch.num_requests} results); resume with: orca-serve results {batch.id}")


def _short(prompt: str | list[int], width: int = 60) -> str:
    """A prompt on one line: text quoted as JSON, token ids as their list."""
    flat = " ".join(prompt.split()) if isinstance(prompt, str) else json.dumps(prompt)
    short = flat if len(flat) <= width else flat[:width - 1] + "…"
    return json.dumps(short, ensure_ascii=False) if isinstance(prompt, str) else short


def _error_text(err) -> str:
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)
