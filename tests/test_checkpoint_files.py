"""What real checkpoints carry besides weights: chat templates, generation configs."""
from __future__ import annotations

import json

import pytest

from deployments.completion_protocol import CompletionRequest
from engine_actors.checkpoint import load_tokenizer, model_info, save_random_checkpoint
from engine_actors.config import EngineConfig

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_template_from_chat_template_jinja(tmp_path):
    save_random_checkpoint(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    text = load_tokenizer(str(tmp_path)).apply_chat_template(MESSAGES, tokenize=False)
    assert text == "[user] hi\n>>"


def test_chat_template_from_tokenizer_config(tmp_path):
    save_random_checkpoint(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    text = load_tokenizer(str(tmp_path)).apply_chat_template(MESSAGES, tokenize=False)
    assert text == "[user] hi\n>>"


def test_generation_config_gives_eos_ids_and_sampling_defaults(tmp_path):
    save_random_checkpoint(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [257, 9, 12], "temperature": 0.6, "top_p": 0.9, "do_sample": True,
         "min_p": 0.05}))
    info = model_info(EngineConfig.from_args({"model": str(tmp_path)}))
    assert set(info.eos_token_ids) == {9, 12, 257}
    assert info.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05}
    unset = CompletionRequest(prompt="x").sampling_params(8, 0, info.sampling_defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.9, 0, 0.05)
    assert CompletionRequest(prompt="x", min_p=0.0).sampling_params(
        8, 0, info.sampling_defaults).min_p == 0.0
    nulls = CompletionRequest(prompt="x", temperature=None, top_p=None)
    assert nulls.sampling_params(8, 0, info.sampling_defaults).temperature == 0.6
    given = CompletionRequest(prompt="x", temperature=0.0, top_p=0.5, top_k=3)
    s = given.sampling_params(8, 0, info.sampling_defaults)
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 3)
    plain = CompletionRequest(prompt="x").sampling_params(8)  # no generation config
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, 0, 0.0)
    assert (plain.repetition_penalty, plain.presence_penalty) == (1.0, 0.0)


def test_generation_config_penalties_and_max_new_tokens_are_defaults_as_in_vllm(tmp_path):
    """Qwen2.5's repetition_penalty 1.05, say: requests that leave it unset get it."""
    save_random_checkpoint(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.05, "presence_penalty": 0.5, "max_new_tokens": 7}))
    info = model_info(EngineConfig.from_args({"model": str(tmp_path)}))
    assert info.sampling_defaults == {"repetition_penalty": 1.05, "presence_penalty": 0.5,
                                      "max_tokens": 7}
    unset = CompletionRequest(prompt="x").sampling_params(8, 0, info.sampling_defaults)
    assert (unset.repetition_penalty, unset.presence_penalty, unset.frequency_penalty) == \
        (1.05, 0.5, 0.0)
    given = CompletionRequest(prompt="x", repetition_penalty=1.0, presence_penalty=0.0)
    s = given.sampling_params(8, 0, info.sampling_defaults)
    assert (s.repetition_penalty, s.presence_penalty) == (1.0, 0.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="unusable sampling defaults"):
        model_info(EngineConfig.from_args({"model": str(tmp_path)}))


@pytest.mark.parametrize("bad", [{"top_p": 0}, {"min_p": 1.5}, {"top_k": "40"}])
def test_a_sampling_default_out_of_range_fails_the_start(tmp_path, bad):
    """Not each request later (every one would fail on it)."""
    save_random_checkpoint(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="generation_config.json: unusable sampling defaults"):
        model_info(EngineConfig.from_args({"model": str(tmp_path)}))


# ---- vLLM's hf_overrides, generation_config and override_generation_config ---------------
def test_hf_overrides_set_the_config_as_transformers_reads_the_same_keys(tmp_path):
    """Linear rope scaling set at start: the same greedy tokens as transformers given the
    same override, others than without it; a longer max_position_embeddings is the limit."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine_actors.request import SamplingParams
    from tests.engine_harness import InProcessEngine
    save_random_checkpoint(str(tmp_path))
    rope = {"rope_type": "linear", "factor": 8.0}
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(40 + 9 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def engine(**args):
        run = InProcessEngine(model=str(tmp_path), **args).run(
            {0: [(str(i), p, greedy) for i, p in enumerate(prompts)]})
        return [run[str(i)] for i in range(len(prompts))]
    scaled = engine(hf_overrides={"rope_scaling": rope, "max_position_embeddings": 8192})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), rope_scaling=rope,
                                              dtype=torch.float32).eval()
    for p, got in zip(prompts, scaled):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                              pad_token_id=0)
        assert got == out[0, len(p):].tolist()
    assert scaled != engine()
    info = model_info(EngineConfig.from_args({"model": str(tmp_path),
                                              "hf_overrides": {"max_position_embeddings": 8192}}))
    assert info.max_model_len == 8192 and info.config["max_position_embeddings"] == 8192
    assert model_info(EngineConfig.from_args({"model": str(tmp_path)})).max_model_len == 4096


def test_generation_config_vllm_a_folder_and_overrides(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    save_random_checkpoint(str(model))
    other.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [9], "temperature": 0.6, "top_p": 0.9}))
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20}))

    def info(**args):
        return model_info(EngineConfig.from_args({"model": str(model), **args}))
    assert info().sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    plain = info(generation_config="vllm")
    assert plain.sampling_defaults == {} and 9 in plain.eos_token_ids  # (eos ids stay)
    assert info(generation_config=str(other)).sampling_defaults == {"top_k": 20}
    assert info(override_generation_config={"temperature": 0.2, "max_new_tokens": 5}) \
        .sampling_defaults == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 5}
    with pytest.raises(ValueError, match=r"unknown keys \['seed'\]"):
        info(override_generation_config={"seed": 1})
    with pytest.raises(ValueError, match="override_generation_config: unusable"):
        info(override_generation_config={"top_p": 2.0})
    with pytest.raises(ValueError, match="not \"auto\", \"vllm\" or a folder"):
        info(generation_config=str(tmp_path / "missing"))


def test_auto_tool_choice_off_refuses_auto_and_takes_forced_calls():
    import asyncio
    from types import SimpleNamespace

    from deployments.chat_protocol import ChatCompletionRequest
    from deployments.openai_api import OpenAIRoutes
    from deployments.protocol import APIError
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    api = SimpleNamespace(frontend=SimpleNamespace(cfg=SimpleNamespace(
        enable_auto_tool_choice=False, exclude_tools_when_tool_choice_none=False)))
    for choice in ({}, {"tool_choice": "auto"}):
        req = ChatCompletionRequest.model_validate(
            {"messages": MESSAGES, "tools": [tool], **choice})
        with pytest.raises(APIError) as e:
            asyncio.run(OpenAIRoutes.chat_prompt(api, req, None))
        assert e.value.status == 400 and "enable_auto_tool_choice" in e.value.message
    forced = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [tool], "tool_choice": "required"})
    with pytest.raises(AttributeError, match="chat_ids"):  # past the check, to the template
        asyncio.run(OpenAIRoutes.chat_prompt(api, forced, None))
