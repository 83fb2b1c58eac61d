"""The OpenAI fields tools send, over HTTP with the official client: logprobs (echo
included), penalties and logit_bias, nulls, GET /v1/models/{id}, /tokenize and /detokenize."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from engine_actors.request import SamplingParams  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_logits import hf_logprobs, reference  # noqa: E402

MODEL = "tiny-random-llama"
NO_EOS = {"ignore_eos": True}


def test_completion_logprobs_with_echo_equal_transformers(client):
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=3, echo=True, extra_body=NO_EOS)
    choice = res.choices[0]
    lps = choice.logprobs
    generated = res.usage.completion_tokens
    assert len(lps.tokens) == len(lps.token_logprobs) == len(prompt) + generated
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    # the generated ids, to recompute: greedy is reproducible
    ids = reference(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ref = hf_logprobs(prompt + ids)
    full = prompt + ids
    for t in range(1, len(full)):
        assert abs(lps.token_logprobs[t] - ref[t - 1, full[t]].item()) < 1e-4, t
        top = ref[t - 1].topk(3).values.tolist()
        assert max(lps.top_logprobs[t].values()) == pytest.approx(top[0], abs=1e-4)
        # the 3 likeliest, and the chosen token itself (a prompt token may be neither)
        own = ref[t - 1, full[t]].item()
        assert all(any(abs(v - w) < 1e-4 for w in top + [own])
                   for v in lps.top_logprobs[t].values())
        assert lps.top_logprobs[t].get(lps.tokens[t]) is not None
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[0] == 0
    assert choice.text.startswith(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, temperature=0).choices[0].text[:5])


def e2e_count(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "orca:e2e_request_latency_seconds_count")


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, url):
    """OpenAI's legacy scoring call (lm-eval's loglikelihood over completions sends it): echo
    with max_tokens 0 returns the prompt's text and its tokens' logprobs, nothing generated;
    streamed the same. Without echo, max_tokens 0 is a 400."""
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
    text = load_tokenizer(resolve_model_path(MODEL)).decode(prompt)
    ref = hf_logprobs(prompt)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                  temperature=0)
    latencies = e2e_count(url)
    res = client.completions.create(**kwargs)
    choice, lps = res.choices[0], res.choices[0].logprobs
    assert choice.text == text and choice.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt), 0)
    assert len(lps.tokens) == len(lps.token_logprobs) == len(prompt)
    assert lps.token_logprobs[0] is None
    for t in range(1, len(prompt)):
        assert lps.token_logprobs[t] == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lps.token_logprobs
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    one = client.completions.create(**{**kwargs, "prompt": [72]})  # (no prompt logprobs)
    assert one.choices[0].logprobs.token_logprobs == [None] and one.choices[0].text == "H"
    assert e2e_count(url) == latencies + 3  # each has its end-to-end latency, as vLLM's
    for body, param in [({"max_tokens": 0}, "max_tokens"),
                        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
                        ({"max_tokens": 0, "echo": True, "use_beam_search": True},
                         "max_tokens")]:
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logprobs_zero_returns_the_sampled_tokens_logprob(client):
    res = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0,
                                    logprobs=0, extra_body=NO_EOS)
    lps = res.choices[0].logprobs
    assert len(lps.token_logprobs) == 4 and all(v <= 0 for v in lps.token_logprobs)
    # only the chosen token (OpenAI: "up to logprobs + 1 elements")
    assert lps.top_logprobs == [{t: v} for t, v in zip(lps.tokens, lps.token_logprobs)]


def test_chat_logprobs_in_openai_shape_streamed_or_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    res = client.chat.completions.create(**kwargs)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 5
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and c.bytes for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])


@pytest.mark.parametrize("settings", [
    dict(repetition_penalty=1.7), dict(presence_penalty=1.2, frequency_penalty=0.8),
    dict(logit_bias={"65": 9.0, "66": 8.0})])
def test_penalties_and_logit_bias_give_transformers_tokens(client, url, settings):
    prompt = [3, 9, 27, 81, 243 % 256, 100, 17]
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={**NO_EOS, **{k: v for k, v in settings.items()
                                                             if k == "repetition_penalty"}},
                                    **{k: v for k, v in settings.items()
                                       if k != "repetition_penalty"})
    engine = dict(settings)
    if "logit_bias" in engine:
        engine["logit_bias"] = tuple((int(k), v) for k, v in engine["logit_bias"].items())
    ids = reference(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                           **engine))
    tokenizer_text = httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": ids, "max_tokens": 1, "echo": True, **NO_EOS}).json()["choices"][0]["text"]
    assert tokenizer_text.startswith(res.choices[0].text)
    wait_idle(url)


def test_nulls_mean_defaults(url):
    body = {"prompt": "x", "temperature": None, "top_p": None, "n": None, "stream": None,
            "top_k": None, "echo": None, "logprobs": None, "stop": None, "seed": None,
            "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
            "user": None, "stream_options": None, "max_tokens": 3}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": None,
            "max_completion_tokens": None, "temperature": None, "logprobs": None,
            "top_logprobs": None, "tools": None, "response_format": None, "n": None}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_stop_token_ends_the_output_without_its_text(url):
    """As vLLM: the token is counted and returned among the ids, its text is not output
    (logit_bias makes byte 65, "A", the only likely token)."""
    body = {"prompt": "hi", "max_tokens": 5, "logit_bias": {"65": 100}, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "stop_token_ids": [66]}, timeout=30)
    assert r.json()["choices"][0]["text"] == "AAAAA"  # the test can tell
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={
            **body, "stop_token_ids": [65], "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")] if stream else [r.json()]
        text = "".join(c["text"] for e in events for c in e["choices"])
        ids = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert (text, ids, finish) == ("", [65], ["stop"]), events
        assert events[-1]["usage"]["completion_tokens"] == 1


def test_a_model_by_id(client, url):
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{url}/v1/models/gpt-4", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_32_default_chats_run_at_once(url):
    """Chats without max_tokens (the default of openai, LangChain and LiteLLM) must not
    reserve a whole context each: on the default config all 32 run together."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "tell me more"}], "stream": True,
                    **NO_EOS}
            streams = [http.stream("POST", "/v1/chat/completions", json=body)
                       for _ in range(32)]
            responses = [await s.__aenter__() for s in streams]
            readers = [r.aiter_lines() for r in responses]  # kept: a dropped one closes
            try:
                for lines in readers:  # every stream produced tokens
                    while '"delta": {"content"' not in await anext(lines):
                        pass
                return (await http.get("/health")).json()
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)

    health = asyncio.run(run())
    assert health["num_running"] == 32 and health["num_waiting"] == 0, health
    wait_idle(url)


