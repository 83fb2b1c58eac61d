"""End to end over real HTTP: serve_config.yaml's application, the openai client, SSE."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine's image

from engine_actors.checkpoint import resolve_model_path
from engine_actors.config import DEFAULT_MODEL
from tests.engine_harness import hf_greedy
from tests.serve_fixture import wait_healthy, wait_idle

MODEL = "tiny-random-llama"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))


def stats(url):
    return httpx.get(f"{url}/health", timeout=5).json()


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_transformers_greedy(client, tokenizer):
    """Concurrent token-id prompts; each text equals the decoded transformers tokens."""
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(5)]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=p, max_tokens=4 + 3 * i,
                                       temperature=0, extra_body=NO_EOS)
            for i, p in enumerate(prompts)])

    results = asyncio.run(run())
    path = resolve_model_path(DEFAULT_MODEL)
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref = hf_greedy(path, p, 4 + 3 * i)
        assert res.choices[0].text == tokenizer.decode(ref)
        assert res.choices[0].finish_reason == "length"
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(p), 4 + 3 * i)


def test_streaming_completion_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0,
                  extra_body=NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    raw = client.completions.with_raw_response.create(stream=True, **kwargs)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["cache-control"] == "no-cache"
    chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 5  # tokens arrive as they are produced, not in one piece


def test_chat_non_streaming_and_streaming(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                         temperature=0, extra_body=NO_EOS)
    assert res.choices[0].message.role == "assistant"
    assert res.usage.completion_tokens == 12 and res.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0, stream=True, extra_body=NO_EOS,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == res.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12


def test_sampling_seed_n_and_batched_prompts(client):
    kwargs = dict(model=MODEL, max_tokens=16, temperature=1.0, top_p=0.9, seed=11,
                  extra_body=NO_EOS)
    a = client.completions.create(prompt=["one", "two"], n=2, **kwargs)
    b = client.completions.create(prompt=["one", "two"], n=2, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # n choices differ
    assert a.usage.completion_tokens == 64 and a.usage.prompt_tokens == 6


def test_stop_string_ends_the_request(client, url):
    kwargs = dict(model=MODEL, prompt="Stop strings", temperature=0, extra_body=NO_EOS)
    full = client.completions.create(max_tokens=30, **kwargs).choices[0].text
    stop = full[10:13]
    assert stop and stop not in full[:10]
    for stream in (False, True):
        res = client.completions.create(max_tokens=30, stop=[stop], stream=stream, **kwargs)
        chunks = list(res) if stream else [res]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(url)


def test_unicode_round_trips(client, tokenizer):
    text = 'Grüße 👋🏽 "quotes" \\ back\nslash\ttab 中文 \x07bell é'
    ids = tokenizer.encode(text, add_special_tokens=False)
    res = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=1,
                                    temperature=0)
    assert res.choices[0].text.startswith(text)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=1,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks).startswith(text)
    res = client.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=1)
    assert res.choices[0].text.startswith(text)
    assert res.usage.prompt_tokens == len(text.encode())  # byte-level tokenizer


def test_second_stream_joins_while_first_runs(url):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            events = {}

            async def stream(name, max_tokens, started=None):
                body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens,
                        "stream": True, "ignore_eos": True, "temperature": 0}
                n = 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            n += 1
                            if n == 1:
                                events[name + ":first"] = time.monotonic()
                                if started:
                                    started.set()
                events[name + ":end"] = time.monotonic()

            first_started = asyncio.Event()
            long = asyncio.create_task(stream("long", 600, first_started))
            await first_started.wait()
            await stream("short", 5)
            await long
            return events

    e = asyncio.run(run())
    assert e["long:first"] < e["short:first"] < e["short:end"] < e["long:end"]


def test_many_concurrent_clients(url):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            bodies = [{"model": MODEL, "prompt": f"client {i}", "max_tokens": 8 + i % 5,
                       "ignore_eos": True} for i in range(40)]
            return await asyncio.gather(*[http.post("/v1/completions", json=b) for b in bodies])

    for i, r in enumerate(asyncio.run(run())):
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 8 + i % 5


def test_max_tokens_past_the_context_is_cut_to_its_rest(url):
    """As vLLM (Claude Code asks for 32,000): the output ends with "length" at the end of
    the context of 4096 tokens."""
    for path, body in [("/v1/completions", {"prompt": "x" * 4090}),
                       ("/v1/chat/completions", {"messages": [
                           {"role": "user", "content": "x" * 4060}],
                           "max_completion_tokens": 10**6})]:
        r = httpx.post(url + path, timeout=120,
                       json={"model": MODEL, "max_tokens": 10**6, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 4096
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert 0 < usage["completion_tokens"] < 40, usage


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', "invalid_json", None),
    ("/v1/completions", b'["not", "an", "object"]', "invalid_type", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', "invalid_encoding", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1e12}, None, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, None, "n"),
    ("/v1/completions", {"prompt": ""}, None, "prompt"),
    ("/v1/completions", {"prompt": []}, None, "prompt"),
    ("/v1/completions", {"prompt": 5}, None, "prompt"),
    ("/v1/completions", {}, None, "prompt"),
    ("/v1/completions", {"prompt": "x" * 5000}, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model_not_found", "model"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, None, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, "stream"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, None, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 10**40}, None, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, None, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 513}, None, "stop"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, "invalid_json", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, None, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, None, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, None, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, None, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, None, "logit_bias.5"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, None, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, None,
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "unsupported_parameter", "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, None, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, None, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "unsupported_content", "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": []}, None, "messages"),
    ("/v1/completions", {"prompt": [[1, 2]] * 300, "n": 16}, "batch_too_large", "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None,
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hello"}, None, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "missing_required_parameter",
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None},
                                           {"role": "user", "content": "x"}]},
     "missing_required_parameter", "messages.0.content"),
]


@pytest.mark.parametrize("path,body,code,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(url, path, body, code, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, headers={"content-type": "application/json"}, timeout=30,
                   **kwargs)
    assert r.status_code == (404 if code == "model_not_found" else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nowhere", 404),
                                                ("GET", "/v1/completions", 405)])
def test_unknown_routes_get_openai_errors(url, method, path, status):
    r = httpx.request(method, url + path, timeout=30)
    assert r.status_code == status and r.json()["error"]["message"]


def test_vllm_ping_and_version(url):
    assert httpx.get(f"{url}/ping", timeout=30).json()["status"] == "ok"
    assert httpx.get(f"{url}/version", timeout=30).json() == {"version": "0.1.0"}


def test_body_over_limit_is_413(url):
    r = httpx.post(url + "/v1/completions", content=b"x" * (5 * 1024 * 1024),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_server_keeps_serving_after_bad_requests(client):
    res = client.completions.create(model=MODEL, prompt="still here", max_tokens=3,
                                    extra_body=NO_EOS)
    assert res.usage.completion_tokens == 3


def test_disconnect_mid_stream_frees_kv(url):
    before = wait_idle(url)
    body = {"model": MODEL, "prompt": "disconnect me", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        busy = stats(url)
        assert busy["num_requests"] == 1 and busy["num_free_blocks"] < busy["num_blocks"]
    after = wait_idle(url, timeout=30)
    # aborted: it stopped far short of its 4000 tokens (one step per token when alone)
    assert after["num_steps"] - before["num_steps"] < 3000, (before, after)
    assert wait_healthy(url)["status"] == "ok"


def test_missed_deadline_is_408_or_a_deadline_event(url):
    body = {"model": MODEL, "prompt": "late", "max_tokens": 4, "deadline_ms": 0.001}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded"
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-2]["choices"][0]["finish_reason"] == "deadline"
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    ok = httpx.post(f"{url}/v1/completions", timeout=30,
                    json={**body, "deadline_ms": 60_000, "priority": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_batch_submit_status_results(url):
    body = {"requests": [{"prompt": "one", "max_tokens": 5, "ignore_eos": True},
                         {"prompt": [65, 66, 67], "max_tokens": 7, "ignore_eos": True},
                         {"prompt": "three", "max_tokens": 3, "ignore_eos": True}]}
    r = httpx.post(f"{url}/orca/v1/batches", json=body, timeout=30)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["object"] == "orca.batch" and batch["num_requests"] == 3
    with httpx.stream("GET", f"{url}/orca/v1/batches/{batch['id']}/results", timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    results = sorted((json.loads(line[6:]) for line in lines[:-1]), key=lambda x: x["index"])
    assert [x["usage"]["completion_tokens"] for x in results] == [5, 7, 3]
    assert all(x["finish_reason"] == "length" and x["error"] is None for x in results)
    status = httpx.get(f"{url}/orca/v1/batches/{batch['id']}", timeout=30).json()
    assert (status["status"], status["num_completed"]) == ("completed", 3)


def test_batch_cancel_and_errors(url):
    body = {"requests": [{"prompt": "long", "max_tokens": 3000, "ignore_eos": True}] * 2}
    batch = httpx.post(f"{url}/orca/v1/batches", json=body, timeout=30).json()
    cancelled = httpx.delete(f"{url}/orca/v1/batches/{batch['id']}", timeout=30).json()
    assert cancelled["status"] == "cancelled"
    with httpx.stream("GET", f"{url}/orca/v1/batches/{batch['id']}/results", timeout=60) as r:
        results = [json.loads(line[6:]) for line in r.iter_lines()
                   if line.startswith("data: {")]
    assert len(results) == 2 and all(x["finish_reason"] == "abort" for x in results)
    missing = httpx.get(f"{url}/orca/v1/batches/batch-nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "batch_not_found"
    bad = httpx.post(f"{url}/orca/v1/batches", timeout=30,
                     json={"requests": [{"prompt": "x", "max_tokens": 0}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "requests.0.max_tokens"
    too_long = httpx.post(f"{url}/orca/v1/batches", timeout=30,
                          json={"requests": [{"prompt": "x", "max_tokens": 10**6}]})
    assert too_long.status_code == 400
    wait_idle(url)


def test_engine_counts_every_finished_request(url, client):
    """orca:request_finished_total counts batch requests, aborted requests, requests whose
    client left, and stop-string stops as stops (as the replica's success counter does)."""
    def finished():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        counts = {}
        for line in text.splitlines():
            for name in ("orca:request_finished_total", "orca:request_success_total"):
                if line.startswith(name + "{"):
                    reason = line.split('finished_reason="')[1].split('"')[0]
                    counts[(name, reason)] = float(line.split()[-1])
        return counts

    before = finished()
    kwargs = dict(model=MODEL, prompt="Stop strings", temperature=0, extra_body=NO_EOS)
    full = client.completions.create(max_tokens=30, **kwargs).choices[0].text
    client.completions.create(max_tokens=30, stop=[full[10:13]], **kwargs)  # a stop
    # two batch requests run to their length; one stops at its stop string in the engine
    stopped = {"prompt": "Stop strings", "max_tokens": 30, "temperature": 0,
               "stop": [full[10:13]], **NO_EOS}
    batch = {"requests": [{"prompt": "one", "max_tokens": 3, "ignore_eos": True}] * 2
             + [stopped]}
    batch_id = httpx.post(f"{url}/orca/v1/batches", json=batch, timeout=30).json()["id"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": "gone", "max_tokens": 3000, "stream": True,
                            **NO_EOS}) as r:
        next(r.iter_lines())  # then the client leaves mid-stream
    with httpx.stream("GET", f"{url}/orca/v1/batches/{batch_id}/results", timeout=30) as r:
        list(r.iter_lines())
    wait_idle(url)
    after = finished()

    def delta(name, reason):
        key = (f"orca:request_{name}_total", reason)
        return after.get(key, 0) - before.get(key, 0)

    assert delta("finished", "length") == 3  # one plain completion, two batch requests
    assert delta("success", "stop") == 1  # the replica counts its own requests only
    assert delta("finished", "stop") == 2
    assert delta("finished", "abort") == 1  # the client that left


