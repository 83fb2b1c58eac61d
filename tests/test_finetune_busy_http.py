"""Fine-tuning beside requests that never stop (finetune_busy_share), end to end through
HTTP and the real workers: two clients keep requests running nearly all the time, so
FineInfer's rule alone would find few idle moments; the job trains in pieces between their steps,
succeeds, and its model answers the fixed prompt with the fixed string, while the base
model's greedy outputs stay the same."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.test_finetune_http import ANSWER, BASE_PROMPTS, PROMPT, complete, create_job, \
    upload, wait_for

pytestmark = pytest.mark.own_server  # conftest runs these modules last


@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    # a bound no step fits in: FineInfer's rule never holds a request for training
    yield start_app(app_config(enable_finetuning=True, finetune_deferral_ms=0.001,
                               finetune_busy_share=0.5))
    stop_app()


def test_a_job_trains_in_pieces_while_requests_always_run(url):
    base = {p: complete(url, "tiny-random-llama", p, n=32) for p in BASE_PROMPTS}
    file_id = upload(url, [json.dumps({"prompt": PROMPT, "completion": ANSWER})])
    stop, during = threading.Event(), []

    def client(prompts):  # back to back: a request of 32 tokens always runs
        while not stop.is_set():
            for p in prompts:
                during.append((p, complete(url, "tiny-random-llama", p, n=32)))

    clients = [threading.Thread(target=client, args=(BASE_PROMPTS[i::2],)) for i in range(2)]
    for c in clients:
        c.start()
    try:
        time.sleep(0.5)
        res = create_job(url, file_id, n_epochs=40, batch_size=1, learning_rate=1e-2)
        assert res.status_code == 200, res.text
        job = wait_for(url, res.json()["id"], lambda j: j["status"] not in ("queued", "running"))
        health = httpx.get(f"{url}/health", timeout=30).json()["finetuning"]
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert job["status"] == "succeeded", job
    assert job["steps_done"] == 40
    # mostly in pieces (a micro-batch of the tiny model is three: forward, head, backward;
    # the others ran whole, in the moments between two clients' requests)
    assert health["busy_pieces"] >= 3 * 20
    assert len(during) >= 10 and all(base[p] == text for p, text in during)
    assert complete(url, job["fine_tuned_model"], PROMPT) == ANSWER
    assert {p: complete(url, "tiny-random-llama", p, n=32) for p in BASE_PROMPTS} == base
