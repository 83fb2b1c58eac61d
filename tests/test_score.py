"""A causal LM served as a reranker (runner pooling, classifier_from_token): a pair's score is
sigmoid(logit(yes) - logit(no)) at its last token, as transformers' logits give it (fp32):
the engine returns the logit, POST /v1/score and /v1/rerank its sigmoid (the logit itself
with use_activation false)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from engine_actors.checkpoint import load_tokenizer, resolve_model_path, save_random_checkpoint
from engine_actors.config import DEFAULT_MODEL
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine

pytestmark = pytest.mark.own_server  # conftest runs these modules last

TOKENS = ["n", "y"]  # single tokens of the byte-level test vocabulary (Qwen3-Reranker: no, yes)


def hf_scores(model_dir: str, prompts: list[list[int]], tokens: list[int],
              activation: bool = True) -> list[float]:
    """From transformers' next-token logits at each prompt's last token, one prompt at a
    time: logit(yes) - logit(no) (one token: its logit), or its sigmoid."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0, -1, tokens]
            logit = logits[-1] - logits[0] if len(tokens) == 2 else logits[0]
            out.append((torch.sigmoid(logit) if activation else logit).item())
    return out


def engine_scores(model_dir: str, prompts: list[list[int]], tokens: list[str] | None,
                  **args) -> list[float]:
    engine = InProcessEngine(model=model_dir, runner="pooling", classifier_from_token=tokens,
                             max_batch_size=4, block_size=4, max_num_batched_tokens=24,
                             max_num_tokens=2048, **args)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.run({0: [(f"r{i}", p, sampling) for i, p in enumerate(prompts)]})
    return [float(np.frombuffer(engine.embeddings[f"r{i}"], dtype=np.float32)[0])
            for i in range(len(prompts))]


PROMPTS = [list(range(5 + 7 * i, 8 + 16 * i)) for i in range(5)]  # 3 to 67 tokens


@pytest.mark.parametrize("tied", [False, True])
def test_scores_equal_transformers_logits(tmp_path, tied):
    """Two tokens (yes against no) and one; an LM head of its own, and one tied to the
    embeddings (Qwen3-Reranker-0.6B's), in prompts chunked over steps."""
    save_random_checkpoint(str(tmp_path), "qwen3", seed=5, head_dim=32,
                           tie_word_embeddings=tied)
    ids = [load_tokenizer(str(tmp_path)).convert_tokens_to_ids(t) for t in TOKENS]
    for tokens, token_ids in ((TOKENS, ids), (TOKENS[1:], ids[1:])):
        got = engine_scores(str(tmp_path), PROMPTS, tokens)  # (the logits: no sigmoid)
        np.testing.assert_allclose(got, hf_scores(str(tmp_path), PROMPTS, token_ids, False),
                                   rtol=1e-5, atol=1e-5)
    assert len(set(np.round(got, 6))) == len(PROMPTS)  # (scores that tell prompts apart)


@pytest.mark.gpu
def test_scores_equal_transformers_on_gpu_fp32(tmp_path):
    save_random_checkpoint(str(tmp_path), "qwen3", seed=5, head_dim=32, tie_word_embeddings=True)
    ids = [load_tokenizer(str(tmp_path)).convert_tokens_to_ids(t) for t in TOKENS]
    got = engine_scores(str(tmp_path), PROMPTS, TOKENS, device="cuda", dtype="float32")
    np.testing.assert_allclose(got, hf_scores(str(tmp_path), PROMPTS, ids, False), rtol=1e-4,
                               atol=1e-4)


def save_sequence_classifier(path, model_type: str, labels: list[str] | None = None) -> None:
    """A random *ForSequenceClassification checkpoint (as rerankers converted to one are
    published; one label unless `labels` are given) in path/cls, with the byte tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    save_random_checkpoint(str(path / "lm"), model_type, seed=5, head_dim=32)
    labels = labels or ["LABEL_0"]
    config = AutoConfig.from_pretrained(str(path / "lm"), num_labels=len(labels),
                                        id2label=dict(enumerate(labels)))
    torch.manual_seed(6)
    model = AutoModelForSequenceClassification.from_config(config)
    model.score.weight.data.normal_(0.0, 1.0)  # (logits that tell prompts apart)
    model.save_pretrained(str(path / "cls"))
    load_tokenizer(str(path / "lm")).save_pretrained(str(path / "cls"))


def hf_classifier_logits(model_dir: str, prompts: list[list[int]]) -> np.ndarray:
    """[prompts, labels]: transformers' logits at each prompt's last token."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return np.array([model(torch.tensor([p])).logits[0].tolist() for p in prompts])


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gemma3_text"])
def test_a_sequence_classifier_scores_with_its_own_head_as_transformers(tmp_path, model_type):
    """Qwen3ForSequenceClassification (a converted Qwen3-Reranker's architecture), Llama's
    and Gemma3TextForSequenceClassification: the logit of the `score` head at the last
    token, in fp32."""
    save_sequence_classifier(tmp_path, model_type)
    got = engine_scores(str(tmp_path / "cls"), PROMPTS, None)
    want = hf_classifier_logits(str(tmp_path / "cls"), PROMPTS)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(set(np.round(want, 4))) == len(PROMPTS)