def test_leaving_a_batch_results_stream_is_not_an_error(url):
    """A client that stops following a batch is normal: no traceback in the replica log."""
    import glob
    import os
    import socket

    import ray
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")

    def replica_logs() -> list[str]:  # Serve's replica logs, and processes' stdout and stderr
        return glob.glob(f"{logs}/serve/replica_*") + glob.glob(f"{logs}/worker-*")
    # the Ray session's logs hold earlier modules' too (tests/serve_fixture.py): only what
    # is written from here on counts
    sizes = {path: os.path.getsize(path) for path in replica_logs()}
    body = {"requests": [{"prompt": "long", "max_tokens": 3000, "ignore_eos": True}]}
    batch_id = httpx.post(f"{url}/orca/v1/batches", json=body, timeout=30).json()["id"]
    for _ in range(4):  # leaves while results arrive
        many = {"requests": [{"prompt": "x", "max_tokens": 8 + k % 32, "ignore_eos": True}
                             for k in range(64)]}
        many_id = httpx.post(f"{url}/orca/v1/batches", json=many, timeout=30).json()["id"]
        with httpx.stream("GET", f"{url}/orca/v1/batches/{many_id}/results", timeout=30) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
    host, port = url.removeprefix("http://").split(":")
    for i in range(12):
        if i % 2:  # leaves while the replica waits for a result
            with httpx.stream("GET", f"{url}/orca/v1/batches/{batch_id}/results", timeout=30):
                time.sleep(0.3)
            continue
        with socket.create_connection((host, int(port))) as sock:  # leaves at once
            sock.sendall(f"GET /orca/v1/batches/{batch_id}/results HTTP/1.1\r\n"
                         f"Host: {host}\r\n\r\n".encode())
        time.sleep(0.2)
    time.sleep(1.0)
    httpx.delete(f"{url}/orca/v1/batches/{batch_id}", timeout=30)
    wait_idle(url)
    written = ""
    for path in replica_logs():
        with open(path, errors="replace") as f:
            f.seek(sizes.get(path, 0))
            written += f.read()
    assert "TaskCancelledError" not in written
    assert "unhandled error" not in written
