"""A sequence classifier (`*ForSequenceClassification`, runner pooling): its head's logits
equal transformers' in fp32, and POST /classify answers as vLLM's (probabilities, the
likeliest label)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from engine_actors.checkpoint import load_tokenizer
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine
from tests.test_score import PROMPTS, hf_classifier_logits, save_sequence_classifier

pytestmark = pytest.mark.own_server  # conftest runs these modules last

LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("classifier")
    save_sequence_classifier(path, "llama", LABELS)
    return str(path / "cls")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def engine_logits(model: str, device: str = "cpu") -> tuple[InProcessEngine, np.ndarray]:
    engine = InProcessEngine(device, model=model, runner="pooling", max_batch_size=4,
                             block_size=4, max_num_batched_tokens=24, max_num_tokens=2048,
                             dtype="float32")
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.run({0: [(f"r{i}", p, sampling) for i, p in enumerate(PROMPTS)]})
    return engine, np.array([np.frombuffer(engine.embeddings[f"r{i}"], dtype=np.float32)
                             for i in range(len(PROMPTS))])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_labels_logit_equals_transformers(classifier, device):
    engine, got = engine_logits(classifier, device)
    want = hf_classifier_logits(classifier, PROMPTS)
    assert got.shape == want.shape == (len(PROMPTS), len(LABELS))
    assert engine.worker.runner.model.lm_head is None  # (untied: its memory went to KV)
    tolerance = 1e-5 if device == "cpu" else 1e-4  # (GPU kernels sum in another order)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def test_two_labels_are_two_logits_not_a_difference(tmp_path):
    """(classifier_from_token's two tokens give logit(yes) - logit(no); two labels do not)"""
    save_sequence_classifier(tmp_path, "qwen3", ["no", "yes"])
    _, got = engine_logits(str(tmp_path / "cls"))
    np.testing.assert_allclose(got, hf_classifier_logits(str(tmp_path / "cls"), PROMPTS),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("problem_type", [None, "single_label_classification",
                                          "multi_label_classification", "regression"])
def test_probabilities_follow_the_checkpoints_problem_type_as_vllm(problem_type):
    import torch

    from deployments.classify_api import activation
    logits = np.array([[2.0, -1.0, 0.5], [0.0, 3.0, -2.0]])
    want = {"regression": torch.tensor(logits),
            "multi_label_classification": torch.sigmoid(torch.tensor(logits))}.get(
        problem_type, torch.softmax(torch.tensor(logits), -1)).numpy()
    np.testing.assert_allclose(activation(logits, problem_type), want, rtol=1e-12)
    one = np.array([[0.3], [-2.0]])  # one label: a sigmoid unless regression
    np.testing.assert_allclose(activation(one, problem_type), one if problem_type ==
                               "regression" else torch.sigmoid(torch.tensor(one)).numpy())


# ---- through HTTP --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(classifier):
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(model=classifier, runner="pooling"))
    stop_app()


def test_classify_gives_transformers_probabilities_and_the_likeliest_label(url, classifier):
    texts = ["orcas hunt in pods", "bread", "a long day at sea, and then another one"]
    tokenizer = load_tokenizer(classifier)
    logits = hf_classifier_logits(classifier, [tokenizer.encode(t) for t in texts])
    assert len({int(np.argmax(row)) for row in logits}) > 1  # (labels that differ)
    r = httpx.post(f"{url}/classify", json={"input": texts}, timeout=60)
    body = r.json()
    assert r.status_code == 200, body
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], softmax(logits), rtol=1e-5,
                               atol=1e-5)
    assert [d["label"] for d in body["data"]] == [LABELS[int(np.argmax(x))] for x in logits]
    assert {d["num_classes"] for d in body["data"]} == {3}
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0, "prompt_tokens_details": None}
    raw = httpx.post(f"{url}/v1/classify", timeout=60,
                     json={"input": tokenizer.encode(texts[0]), "use_activation": False})
    assert raw.status_code == 200, raw.text
    np.testing.assert_allclose(raw.json()["data"][0]["probs"], logits[0], rtol=1e-5,
                               atol=1e-5)


def test_pooling_gives_a_classifiers_probabilities_or_its_logits(url, classifier):
    texts = ["orcas hunt in pods", "bread"]
    tokenizer = load_tokenizer(classifier)
    logits = hf_classifier_logits(classifier, [tokenizer.encode(t) for t in texts])
    r = httpx.post(f"{url}/pooling", json={"input": texts}, timeout=60)
    body = r.json()
    assert r.status_code == 200, body
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose([d["data"] for d in body["data"]], softmax(logits), rtol=1e-5,
                               atol=1e-5)
    raw = httpx.post(f"{url}/pooling", json={"input": texts, "use_activation": False},
                     timeout=60).json()
    np.testing.assert_allclose([d["data"] for d in raw["data"]], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path,body,param,code", [
    ("/classify", {"input": []}, "input", "invalid_value"),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "invalid_value"),
    ("/classify", {"input": "x" * 5000}, "input", None),  # longer than the context
    ("/v1/score", {"text_1": "a", "text_2": "b"}, None, "unsupported_task"),  # 3 labels
    ("/v1/embeddings", {"input": "a"}, None, "unsupported_task"),
    ("/v1/completions", {"prompt": "a"}, None, "unsupported_runner"),
])
def test_bad_classify_requests_and_other_tasks_get_400(url, path, body, param, code):
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert code is None or error["code"] == code, r.text
