"""Request bodies that once got a 500 or stalled the server: each is refused with a 400 that
names what is wrong, before anything is tokenized or compiled (no server needed)."""
from __future__ import annotations

import json

import pytest

from deployments.chat_protocol import ChatCompletionRequest
from deployments.completion_protocol import CompletionRequest
from deployments.finetune_api import FineTuningJobRequest
from deployments.protocol import APIError
from deployments.request_body import parse_body
from deployments.structured import MAX_JSON_DEPTH, grammar_for
from deployments.training_data import parse_training_file


def refused(raw: bytes, schema) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(raw, schema)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("raw,schema", [
    (b'{"prompt": "a\\ud800b"}', CompletionRequest),
    (b'{"prompt": "a", "model": "\\udc00"}', CompletionRequest),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', ChatCompletionRequest),
    (b'{"prompt": "a", "logit_bias": {"\\ud800": 1}}', CompletionRequest),
])
def test_a_lone_surrogate_is_a_400(raw, schema):
    assert refused(raw, schema).code == "invalid_encoding"


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 bytes
    '{"prompt": "a\\ud800"}'.encode("utf-16"),  # JSON in UTF-16, with the escape
])
def test_surrogate_bytes_and_non_utf8_bodies_are_a_400(raw):
    assert refused(raw, CompletionRequest).code == "invalid_encoding"


def test_escaped_surrogate_pairs_and_plain_text_pass():
    req = parse_body(b'{"prompt": "\\ud83d\\ude00 caf\\u00e9 \xc3\xa9"}', CompletionRequest)
    assert req.prompt == "\U0001F600 caf\u00e9 \u00e9"


@pytest.mark.parametrize("key", ["²", "1" * 5000])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(key):
    raw = json.dumps({"prompt": "a", "logit_bias": {key: 1}}).encode()
    req = parse_body(raw, CompletionRequest)
    with pytest.raises(APIError) as info:
        req.sampling_params(16, vocab_size=None)
    assert info.value.status == 400 and info.value.param == "logit_bias"
    ok = req.model_copy(update={"logit_bias": {"12": 1}})
    assert ok.sampling_params(16, vocab_size=256).logit_bias == ((12, 1.0),)


def nested_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deeply_nested_schema_is_refused_before_compiling():
    deep = json.dumps({"prompt": "a", "guided_json": nested_schema(400)}).encode()
    req = parse_body(deep, CompletionRequest)
    with pytest.raises(APIError) as info:
        grammar_for(req)
    err = info.value
    assert err.status == 400 and err.param == "guided_json" and str(MAX_JSON_DEPTH) in err.message
    ok = parse_body(json.dumps({"prompt": "a", "guided_json": nested_schema(5)}).encode(),
                    CompletionRequest)
    assert grammar_for(ok)[0] == "json_schema"


@pytest.mark.parametrize("schema", ["{not json", "[" * 100_000,
                                    json.dumps({"enum": ["x" * 200_000]})])
def test_a_guided_json_string_that_is_no_schema_or_too_long_is_a_400(schema):
    req = parse_body(json.dumps({"prompt": "a", "guided_json": schema}).encode(),
                     CompletionRequest)
    with pytest.raises(APIError) as info:
        grammar_for(req)
    assert info.value.status == 400 and info.value.param == "guided_json"


@pytest.mark.parametrize("body,param", [
    ({"lora": {"target_modules": []}}, "lora.target_modules"),
    ({"hyperparameters": {"learning_rate_multiplier": -5}},
     "hyperparameters.learning_rate_multiplier"),
    ({"hyperparameters": {"learning_rate": 1e300}}, "hyperparameters.learning_rate"),
    ({"seed": 2 ** 70}, "seed"),
    ({"suffix": "a:b/../c"}, "suffix"),
    ({"suffix": "a\x00b"}, "suffix"),
    ({"suffix": "a\\b"}, "suffix"),
    ({"hyperparameters": {"n_epochs": 10 ** 6}}, "hyperparameters.n_epochs"),
])
def test_impossible_fine_tuning_settings_are_a_400(body, param):
    raw = json.dumps({"training_file": "file-x", "model": "m", **body}).encode()
    assert refused(raw, FineTuningJobRequest).param == param


