"""runner "pooling": a decoder model serves embeddings (POST /v1/embeddings), each the last
prompt token's final hidden state as transformers computes it (fp32), L2-normalized unless a
sentence-transformers checkpoint says otherwise; through the engine (chunked prompts in
batches) and through HTTP with the official client."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_actors.checkpoint import load_tokenizer, resolve_model_path, save_random_checkpoint
from engine_actors.config import DEFAULT_MODEL
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine

pytestmark = pytest.mark.own_server  # conftest runs these modules last


def hf_last_hidden(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' base model (its final norm applied), one prompt at a time."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def run_pooling(model_dir: str, prompts: list[list[int]], **args) -> list[list[float]]:
    engine = InProcessEngine(model=model_dir, runner="pooling", max_batch_size=4,
                             block_size=4, max_num_batched_tokens=24, max_num_tokens=2048,
                             **args)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    outputs = engine.run({0: [(f"r{i}", p, sampling) for i, p in enumerate(prompts[:3])],
                          2: [(f"r{i}", p, sampling) for i, p in enumerate(prompts) if i >= 3],
                          # the first prompt again: its full blocks come from the prefix
                          # cache, and its last token is computed again
                          9: [("again", prompts[0], sampling)]})
    assert all(tokens == [] for tokens in outputs.values())  # (no token: the prompt only)
    assert set(engine.finish_reasons.values()) == {"stop"}
    got = {k: np.frombuffer(v, dtype=np.float32).tolist() for k, v in engine.embeddings.items()}
    assert engine.scheduler.kv.num_hit_tokens >= len(prompts[0]) - 4  # (all but a block)
    np.testing.assert_allclose(got["again"], got["r0"], rtol=1e-5, atol=1e-5)
    return [got[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [list(range(5 + 7 * i, 8 + 16 * i)) for i in range(6)]  # 3 to 83 tokens


def test_embeddings_equal_transformers_last_hidden_state(tmp_path):
    """Prompts of 3 to 83 tokens, in chunks of up to 24 tokens per step, arriving in two
    waves: normalized, and unnormalized where modules.json pools the last token with no
    Normalize module."""
    save_random_checkpoint(str(tmp_path), "qwen3", seed=3, head_dim=32)
    refs = hf_last_hidden(str(tmp_path), PROMPTS)
    for got, ref in zip(run_pooling(str(tmp_path), PROMPTS), refs):
        torch.testing.assert_close(torch.tensor(got), F.normalize(ref, dim=-1),
                                   rtol=1e-5, atol=1e-5)
    write_sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True}, normalize=False)
    for got, ref in zip(run_pooling(str(tmp_path), PROMPTS[:4]), refs):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-5)
        assert abs(float(ref.norm()) - 1) > 0.1  # (it is not normalized)


@pytest.mark.gpu
def test_embeddings_equal_transformers_on_gpu_fp32(tmp_path):
    save_random_checkpoint(str(tmp_path), "qwen3", seed=3, head_dim=32)
    refs = hf_last_hidden(str(tmp_path), PROMPTS)
    for got, ref in zip(run_pooling(str(tmp_path), PROMPTS, device="cuda", dtype="float32"),
                        refs):
        torch.testing.assert_close(torch.tensor(got), F.normalize(ref, dim=-1),
                                   rtol=1e-4, atol=1e-4)


def test_a_checkpoint_that_pools_otherwise_is_refused_at_start(tmp_path):
    save_random_checkpoint(str(tmp_path), "llama", seed=3)
    write_sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_mean_tokens.*last token"):
        InProcessEngine(model=str(tmp_path), runner="pooling", max_num_tokens=2048)


def write_sentence_transformers(path, pooling: dict, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **pooling}))


def test_the_routes_of_the_other_runner_are_refused():
    from deployments.completion_protocol import CompletionRequest
    from deployments.embeddings_api import EmbeddingRequest
    from deployments.messages_protocol import CountTokensRequest, MessagesRequest
    from deployments.pooling_api import PoolingRequest
    from deployments.protocol import APIError, check_runner
    from deployments.tokenize_api import TokenizeRequest
    with pytest.raises(APIError, match="needs runner pooling; this server was started with "
                                       "runner generate") as e:
        check_runner(EmbeddingRequest, "generate")
    assert e.value.status == 400 and e.value.code == "unsupported_runner"
    with pytest.raises(APIError, match="needs runner generate"):
        check_runner(CompletionRequest, "pooling")
    with pytest.raises(APIError, match="needs runner generate"):
        check_runner(MessagesRequest, "pooling")
    check_runner(EmbeddingRequest, "pooling")
    with pytest.raises(APIError, match="needs runner pooling"):
        check_runner(PoolingRequest, "generate")
    for route in (TokenizeRequest, CountTokensRequest):  # (they only tokenize)
        check_runner(route, "pooling")


def test_dimensions_normalize_again_only_a_normalized_model():
    from deployments.embeddings_api import encode
    vector = np.array([3.0, 4.0, 12.0], dtype=np.float32).tobytes()
    assert encode(vector, 2, "float", normalize=True) == pytest.approx([0.6, 0.8])
    assert encode(vector, 2, "float", normalize=False) == [3.0, 4.0]
    assert encode(vector, 3, "float", normalize=True) == [3.0, 4.0, 12.0]  # (as it came)
    short = base64.b64decode(encode(vector, 2, "base64", normalize=True))
    assert np.frombuffer(short, dtype="<f4").tolist() == pytest.approx([0.6, 0.8])


# ---- through HTTP --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(runner="pooling"))
    stop_app()


def test_embeddings_through_http_with_the_openai_client(url):
    """The default model's embeddings of text (base64, the client's default, and floats),
    token ids, and shortened to `dimensions`, against transformers on the same ids."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    path = resolve_model_path(DEFAULT_MODEL)
    texts = ["The quick brown fox", "a", "orca " * 30]
    ids = [load_tokenizer(path).encode(t) for t in texts]  # (with special tokens, as served)
    refs = [F.normalize(h, dim=-1) for h in hf_last_hidden(path, ids + [[7, 8, 9]])]
    answer = client.embeddings.create(model=DEFAULT_MODEL, input=texts)
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for d, ref in zip(answer.data, refs):
        torch.testing.assert_close(torch.tensor(d.embedding), ref, rtol=1e-5, atol=1e-5)
    floats = httpx.post(f"{url}/v1/embeddings", timeout=60, json={
        "input": [7, 8, 9], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    torch.testing.assert_close(torch.tensor(floats["data"][0]["embedding"]), refs[3],
                               rtol=1e-5, atol=1e-5)
    short = httpx.post(f"{url}/v1/embeddings", timeout=60, json={
        "input": texts[0], "dimensions": 8, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.tensor(vector), F.normalize(refs[0][:8], dim=-1),
                               rtol=1e-5, atol=1e-5)


def test_pooling_gives_each_inputs_embedding(url):
    """vLLM's /pooling on an embedding model: what /v1/embeddings gives, in its shape."""
    path = resolve_model_path(DEFAULT_MODEL)
    texts = ["The quick brown fox", "orca " * 30]
    ids = [load_tokenizer(path).encode(t) for t in texts]
    refs = [F.normalize(h, dim=-1) for h in hf_last_hidden(path, ids)]
    r = httpx.post(f"{url}/pooling", timeout=60, json={"input": texts})
    body = r.json()
    assert r.status_code == 200, body
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, ref in zip(body["data"], refs):
        torch.testing.assert_close(torch.tensor(d["data"]), ref, rtol=1e-5, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, ids))
    packed = httpx.post(f"{url}/v1/pooling", timeout=60, json={
        "input": ids[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    torch.testing.assert_close(torch.tensor(vector), refs[0], rtol=1e-5, atol=1e-5)


def test_messages_are_embedded_as_the_chat_template_renders_them(url):
    """vLLM's chat form of /v1/embeddings and /pooling: the template's token ids, without
    a generation prompt unless asked, embedded as transformers embeds those ids."""
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    messages = [{"role": "system", "content": "Embed this."},
                {"role": "user", "content": "The quick brown fox"}]
    ids = [tokenizer.apply_chat_template(messages, add_generation_prompt=g, tokenize=True,
                                         return_dict=False) for g in (False, True)]
    assert ids[0] != ids[1]
    refs = [F.normalize(h, dim=-1) for h in hf_last_hidden(resolve_model_path(DEFAULT_MODEL),
                                                           ids)]
    for path, key, extra, ref, n in [
            ("/v1/embeddings", "embedding", {}, refs[0], len(ids[0])),
            ("/pooling", "data", {"add_generation_prompt": True}, refs[1], len(ids[1]))]:
        r = httpx.post(f"{url}{path}", timeout=60, json={
            "messages": messages, "encoding_format": "float", **extra})
        body = r.json()
        assert r.status_code == 200, body
        assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == n
        torch.testing.assert_close(torch.tensor(body["data"][0][key]), ref, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("path,body,status,code", [
    ("/v1/embeddings", {"input": ""}, 400, "invalid_value"),
    ("/pooling", {"input": []}, 400, "invalid_value"),
    ("/pooling", {"encoding_format": "float"}, 400, "missing_required_parameter"),
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_value"),
    ("/v1/embeddings", {"messages": []}, 400, "invalid_value"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}],
                        "chat_template_kwargs": {"tokenize": True}}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": []}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": [[1, 2], [99999]]}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": "x" * 5000}, 400, "context_length_exceeded"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, None),
    ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 400, "unsupported_runner"),
    ("/v1/score", {"text_1": "x", "text_2": "y"}, 400, "unsupported_task"),  # (no classifier)
    ("/v1/rerank", {"query": "x", "documents": ["y"]}, 400, "unsupported_task"),
    ("/classify", {"input": "x"}, 400, "unsupported_task"),  # (no sequence classifier)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400,
     "unsupported_runner"),
])
def test_bad_embedding_requests_and_generation_get_4xx(url, path, body, status, code):
    res = httpx.post(f"{url}{path}", timeout=60, json=body)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert error["message"] and (code is None or error["code"] == code)
