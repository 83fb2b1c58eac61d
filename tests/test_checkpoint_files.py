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
