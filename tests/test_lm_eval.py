"""lm-evaluation-harness against the server: a small multiple-choice task defined here (a
local JSON Lines file, no hub), scored by `local-completions` through echo + logprobs. Its
per-item log-likelihoods and choices equal those computed from transformers' logits."""
from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")  # a test extra

from engine_actors.checkpoint import resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from tests.engine_harness import hf_model  # noqa: E402

QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "a banana", "42"], 0),
    ("Two plus two equals", ["four", "five", "seven"], 0),
    ("The sky is usually", ["blue", "green", "made of cheese"], 0),
    ("Water boils at a temperature of", ["100 degrees", "cold", "Tuesday", "no"], 0),
    ("A cat says", ["meow", "woof"], 0),
    ("The opposite of up is", ["down", "sideways", "left", "purple"], 0),
]
TASK = """task: orca_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def hf_loglikelihood(tokenizer, context: str, continuation: str) -> float:
    """Sum of the continuation tokens' log-probabilities, as lm-eval tokenizes them."""
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    with torch.no_grad():
        logits = hf_model(resolve_model_path(DEFAULT_MODEL))(torch.tensor([ctx + cont])).logits
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    return sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_lm_eval_multiple_choice_matches_transformers(url, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "orca_mc.yaml").write_text(TASK.format(data=data))
    path = resolve_model_path(DEFAULT_MODEL)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/v1/completions", "model": DEFAULT_MODEL,
                    "tokenizer_backend": "huggingface", "tokenizer": path,
                    "num_concurrent": 2, "max_retries": 1, "batch_size": 4},
        tasks=["orca_mc"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, cache_requests=False)
    samples = results["samples"]["orca_mc"]
    assert len(samples) == len(QUESTIONS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for sample in samples:
        got = [float(r[0]) for r in sample["filtered_resps"]]
        want = [hf_loglikelihood(tokenizer, *arg) for arg in sample["arguments"]]
        assert got == pytest.approx(want, abs=1e-3)
        assert max(range(len(got)), key=got.__getitem__) == \
            max(range(len(want)), key=want.__getitem__)
    assert "acc,none" in results["results"]["orca_mc"]