def test_a_sequence_classifier_scores_pairs_only_with_one_label(tmp_path):
    from engine_actors.checkpoint import model_info
    from engine_actors.config import EngineConfig
    save_sequence_classifier(tmp_path, "qwen3")
    model = str(tmp_path / "cls")
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification is a sequence "
                                         "classifier: serve it with runner: pooling"):
        model_info(EngineConfig.from_args({"model": model}))
    with pytest.raises(ValueError, match="classifier_from_token is for a causal LM"):
        model_info(EngineConfig.from_args({"model": model, "runner": "pooling",
                                           "classifier_from_token": TOKENS}))
    one = model_info(EngineConfig.from_args({"model": model, "runner": "pooling"}))
    assert one.scores and one.labels == ("LABEL_0",)
    save_sequence_classifier(tmp_path / "two", "qwen3", ["no", "yes"])
    two = model_info(EngineConfig.from_args({"model": str(tmp_path / "two" / "cls"),
                                             "runner": "pooling"}))
    assert not two.scores and two.labels == ("no", "yes")  # (/classify only)
    from transformers import Gemma3Config  # multimodal: its text model is not classified
    Gemma3Config(architectures=["Gemma3ForSequenceClassification"]).save_pretrained(
        str(tmp_path / "vision"))
    with pytest.raises(ValueError, match="'Gemma3ForSequenceClassification' is not supported"):
        model_info(EngineConfig.from_args({"model": str(tmp_path / "vision"),
                                           "runner": "pooling"}))


def test_a_classifier_head_that_cannot_be_served_is_refused_as_it_loads():
    from engine_actors.pooling import Pooling, keep_classifier
    with pytest.raises(ValueError, match="2 rows for the config's 3 labels"):
        keep_classifier(Pooling(normalize=False, num_labels=3), "score.weight",
                        torch.zeros(2, 8), False, torch.device("cpu"))
    with pytest.raises(ValueError, match="float8_e4m3fn: a quantized head is not served"):
        keep_classifier(Pooling(normalize=False, num_labels=3), "score.weight",
                        torch.zeros(3, 8, dtype=torch.float8_e4m3fn), False,
                        torch.device("cpu"))


def test_a_token_that_is_not_in_the_vocabulary_is_refused_at_start(tmp_path):
    save_random_checkpoint(str(tmp_path), "llama", seed=3)
    with pytest.raises(ValueError, match="'yes' is not one token"):
        InProcessEngine(model=str(tmp_path), runner="pooling",
                        classifier_from_token=["n", "yes"], max_num_tokens=2048)
    with pytest.raises(ValueError, match="with runner pooling"):
        InProcessEngine(model=str(tmp_path), classifier_from_token=["n", "y"])


# ---- through HTTP --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(runner="pooling", classifier_from_token=TOKENS))
    stop_app()


def pair_ids(a: str, b: str) -> list[int]:
    """vLLM's: the two texts joined, encoded as one (with the tokenizer's special tokens)."""
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL)).encode(a + b)