def test_every_metric_of_the_grafana_dashboard_is_served(url, client):
    import json
    import pathlib
    import re

    client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body=NO_EOS)
    dashboard = json.loads((pathlib.Path(__file__).parents[1] / "deployments" / "grafana"
                            / "orca-serve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    used = {m for e in exprs for m in re.findall(r"orca:[a-z0-9_:]+", e)}
    assert len(used) >= 15
    text = httpx.get(f"{url}/metrics", timeout=30).text
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
              if line and not line.startswith("#")}
    assert used <= served, sorted(used - served)
    for name in ("orca:prompt_tokens_total", "orca:generation_tokens_total"):
        value = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith(name + "{"))
        assert value >= 1, name


def test_a_repeated_prefix_is_reported_as_cached_tokens(client, url):
    """Prefix caching is on by default: the second request with the same 70-token prefix
    (byte tokens) reuses its 4 full blocks of 16, says so in usage, and answers the same
    greedy tokens; the engine's counters and /health show the hits."""
    prefix = "You are a helpful assistant. Answer in one short sentence, please. Q: "
    assert len(prefix.encode()) == 70
    first = client.completions.create(model=MODEL, prompt=prefix + "one", max_tokens=5,
                                      temperature=0, extra_body=NO_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt=prefix + "two", max_tokens=5,
                                       temperature=0, stream=True,
                                       extra_body={**NO_EOS, "return_token_ids": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    usage = [chunk.usage for chunk in chunks if chunk.usage][-1]
    streamed_ids = [t for c in chunks for choice in c.choices for t in choice.token_ids]
    assert streamed_ids == reference(list((prefix + "two").encode()), SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))
    assert usage.prompt_tokens_details.cached_tokens == 64 and usage.prompt_tokens == 73
    again = client.completions.create(model=MODEL, prompt=prefix + "one", max_tokens=5,
                                      temperature=0,
                                      extra_body={**NO_EOS, "return_token_ids": True})
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    prompt_ids = list((prefix + "one").encode())  # the default model's byte tokens
    expected = reference(prompt_ids, SamplingParams(max_tokens=5, temperature=0.0,
                                                    ignore_eos=True))
    assert again.choices[0].prompt_token_ids == prompt_ids
    assert again.choices[0].token_ids == expected
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prefix}], max_tokens=2)
    assert 0 <= chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens
    text = httpx.get(f"{url}/metrics", timeout=30).text
    value = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("orca:prefix_cache_")}
    assert value["orca:prefix_cache_hits_total"] >= 128
    assert value["orca:prefix_cache_queries_total"] >= 73 * 3
    assert httpx.get(f"{url}/health", timeout=30).json()["prefix_cache_hit_rate"] > 0


