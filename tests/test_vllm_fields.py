"""vLLM's request fields over HTTP, as vLLM answers them: min_p, allowed_token_ids,
bad_words, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens, prompt_logprobs,
stream_options.continuous_usage_stats, and on chat add_generation_prompt,
continue_final_message, echo and documents."""
from __future__ import annotations

import functools
import json

import httpx
import pytest

from engine_actors.checkpoint import EOS_ID
from tests.test_logits import hf_logprobs

MODEL = "tiny-random-llama"
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import resolve_model_path
    from engine_actors.config import EngineConfig
    return AutoTokenizer.from_pretrained(resolve_model_path(EngineConfig().model))


def post(url: str, route: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(url: str, route: str, **body) -> list[dict]:
    r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL, "stream": True, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def completion(url: str, **body) -> dict:
    return post(url, "completions", **{"prompt": PROMPT, "temperature": 0,
                                       "return_token_ids": True, **body})["choices"][0]


def test_allowed_token_ids_and_min_p_sample_only_what_they_keep(url):
    allowed = [65, 66, 67, 68]
    for seed in range(3):
        ids = completion(url, temperature=1.5, seed=seed, max_tokens=12, ignore_eos=True,
                         allowed_token_ids=allowed)["token_ids"]
        assert len(ids) == 12 and set(ids) <= set(allowed), ids
    # min_p 1 keeps only the likeliest token: sampling at any temperature is then greedy
    greedy = completion(url, max_tokens=10, ignore_eos=True)["token_ids"]
    for seed in range(2):
        assert completion(url, temperature=2.0, seed=seed, min_p=1.0, max_tokens=10,
                          ignore_eos=True)["token_ids"] == greedy
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "allowed_token_ids": [999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_include_stop_str_in_output_keeps_the_stop_string_and_token(url):
    full = completion(url, max_tokens=12, ignore_eos=True)
    stop = full["text"][4:6]  # a stop string the greedy output meets
    cut = full["text"].index(stop)
    for stream in (False, True):
        body = dict(prompt=PROMPT, temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        if stream:
            got = [events(url, "completions", include_stop_str_in_output=include, **body)
                   for include in (False, True)]
            texts = ["".join(c["text"] for e in ev for c in e["choices"]) for ev in got]
        else:
            texts = [completion(url, include_stop_str_in_output=include, **body)["text"]
                     for include in (False, True)]
        assert texts == [full["text"][:cut], full["text"][:cut + len(stop)]]
    # a stop token's text is kept too
    token = full["token_ids"][3]
    kept = completion(url, max_tokens=12, ignore_eos=True, stop_token_ids=[token],
                      include_stop_str_in_output=True)
    assert kept["token_ids"] == full["token_ids"][:4]
    assert kept["text"] == tokenizer().decode(full["token_ids"][:4])


def test_skip_special_tokens_false_shows_them(url):
    body = dict(max_tokens=3, ignore_eos=True, allowed_token_ids=[EOS_ID])
    assert completion(url, **body)["text"] == ""
    shown = completion(url, skip_special_tokens=False, **body)
    assert shown["token_ids"] == [EOS_ID] * 3
    assert shown["text"] == tokenizer().convert_ids_to_tokens(EOS_ID) * 3
    # EOS ends the output without its text unless include_stop_str_in_output
    ended = completion(url, skip_special_tokens=False, max_tokens=3, allowed_token_ids=[EOS_ID])
    assert (ended["token_ids"], ended["text"], ended["finish_reason"]) == ([EOS_ID], "", "stop")


def test_truncate_prompt_tokens_keeps_the_last_tokens(url):
    res = post(url, "completions", prompt=PROMPT, temperature=0, max_tokens=6,
               ignore_eos=True, truncate_prompt_tokens=5, return_token_ids=True, echo=True)
    short = post(url, "completions", prompt=PROMPT[-5:], temperature=0, max_tokens=6,
                 ignore_eos=True, return_token_ids=True)
    assert res["usage"]["prompt_tokens"] == 5
    assert res["choices"][0]["token_ids"] == short["choices"][0]["token_ids"]
    assert res["choices"][0]["text"] == tokenizer().decode(PROMPT[-5:]) + \
        short["choices"][0]["text"]  # echo shows the kept prompt
    chat = post(url, "chat/completions", messages=[{"role": "user", "content": "hi there"}],
                max_tokens=1, truncate_prompt_tokens=4)
    assert chat["usage"]["prompt_tokens"] == 4
    r = httpx.post(f"{url}/v1/completions",
                   json={"prompt": "a", "truncate_prompt_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def check_prompt_logprobs(entries: list, prompt: list[int], k: int) -> None:
    """vLLM's shape, each value against transformers' log-softmax."""
    ref = hf_logprobs(prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for t, entry in enumerate(entries[1:], 1):
        row, own = ref[t - 1], str(prompt[t])
        top = row.topk(k)
        assert set(entry) == {own} | {str(i) for i in top.indices.tolist()}
        assert entry[own]["logprob"] == pytest.approx(row[prompt[t]].item(), abs=1e-4)
        assert entry[own]["decoded_token"] == tokenizer().decode([prompt[t]])
        if own not in {str(i) for i in top.indices.tolist()}:
            assert entry[own]["rank"] == int((row >= row[prompt[t]]).sum())
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(i)]["rank"] == rank
            assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-4)


def test_prompt_logprobs_in_vllms_shape_equal_transformers(url):
    res = post(url, "completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=2, n=2,
               logprobs=1, echo=True)
    for choice in res["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], PROMPT, 2)
        # echo's entries keep logprobs' one alternative (the engine computed two)
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(url, "chat/completions", messages=messages, max_tokens=1, prompt_logprobs=1,
                return_token_ids=True)
    prompt = chat["choices"][0]["prompt_token_ids"]
    check_prompt_logprobs(chat["prompt_logprobs"], prompt, 1)
    assert "prompt_logprobs" not in post(url, "chat/completions", messages=messages,
                                         max_tokens=1)


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(url):
    got = events(url, "completions", prompt=PROMPT, max_tokens=5, ignore_eos=True, n=2,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, final = got
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    counts = {0: [], 1: []}
    for e in chunks:
        usage = e["usage"]
        assert usage["prompt_tokens"] == len(PROMPT)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts[e["choices"][0]["index"]].append(usage["completion_tokens"])
    assert all(c == sorted(c) and c[-1] == 5 for c in counts.values()), counts


def test_continue_final_message_renders_the_answer_as_started(url):
    tok = tokenizer()
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My answer is"}]
    res = post(url, "chat/completions", messages=messages, max_tokens=4, temperature=0,
               add_generation_prompt=False, continue_final_message=True, echo=True,
               return_token_ids=True)
    choice = res["choices"][0]
    expected = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                       return_dict=False)
    assert choice["prompt_token_ids"] == list(expected)
    assert tok.decode(expected).endswith("My answer is")
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "continue_final_message": True,
                                            "add_generation_prompt": False})
    assert r.json()["tokens"] == list(expected)
    generated = tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["message"] == {"role": "assistant", "content": "My answer is" + generated}
    streamed = events(url, "chat/completions", messages=messages, max_tokens=4,
                      temperature=0, add_generation_prompt=False,
                      continue_final_message=True, echo=True)
    deltas = [c["delta"] for e in streamed for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "My answer is"}
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]


def test_no_generation_prompt_answers_in_the_last_messages_role(url):
    tok = tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    res = post(url, "chat/completions", messages=messages, max_tokens=2,
               add_generation_prompt=False, return_token_ids=True, echo=True,
               documents=[{"title": "a", "text": "b"}])
    expected = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                       return_dict=False)
    assert res["choices"][0]["prompt_token_ids"] == list(expected)
    assert res["choices"][0]["message"]["role"] == "user"
    assert res["choices"][0]["message"]["content"].startswith("Hello")
    # parts of the last message are echoed as they are joined (one per line, as vLLM)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo"}]}]
    res = post(url, "chat/completions", messages=parts, max_tokens=2, echo=True,
               add_generation_prompt=False, continue_final_message=True)
    assert res["choices"][0]["message"]["content"].startswith("Hel\nlo")
    # echo with a generation prompt: the last message is not the assistant's, nothing added
    res = post(url, "chat/completions", messages=messages, max_tokens=2, echo=True,
               temperature=0, ignore_eos=True, return_token_ids=True)
    assert res["choices"][0]["message"]["content"] == tok.decode(res["choices"][0]["token_ids"])


def test_bad_words_never_appear_in_the_output(url):
    letters = dict(max_tokens=16, ignore_eos=True, allowed_token_ids=list(range(97, 103)))
    full = completion(url, **letters)  # "a" to "f" only: text as the bytes are
    word = full["text"][3:5]  # two letters the greedy output writes
    banned = completion(url, bad_words=[word, "  zq"], **letters)
    assert word not in banned["text"] and banned["text"] != full["text"], (word, full)
    for words, param in [([""], "bad_words.0"), (["ab"] * 129, "bad_words"),
                         (["ok", "x" * 65], "bad_words.1")]:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "bad_words": words})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_grammar_and_allowed_tokens_that_leave_none_end_with_stop(url):
    """A classifier's choice without EOS among its allowed tokens: the answer, then
    nothing is left to sample (not token 0, which neither allows)."""
    choice = completion(url, prompt="x", max_tokens=4, guided_choice=["ab"],
                        allowed_token_ids=[97, 98])
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == \
        ("ab", [97, 98], "stop")