def test_a_surrogate_in_a_training_file_names_its_line():
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import resolve_model_path
    from engine_actors.config import DEFAULT_MODEL
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))
    content = b'{"prompt": "a", "completion": "b"}\n{"prompt": "\\ud800", "completion": "b"}'
    with pytest.raises(APIError) as info:
        parse_training_file(content, tokenizer, 1024)
    assert info.value.status == 400 and "line 2" in info.value.message


def test_a_training_line_nested_past_the_recursion_limit_names_its_line():
    from deployments.training_data import read_rows
    deep = '{"prompt": "a", "completion": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(APIError) as info:
        read_rows(b'{"prompt": "a", "completion": "b"}\n' + deep.encode())
    assert info.value.status == 400 and "line 2" in info.value.message


def test_training_lines_end_at_newlines_only_and_a_byte_order_mark_is_not_text():
    from deployments.training_data import read_rows
    rows = [{"prompt": "a\u2028b\u2029c\x85d", "completion": "e"}, {"prompt": "f", "completion": "g"}]
    content = "\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
    assert [row for _, row in read_rows(content.encode())] == rows


def test_tool_call_arguments_nested_past_the_recursion_limit_stay_a_string():
    from deployments.chat_protocol import ToolCallMessage
    deep = "[" * 5000 + "]" * 5000
    call = ToolCallMessage(id="c", function={"name": "f", "arguments": deep})
    assert call.for_template()["function"]["arguments"] == deep


@pytest.mark.parametrize("suffix", ["", "my-model_v2.1", "café"])
def test_usual_suffixes_pass(suffix):
    raw = json.dumps({"training_file": "file-x", "model": "m", "suffix": suffix}).encode()
    assert parse_body(raw, FineTuningJobRequest).suffix == suffix