def test_multi_turn_load_client_sends_whole_histories_that_hit_the_cache(url):
    """The load client's multi-turn trace: each turn's prompt is the previous prompt, the
    answer's token ids (return_token_ids) and a new message, so most of it is cached."""
    import asyncio
    import math

    from load_tests.load_client import LoadConfig, sweep
    from load_tests.traces import multi_turn_trace

    trace = multi_turn_trace(6, vocab_size=256, seed=3, turns=3, output_len=40)
    cfg = LoadConfig(url, model=MODEL, num_warmup=0, show_progress=False)
    [res] = asyncio.run(sweep(cfg, trace, [math.inf]))
    assert res["completed"] == 6, res["errors"]
    messages = [len(r.prompt_token_ids) for r in trace]
    prompts = []
    for c in range(2):  # turn k sends turns 1..k's messages and k-1 answers of 40 tokens
        m = messages[3 * c:3 * c + 3]
        prompts += [m[0], m[0] + 40 + m[1], m[0] + 40 + m[1] + 40 + m[2]]
    assert res["total_prompt_tokens"] == sum(prompts)
    # turns 2 and 3 find their history's full blocks, less the block of the last answer
    # token (sampled, never computed): at least (history - 16) of each
    floor = sum(p - m - 16 for p, m in zip(prompts, messages) if p != m)
    assert res["cached_prompt_fraction"] >= floor / sum(prompts)


def test_tokenize_as_the_tokenizer_and_the_chat_template_do(url, client):
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import resolve_model_path
    from engine_actors.config import EngineConfig
    tok = AutoTokenizer.from_pretrained(resolve_model_path(EngineConfig().model))
    text = "Hello, world"
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text,
                                            "return_token_strs": True}).json()
    limit = httpx.get(f"{url}/v1/models/{MODEL}").json()["max_model_len"]
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == limit
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    bare = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert bare.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert r["tokens"] == list(expected) and r["token_strs"] is None
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert used.usage.prompt_tokens == r["count"]


def test_detokenize_and_bad_token_bodies(url):
    ids = [72, 101, 108, 108, 111]  # byte-level: "Hello"
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello"}
    for body, param in [({"tokens": [10 ** 9]}, "tokens"), ({"tokens": "abc"}, "tokens"),
                        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
                         "prompt"), ({}, "prompt")]:
        route = "/detokenize" if "tokens" in body else "/tokenize"
        r = httpx.post(f"{url}{route}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_minus_one_asks_for_max_logprobs_and_more_is_a_400(client):
    """The server's max_logprobs is vLLM's default, 20."""
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=-1, extra_body=NO_EOS)
    assert [len(c.top_logprobs) for c in chat.choices[0].logprobs.content] == [20] * 3
    res = client.completions.create(model=MODEL, prompt=[72, 101, 108], max_tokens=1,
                                    extra_body={"prompt_logprobs": -1})
    alternatives = [len(p) for p in res.choices[0].model_extra["prompt_logprobs"][1:]]
    assert all(20 <= n <= 21 for n in alternatives), alternatives  # (and the prompt's token)
    with pytest.raises(openai.BadRequestError, match="Requested sample logprobs of 21, which "
                                                     "is greater than max allowed: 20"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=21)