def test_the_batch_and_responses_routes_refuse_the_fields_they_do_not_take(url):
    """They take min_p and allowed_token_ids, not the completions routes' other fields
    (the Responses API takes include_stop_str_in_output, skip_special_tokens and
    structured_outputs too, as vLLM's)."""
    for field, value in [("bad_words", ["a"]), ("truncate_prompt_tokens", 2),
                         ("include_stop_str_in_output", True), ("prompt_logprobs", 1),
                         ("use_beam_search", True), ("length_penalty", 2.0), ("n", 2),
                         ("logprobs", 1), ("guided_regex", "a+"), ("echo", True),
                         ("response_format", {"type": "json_object"}),
                         ("thinking_token_budget", 8), ("add_special_tokens", False)]:
        r = httpx.post(f"{url}/orca/v1/batches", timeout=30, json={
            "requests": [{"prompt": "hi"}, {"prompt": "hi", field: value}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"requests.1.{field}", r.text
        if field in ("include_stop_str_in_output", "n", "logprobs", "guided_regex", "echo",
                     "response_format", "add_special_tokens"):
            continue  # (the Responses API follows or has its own)
        r = httpx.post(f"{url}/v1/responses", json={"input": "hi", field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for fields in [{"structured_outputs": {"regex": "[ab]{5}"}},
                   {"structured_outputs": {"choice": ["yes", "no"]}}]:
        r = httpx.post(f"{url}/v1/responses", timeout=30, json={
            "input": "hi", "max_output_tokens": 8, **fields})
        assert r.status_code == 200, r.text
        text = r.json()["output"][-1]["content"][0]["text"]
        assert text in ("yes", "no") if "choice" in fields["structured_outputs"] else \
            len(text) == 5 and set(text) <= set("ab"), text
    r = httpx.post(f"{url}/v1/responses", timeout=30, json={
        "input": "hi", "max_output_tokens": 8, "stop": ["a"], "include_stop_str_in_output": True,
        "allowed_token_ids": [97], "skip_special_tokens": False})
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == "a", r.text
    r = httpx.post(f"{url}/orca/v1/batches", timeout=30,
                   json={"requests": [{"prompt": "hi", "allowed_token_ids": [10 ** 6]}]})
    assert r.status_code == 400 and \
        r.json()["error"]["param"] == "requests.0.allowed_token_ids", r.text
    r = httpx.post(f"{url}/v1/responses", timeout=30, json={
        "input": "hi", "max_output_tokens": 6, "allowed_token_ids": [65], "min_p": 0.5,
        "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == "A" * 6, r.text


def test_a_requests_chat_template_needs_a_server_that_trusts_it(url):
    messages = [{"role": "user", "content": "hi"}]
    for route, body in [("v1/chat/completions", {"max_tokens": 2}), ("tokenize", {})]:
        r = httpx.post(f"{url}/{route}", timeout=30, json={
            "messages": messages, "chat_template": "{{ messages[0].content }}", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_the_servers_chat_template_and_a_trusted_requests_own(tmp_path):
    """vLLM's --chat-template (a file or the template) and --trust-request-chat-template."""
    import asyncio

    from deployments.app import build_app
    from deployments.chat_protocol import ChatMessage, chat_template_text
    from deployments.frontend import Frontend
    from deployments.protocol import APIError
    from engine_actors.config import ConfigError, EngineConfig
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template_text(str(tmp_path / "t.jinja")) == template
    assert chat_template_text(template) == template
    for bad in (str(tmp_path / "missing.jinja"), "{% for %}"):
        with pytest.raises(ValueError):
            chat_template_text(bad)
        with pytest.raises(ConfigError, match="chat_template"):
            build_app({"chat_template": bad})
    messages = [ChatMessage(role="user", content="hi")]

    def rendered(frontend, **kwargs) -> str:
        if frontend.tokenizer is None:
            asyncio.run(frontend._load_tokenizer())
        return tokenizer().decode(asyncio.run(frontend.chat_ids(messages, None, **kwargs)))
    server = Frontend(EngineConfig(chat_template=template))
    assert rendered(server) == "<user>hi<assistant>"
    with pytest.raises(APIError) as info:
        server.request_template("{{ messages[0].content }}!")
    assert info.value.param == "chat_template"
    trusting = Frontend(EngineConfig(trust_request_chat_template=True))
    own = trusting.request_template("{{ messages[0].content }}!")
    assert rendered(trusting, template=own) == "hi!"
    assert rendered(trusting) == tokenizer().decode(tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False))  # (the checkpoint's, without one)
    with pytest.raises(APIError) as info:
        rendered(trusting, template="{% if %}")
    assert info.value.param == "chat_template"


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(url):
    letters = dict(max_tokens=16, ignore_eos=True, allowed_token_ids=list(range(97, 103)))
    full = completion(url, **letters)
    assert (full["finish_reason"], full["stop_reason"]) == ("length", None)
    word, token = full["text"][4:6], full["token_ids"][3]
    by_string = completion(url, stop=["zz", word], **letters)
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", word)
    by_token = completion(url, stop_token_ids=[token], **letters)
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", token)
    eos = completion(url, max_tokens=4, allowed_token_ids=[EOS_ID])  # the tokenizer's EOS
    assert (eos["finish_reason"], eos["stop_reason"]) == ("stop", None)
    def chat(**fields) -> dict:
        return post(url, "chat/completions", messages=[{"role": "user", "content": "hi"}],
                    temperature=0, **letters, **fields)["choices"][0]
    said = chat()["message"]["content"][4:6]
    assert (chat(stop=[said])["stop_reason"], chat()["stop_reason"]) == (said, None)
    streamed = events(url, "completions", prompt=PROMPT, temperature=0,
                      stop_token_ids=[token], **letters)
    last = [c for e in streamed for c in e["choices"] if c["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", token)]


def test_return_token_ids_puts_the_prompts_ids_where_vllm_does(url):
    """Chat: at the top level (streamed: in the first chunk); completions: in each choice
    (streamed: in each choice's first chunk)."""
    messages = [{"role": "user", "content": "Hi"}]
    expected = list(tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    fields = dict(max_tokens=3, n=2, return_token_ids=True, ignore_eos=True)
    chat = post(url, "chat/completions", messages=messages, **fields)
    assert chat["prompt_token_ids"] == expected
    chunks = events(url, "chat/completions", messages=messages, **fields)
    assert chunks[0]["prompt_token_ids"] == expected
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    chunks = events(url, "completions", prompt=PROMPT, **fields)
    firsts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c.get("prompt_token_ids"))
    assert firsts == {0: PROMPT, 1: PROMPT}
    later = [c for chunk in chunks for c in chunk["choices"] if "prompt_token_ids" in c]
    assert len(later) == 2  # once per choice


def test_cache_salt_keeps_a_prefix_cache_of_its_own(url):
    """vLLM's cache_salt: a prompt computed under one salt is found cached only under it."""
    import random
    prompt = [random.Random(7).randrange(65, 120) for _ in range(50)]  # (no other test's)

    def cached(**salt) -> int:
        res = post(url, "completions", prompt=prompt, max_tokens=1, **salt)
        return res["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 32  # its full blocks, under the same salt
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached() >= 32
    for salt in ["", "a/b", "x" * 129]:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "cache_salt": salt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = httpx.post(f"{url}/orca/v1/batches", timeout=30,
                   json={"requests": [{"prompt": "hi", "cache_salt": "s"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "requests.0.cache_salt"


def test_request_id_names_the_answer_and_the_fingerprint_is_set(url):
    """vLLM's: the answer's id comes from the body's request_id, or X-Request-Id; clients
    that reuse one still get their own engine requests. system_fingerprint as OpenAI's."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(route: str, headers=None, **body) -> dict:
        r = httpx.post(f"{url}/v1/{route}", headers=headers or {}, timeout=60,
                       json={"max_tokens": 4, "ignore_eos": True, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()
    messages = [{"role": "user", "content": "hi"}]
    chat = ask("chat/completions", {"X-Request-Id": "trace-1"}, messages=messages)
    assert chat["id"] == "chatcmpl-trace-1" and chat["system_fingerprint"].startswith("fp_")
    assert ask("completions", prompt="a", request_id="body-2")["id"] == "cmpl-body-2"
    with ThreadPoolExecutor(4) as pool:  # one id, four requests at once: four answers
        answers = list(pool.map(lambda p: ask("completions", {"X-Request-Id": "same"},
                                              prompt=p), ["a", "b", "c", "d"]))
    assert {a["id"] for a in answers} == {"cmpl-same"}
    assert [a["usage"]["completion_tokens"] for a in answers] == [4] * 4
    chunks = events(url, "completions", prompt="a", max_tokens=2, request_id="s-1")
    assert {c["id"] for c in chunks} == {"cmpl-s-1"}


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(url):
    res = completion(url, max_tokens=4, ignore_eos=True, logprobs=2,
                     return_tokens_as_token_ids=True)
    lp = res["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in res["token_ids"]]
    assert all(all(t.startswith("token_id:") for t in top) for top in lp["top_logprobs"])
    chat = post(url, "chat/completions", messages=[{"role": "user", "content": "hi"}],
                max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=1,
                return_token_ids=True, return_tokens_as_token_ids=True)["choices"][0]
    assert [e["token"] for e in chat["logprobs"]["content"]] == \
        [f"token_id:{i}" for i in chat["token_ids"]]


@pytest.mark.parametrize("field,value", [
    ("thinking_token_budget", 16), ("spaces_between_special_tokens", False),
    ("logprob_token_ids", [5]), ("vllm_xargs", {"a": 1}), ("repetition_detection", {})])
def test_vllm_fields_this_server_cannot_follow_are_400(url, field, value):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