def test_long_text_is_tokenized_on_a_thread_and_the_event_loop_goes_on():
    import asyncio
    import threading
    import time

    from deployments.frontend import LONG_TEXT_CHARS, Frontend
    from engine_actors.config import EngineConfig

    class Tokenizer:  # slow on long text, as a 4 MB prompt is (seconds)
        def encode(self, text, add_special_tokens=True):
            time.sleep(0.5 if len(text) > LONG_TEXT_CHARS else 0)
            return threading.current_thread(), self

    frontend = Frontend(EngineConfig())
    frontend.tokenizer = Tokenizer()

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        ticker = asyncio.create_task(tick())
        short = await frontend.tokenize(lambda t: t.encode("a"), 1)
        long = await frontend.tokenize(lambda t: t.encode("a" * (LONG_TEXT_CHARS + 1)),
                                       LONG_TEXT_CHARS + 1)
        # many prompts, each short, long in all: their request is tokenized on the thread
        halves = await frontend.prompt_ids(["a" * (LONG_TEXT_CHARS // 2 + 1)] * 2, None,
                                           ["prompt"] * 2)
        ticker.cancel()
        assert all(ids[0] is not threading.main_thread() for ids in halves)
        return short, long, ticks
    short, long, ticks = asyncio.run(main())
    assert short == (threading.main_thread(), frontend.tokenizer)
    # a copy of the tokenizer (not safe to share between threads), on another thread
    assert long[0] is not threading.main_thread() and isinstance(long[1], Tokenizer) \
        and long[1] is not frontend.tokenizer
    assert ticks >= 20  # the loop ran on while the long text was tokenized


C, CHAT = CompletionRequest, ChatCompletionRequest


@pytest.mark.parametrize("fields,schema", [
    ({"guided_decoding_backend": "x"}, C), ({"structural_tag": "x"}, C),
    ({"logits_processors": ["x"]}, CHAT)])
def test_vllm_fields_this_server_does_not_follow_are_refused_not_ignored(fields, schema):
    """Ignored, each answered something other than what the client asked for; their values
    that change nothing (guided_decoding_backend null, ...) are accepted."""
    body = {"prompt": "a"} if schema is C else {"messages": [{"role": "user", "content": "a"}]}
    error = refused(json.dumps({**body, **fields}).encode(), schema)
    assert error.code == "unsupported_parameter", error.message
    assert error.param.startswith(next(iter(fields))), error.param
    neutral = {"guided_decoding_backend": "xgrammar", "logits_processors": None}
    parse_body(json.dumps({**body, **{k: v for k, v in neutral.items()
                                      if k in schema.UNFOLLOWED}}).encode(), schema)


@pytest.mark.parametrize("fields,schema,param", [
    ({"allowed_token_ids": []}, C, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, C, "allowed_token_ids"),
    ({"min_p": 1.5}, C, "min_p"), ({"truncate_prompt_tokens": -2}, C, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, C, "truncate_prompt_tokens"),
    ({"prompt_logprobs": -2}, C, "prompt_logprobs"), ({"logprobs": -2}, C, "logprobs"),
    ({"top_logprobs": -2}, CHAT, "top_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, C, "prompt_logprobs"),
    ({"continue_final_message": True}, CHAT, "continue_final_message"),
    ({"bad_words": "abc"}, C, "bad_words"),
    ({"documents": [{"title": 5}]}, CHAT, "documents")])
def test_vllm_fields_with_values_out_of_range_are_400(fields, schema, param):
    body = {"prompt": "a"} if schema is C else {"messages": [{"role": "user", "content": "a"}]}
    error = refused(json.dumps({**body, **fields}).encode(), schema)
    assert error.status == 400 and error.param.startswith(param), (error.param, error.message)


def test_a_bad_word_with_a_token_past_the_models_logits_is_a_400():
    """A tokenizer's added token past the model's vocabulary would index past the logits."""
    import asyncio

    from deployments.frontend import Frontend, bad_word_ids
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL, EngineConfig
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))  # bytes: "z" is 122
    assert asyncio.run(bad_word_ids(frontend, ["a"], 100)) == ((97,),)
    with pytest.raises(APIError) as info:
        asyncio.run(bad_word_ids(frontend, ["a", "z"], 100))
    assert (info.value.status, info.value.param) == (400, "bad_words.1")


def test_add_special_tokens_as_vllm_has_it():
    """A tokenizer that puts a BOS before text: completions add it unless the request says
    add_special_tokens: false (a prompt already templated); chat adds none unless asked
    (the template writes its own)."""
    import asyncio
    import types

    from tokenizers.processors import TemplateProcessing

    from deployments.chat_protocol import ChatCompletionRequest, ChatMessage
    from deployments.frontend import Frontend
    from deployments.openai_api import OpenAIRoutes
    from engine_actors.checkpoint import BOS_ID, load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL, EngineConfig
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    frontend.tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    frontend.tokenizer.chat_template = "{{ messages[0].content }}"
    info = types.SimpleNamespace(vocab_size=BOS_ID + 2)  # (what these calls read of it)

    def prompt(**fields) -> list[int]:
        req = CompletionRequest(prompt="ab", **fields)
        return asyncio.run(frontend.prompt_ids([req.prompt], info, ["prompt"],
                                               req.add_special_tokens))[0]
    assert prompt() == [BOS_ID, 97, 98]
    assert prompt(add_special_tokens=False) == [97, 98]

    def chat(**fields) -> list[int]:
        req = ChatCompletionRequest(messages=[ChatMessage(role="user", content="ab")],
                                    **fields)
        return asyncio.run(OpenAIRoutes(frontend).chat_prompt(req, info))[0]
    assert chat() == [97, 98]
    assert chat(add_special_tokens=True) == [BOS_ID, 97, 98]


def test_seed_minus_one_is_vllms_no_seed():
    seeds = [CompletionRequest(prompt="a", seed=seed).sampling_params(4, choice=1).seed
             for seed in (-1, -2, 7, None)]
    assert seeds == [None, -1, 8, None]


def test_null_max_tokens_on_completions_is_vllms_none_not_the_default_16():
    from deployments.request_body import parse_body
    assert parse_body(b'{"prompt": "a"}', CompletionRequest).max_tokens == 16
    assert parse_body(b'{"prompt": "a", "max_tokens": null}', CompletionRequest).max_tokens \
        is None
    assert parse_body(b'{"prompt": "a", "temperature": null}', CompletionRequest) \
        .temperature is None  # (unset: the checkpoint's default)


def test_an_integer_past_pythons_digit_limit_is_a_json_error_without_internals():
    error = refused(b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", CompletionRequest)
    assert error.code == "invalid_json" and "sys." not in error.message, error.message


def test_tool_choice_none_renders_the_tools_unless_the_server_excludes_them():
    """vLLM's default, and its --exclude-tools-when-tool-choice-none."""
    import asyncio
    import types

    from deployments.chat_protocol import ChatCompletionRequest
    from deployments.frontend import Frontend
    from deployments.openai_api import OpenAIRoutes
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL, EngineConfig
    from tests.test_structured_output import WEATHER
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    messages = [{"role": "user", "content": "hi"}]

    def prompt(exclude: bool, choice: str) -> list[int]:
        frontend = Frontend(EngineConfig(exclude_tools_when_tool_choice_none=exclude))
        frontend.tokenizer = tokenizer
        req = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER],
                                                    "tool_choice": choice})
        info = types.SimpleNamespace(architecture="LlamaForCausalLM")
        ids, _, parser = asyncio.run(OpenAIRoutes(frontend).chat_prompt(req, info))
        assert parser is None or choice == "auto"
        return ids
    with_tools = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
    without = tokenizer.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=True, return_dict=False)
    assert with_tools != without
    assert prompt(False, "none") == list(with_tools)
    assert prompt(True, "none") == list(without)
    assert prompt(True, "auto") == list(with_tools)