def test_score_and_rerank_equal_transformers(url):
    path = resolve_model_path(DEFAULT_MODEL)
    token_ids = [load_tokenizer(path).convert_tokens_to_ids(t) for t in TOKENS]
    query, docs = "orca whales", ["killer whale facts", "a recipe for bread", "orcas hunt"]
    refs = hf_scores(path, [pair_ids(query, d) for d in docs], token_ids)
    one_to_many = httpx.post(f"{url}/v1/score", timeout=60,
                             json={"text_1": query, "text_2": docs}).json()
    assert one_to_many.get("object") == "list", one_to_many
    assert one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], refs, rtol=1e-5)
    tokens = sum(len(pair_ids(query, d)) for d in docs)
    assert one_to_many["usage"]["prompt_tokens"] == one_to_many["usage"]["total_tokens"] == tokens
    raw = httpx.post(f"{url}/v1/score", timeout=60,
                     json={"text_1": query, "text_2": docs, "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in raw["data"]], hf_scores(
        path, [pair_ids(query, d) for d in docs], token_ids, activation=False), rtol=1e-5,
        atol=1e-5)
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        named = httpx.post(f"{url}/v1/score", timeout=60,  # vLLM's other names for the sides
                           json={first: [query], second: docs}).json()
        np.testing.assert_allclose([d["score"] for d in named["data"]], refs, rtol=1e-5)
    many = httpx.post(f"{url}/score", timeout=60,
                      json={"text_1": [query, docs[0]], "text_2": [docs[0], query]}).json()
    ref_many = hf_scores(path, [pair_ids(query, docs[0]), pair_ids(docs[0], query)], token_ids)
    np.testing.assert_allclose([d["score"] for d in many["data"]], ref_many, rtol=1e-5)
    ranked = httpx.post(f"{url}/v1/rerank", timeout=60,
                        json={"query": query, "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -refs[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]],
                               [refs[i] for i in order], rtol=1e-5)
    assert ranked["usage"]["total_tokens"] == tokens
    for top_n in ({}, {"top_n": 0}, {"top_n": -1}):  # (vLLM's: all of them)
        every = httpx.post(f"{url}/v2/rerank", timeout=60,
                           json={"query": query, "documents": docs, **top_n}).json()
        assert [r["index"] for r in every["results"]] == sorted(range(3), key=lambda i: -refs[i])


def test_pooling_gives_a_rerankers_score_of_each_input(url):
    """vLLM's /pooling on a reranker: [the sigmoid of its logit] per input (a prompt the
    client formatted), or the logit itself with use_activation false."""
    path = resolve_model_path(DEFAULT_MODEL)
    token_ids = [load_tokenizer(path).convert_tokens_to_ids(t) for t in TOKENS]
    prompts = [pair_ids("orca whales", "orcas hunt"), pair_ids("orca", "bread")]
    for activation in (True, False):
        r = httpx.post(f"{url}/pooling", timeout=60,
                       json={"input": prompts, "use_activation": activation})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["data"] for d in r.json()["data"]],
                                   [[s] for s in hf_scores(path, prompts, token_ids, activation)],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "invalid_value"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1", "invalid_value"),
    ("/v1/score", {"text_1": "a"}, "text_2", "invalid_value"),
    ("/v1/score", {"text_1": "a", "documents": ["b"]}, "text_2", "invalid_value"),
    ("/v1/score", {"queries": ["a", "b"], "items": ["a", "b", "c"]}, "items", "invalid_value"),
    ("/v1/score", {"text_1": "a", "text_2": "x" * 5000}, "text_2", "context_length_exceeded"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents", "invalid_value"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": "x"}, "top_n", None),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", "invalid_value"),
    ("/v1/embeddings", {"input": "a"}, None, "unsupported_task"),
    ("/v1/completions", {"prompt": "a"}, None, "unsupported_runner"),
])
def test_bad_score_requests_get_400(url, path, body, param, code):
    res = httpx.post(f"{url}{path}", timeout=60, json=body)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["message"] and error["param"] == param
    assert code is None or error["code"] == code


def test_a_pair_is_its_texts_joined_and_encoded_once(monkeypatch):
    """vLLM's prompt for a causal LM made a reranker: one BOS (a tokenizer whose pair
    template adds one per text, as Llama 3's, would put a second mid-prompt), and the seam
    tokenized as in one text."""
    import asyncio
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from deployments import score_api
    vocab = {"<s>": 0, "ab": 1, "a": 2, "b": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="<s>", max_input_chars_per_word=9))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    sent = []

    async def run_pooling(frontend, requests, param):
        sent.extend(r.prompt_token_ids for r in requests)
        return [np.float32(0.0).tobytes()] * len(requests)  # a logit of 0: a score of 0.5

    async def ready():
        return SimpleNamespace(max_model_len=64, config={})

    async def tokenize(fn, chars):
        return fn(tokenizer)

    monkeypatch.setattr(score_api, "run_pooling", run_pooling)
    frontend = SimpleNamespace(ready=ready, tokenize=tokenize, refuse_over_queue=lambda *a: None)
    req = score_api.ScoreRequest(text_1="a", text_2="b")
    scores, num_tokens = asyncio.run(score_api.ScoreAPI(frontend)._scores(req, req.pairs(),
                                                                          "text_2"))
    assert sent == [[0, 1]] and scores == [0.5] and num_tokens == 2