@pytest.mark.parametrize("max_logprobs,fields,resolved", [
    (20, {"logprobs": -1, "prompt_logprobs": 3}, {"logprobs": 20, "prompt_logprobs": 3}),
    (5, {"logprobs": 5, "prompt_logprobs": -1}, {"logprobs": 5, "prompt_logprobs": 5}),
    (-1, {"logprobs": -1, "prompt_logprobs": 258}, {"logprobs": 258, "prompt_logprobs": 258}),
    (1000, {"logprobs": -1}, {"logprobs": 258})])  # (the tiny model's vocabulary: 258)
def test_minus_one_asks_for_as_many_logprobs_as_max_logprobs_allows(max_logprobs, fields,
                                                                    resolved):
    from deployments.logprobs import resolve_logprobs
    req = parse_body(json.dumps({"prompt": "a", **fields}).encode(), C)
    resolve_logprobs(req, max_logprobs, 258)
    assert {name: getattr(req, name) for name in resolved} == resolved


@pytest.mark.parametrize("max_logprobs,fields,message", [
    (20, {"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max "
                           "allowed: 20"),
    (5, {"top_logprobs": 6, "logprobs": True}, "sample logprobs of 6, .* allowed: 5"),
    (-1, {"prompt_logprobs": 259}, "Requested prompt logprobs of 259, .* allowed: 258")])
def test_more_logprobs_than_max_logprobs_is_a_400_in_vllms_words(max_logprobs, fields, message):
    from deployments.logprobs import resolve_logprobs
    schema = CHAT if "top_logprobs" in fields else C
    body = {"prompt": "a"} if schema is C else {"messages": [{"role": "user", "content": "a"}]}
    req = parse_body(json.dumps({**body, **fields}).encode(), schema)
    with pytest.raises(APIError, match=message) as info:
        resolve_logprobs(req, max_logprobs, 258)
    assert (info.value.status, info.value.param) == (400, next(iter(fields)))
