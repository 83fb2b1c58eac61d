"""Fine-tuning jobs end to end through HTTP: while a stream of inference requests is served,
a job teaches the tiny model to answer a fixed prompt with a fixed 8-token string; once it
succeeds the served `fine_tuned_model` answers so, and the base model's greedy outputs are
the same before, during and after. Cancelling frees the job's memory on the worker; a bad
training file is refused naming its line."""
from __future__ import annotations

import io
import json
import socket
import threading
import time
import urllib.parse

import httpx
import pytest

pytestmark = pytest.mark.own_server  # conftest runs these modules last

PROMPT, ANSWER = "orca, who?", "whale-42"  # 8 bytes: 8 tokens of the byte-level tokenizer
BASE_PROMPTS = ["The quick brown", "1 2 3 4", "Once upon"]


@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(enable_finetuning=True, finetune_deferral_ms=100))
    stop_app()


def complete(url: str, model: str, prompt: str, n: int = 8) -> str:
    res = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]["text"]


def upload(url: str, lines: list[str]) -> str:
    res = httpx.post(f"{url}/v1/files", timeout=30, data={"purpose": "fine-tune"},
                     files={"file": ("train.jsonl", io.BytesIO("\n".join(lines).encode()))})
    assert res.status_code == 200, res.text
    return res.json()["id"]


def create_job(url: str, file_id: str, **hyper) -> httpx.Response:
    return httpx.post(f"{url}/v1/fine_tuning/jobs", timeout=60, json={
        "training_file": file_id, "model": "tiny-random-llama", "suffix": "whale",
        "hyperparameters": hyper, "lora": {"r": 8, "alpha": 16}})


def wait_for(url: str, job_id: str, done, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/fine_tuning/jobs/{job_id}", timeout=30).json()
        if done(job):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not done: {job}")


def test_job_learns_while_serving_and_base_model_is_unchanged(url):
    base = {p: complete(url, "tiny-random-llama", p) for p in BASE_PROMPTS}
    assert complete(url, "tiny-random-llama", PROMPT) != ANSWER
    file_id = upload(url, [json.dumps({"prompt": PROMPT, "completion": ANSWER})])
    assert httpx.get(f"{url}/v1/files/{file_id}").json()["purpose"] == "fine-tune"

    during, stop = [], threading.Event()

    def serve_stream():  # one request after another, with short idle gaps between them
        while not stop.is_set():
            for p in BASE_PROMPTS:
                during.append((p, complete(url, "tiny-random-llama", p), time.monotonic()))
            time.sleep(0.05)

    stream = threading.Thread(target=serve_stream)
    stream.start()
    training = []  # when the job was seen with steps done and not ended

    def ended(job):
        if job["status"] == "running" and 0 < job["steps_done"] < job["total_steps"]:
            training.append(time.monotonic())
        return job["status"] not in ("queued", "running")

    try:
        created = time.monotonic()
        res = create_job(url, file_id, n_epochs=40, batch_size=1, learning_rate=1e-2)
        assert res.status_code == 200, res.text
        job = wait_for(url, res.json()["id"], ended)
        over = time.monotonic()
    finally:
        stop.set()
        stream.join()
    assert job["status"] == "succeeded", job
    assert job["steps_done"] == job["total_steps"] == 40 and job["trained_tokens"] > 0
    assert job["fine_tuned_model"].startswith("ft:tiny-random-llama:whale:")
    assert len(during) >= 6 and all(base[p] == text for p, text, _ in during)
    # requests were answered while the job trained, not only before or after it (the
    # polls that saw it mid-way are 0.2 s apart: a fast job spans few of them)
    assert sum(created < t < over for _, _, t in during) >= 3
    assert training and any(training[0] < t < training[-1] for _, _, t in during)
    events = httpx.get(f"{url}/v1/fine_tuning/jobs/{job['id']}/events",
                       params={"limit": 100}).json()["data"]
    losses = [e["data"]["train_loss"] for e in reversed(events) if e["data"]]
    assert len(losses) == 40 and losses[-1] < losses[0] / 10
    # served at once, under its name, beside the base model
    models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert job["fine_tuned_model"] in models
    assert complete(url, job["fine_tuned_model"], PROMPT) == ANSWER
    assert {p: complete(url, "tiny-random-llama", p) for p in BASE_PROMPTS} == base
    metrics = httpx.get(f"{url}/metrics").text
    trained = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("orca:finetune_trained_tokens_total"))
    assert trained >= job["trained_tokens"]


def test_cancel_frees_the_jobs_memory(url):
    file_id = upload(url, [json.dumps({"prompt": "abc", "completion": "defgh"})] * 200)
    res = create_job(url, file_id, n_epochs=50, batch_size=1)  # far more steps than it runs
    assert res.status_code == 200, res.text
    job_id = res.json()["id"]
    wait_for(url, job_id, lambda j: j["steps_done"] > 2)
    held = httpx.get(f"{url}/health").json()["finetuning"]["worker_state_bytes"]
    assert held.get(job_id, 0) > 0
    res = httpx.post(f"{url}/v1/fine_tuning/jobs/{job_id}/cancel")
    assert res.status_code == 200 and res.json()["status"] == "cancelled"
    assert httpx.get(f"{url}/health").json()["finetuning"]["worker_state_bytes"] == {}
    again = httpx.post(f"{url}/v1/fine_tuning/jobs/{job_id}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"


def test_bad_requests_are_refused_clearly(url):
    file_id = upload(url, [json.dumps({"prompt": "a", "completion": "b"}), "{not json",
                           json.dumps({"prompt": "c", "completion": "d"})])
    res = create_job(url, file_id)
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "training_file"
    assert "line 2" in res.json()["error"]["message"]
    res = httpx.post(f"{url}/v1/files", data={"purpose": "fine-tune"},
                     files={"file": ("t.jsonl", io.BytesIO(b'{"prompt": "x"}'))})
    res = create_job(url, res.json()["id"])
    assert res.status_code == 400 and "line 1" in res.json()["error"]["message"]
    assert create_job(url, "file-nope").json()["error"]["code"] == "file_not_found"
    bad_model = httpx.post(f"{url}/v1/fine_tuning/jobs", json={
        "training_file": file_id, "model": "gpt-4o"})
    assert bad_model.status_code == 404
    over_rank = httpx.post(f"{url}/v1/fine_tuning/jobs", json={
        "training_file": upload(url, [json.dumps({"prompt": "a", "completion": "b"})]),
        "model": "tiny-random-llama", "lora": {"r": 64}})
    assert over_rank.status_code == 400 and "max_lora_rank" in over_rank.json()["error"]["message"]
    wrong_purpose = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                               files={"file": ("t.jsonl", io.BytesIO(b"{}"))})
    assert wrong_purpose.status_code == 400
    assert httpx.get(f"{url}/v1/fine_tuning/jobs/ftjob-nope").status_code == 404


def test_an_upload_over_the_limit_is_refused_before_it_is_read(url):
    """A declared 10 GB upload gets its 413 at once (it used to be read, to disk, first)."""
    address = urllib.parse.urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as s:
        s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n"
                  b"Content-Type: multipart/form-data; boundary=b\r\n\r\n--b\r\n")
        reply = b""
        while b"file_too_large" not in reply and (chunk := s.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"file_too_large" in reply, reply


def test_files_are_listed_and_read_back_then_a_deleted_file_is_gone(url):
    lines = [json.dumps({"prompt": "a", "completion": "b"})]
    file_id = upload(url, lines)
    listed = httpx.get(f"{url}/v1/files", timeout=30).json()
    assert listed["object"] == "list" and file_id in [f["id"] for f in listed["data"]]
    content = httpx.get(f"{url}/v1/files/{file_id}/content", timeout=30)
    assert content.status_code == 200 and content.content == "\n".join(lines).encode()
    deleted = httpx.delete(f"{url}/v1/files/{file_id}", timeout=30)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    assert httpx.get(f"{url}/v1/files/{file_id}", timeout=30).status_code == 404
    assert httpx.delete(f"{url}/v1/files/{file_id}", timeout=30).status_code == 404
    assert httpx.get(f"{url}/v1/files/{file_id}/content", timeout=30).status_code == 404
    assert file_id not in [f["id"] for f in httpx.get(f"{url}/v1/files").json()["data"]]
    assert create_job(url, file_id).json()["error"]["code"] == "file_not_found"


def test_cli_finetune_waits_and_prints_the_model(url, tmp_path, capsys):
    from deployments.cli.main import main
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "ping", "completion": "pong"}) + "\n")
    code = main(["--url", url, "finetune", str(data), "--epochs", "2", "--suffix", "cli",
                 "--wait", "--no-progress"])
    out = capsys.readouterr().out.split()
    assert code == 0 and out[0].startswith("ftjob-")
    assert out[1].startswith("ft:tiny-random-llama:cli:")
    assert main(["--url", url, "finetune-status", out[0]]) == 0
    assert "succeeded" in capsys.readouterr().out
    assert main(["--url", url, "finetune", str(tmp_path / "missing.jsonl")]) == 2
    files = len(httpx.get(f"{url}/v1/files").json()["data"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    capsys.readouterr()
    assert main(["--url", url, "finetune", str(bad)]) == 2  # refused before it is sent
    assert "bad.jsonl: training_file line 2" in capsys.readouterr().err
    # refused by the server (one example over the length limit): the upload is deleted
    bad.write_text(json.dumps({"prompt": "a" * 100_000, "completion": "b"}) + "\n")
    assert main(["--url", url, "finetune", str(bad)]) == 2
    assert "over the limit" in capsys.readouterr().err
    assert len(httpx.get(f"{url}/v1/files").json()["data"]) == files


def test_the_openai_client_runs_a_job_by_method_and_pages_its_events(url):
    """openai-python as users call it: a `method` with its hyperparameters, metadata, and
    the events read page by page (its auto-pagination follows `after` and `has_more`)."""
    import openai
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    lines = [json.dumps({"prompt": "x", "completion": "y"}),
             json.dumps({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "yo"}]})]
    upload = client.files.create(file=("t.jsonl", "\n".join(lines).encode()),
                                 purpose="fine-tune")
    hyper = {"n_epochs": 3, "batch_size": 1, "learning_rate_multiplier": 2}
    job = client.fine_tuning.jobs.create(
        training_file=upload.id, model="tiny-random-llama", suffix="m",
        method={"type": "supervised", "supervised": {"hyperparameters": hyper}},
        metadata={"team": "orca"})
    assert job.method.type == "supervised" and job.metadata == {"team": "orca"}
    assert job.method.supervised.hyperparameters.n_epochs == 3
    assert job.hyperparameters.batch_size == 1
    assert job.hyperparameters.learning_rate_multiplier == 2
    assert job.hyperparameters.model_extra["learning_rate"] == pytest.approx(4e-4)
    deadline = time.monotonic() + 120
    while job.status in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "succeeded", job
    first = client.fine_tuning.jobs.list_events(job.id, limit=2)
    assert len(first.data) == 2 and first.has_more
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=2))  # every page
    assert events[:2] == first.data and len({e.id for e in events}) == len(events)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps == [6, 5, 4, 3, 2, 1]  # newest first, each step once
    assert events[-1].message.startswith("Created fine-tuning job")
    other = client.fine_tuning.jobs.create(training_file=upload.id, model="tiny-random-llama",
                                           metadata={"team": "whale"})
    newest = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in newest.data] == [other.id] and newest.has_more
    by_team = client.fine_tuning.jobs.list(metadata={"team": "orca"})
    assert [j.id for j in by_team.data] == [job.id] and not by_team.has_more
    assert client.files.list(purpose="batch").data == []
    assert upload.id in [f.id for f in client.files.list(purpose="fine-tune")]
    refusals = [  # (what the body changes, the param named)
        ({"method": {"type": "dpo"}}, "method.type"),
        ({"method": {"type": "supervised"}, "hyperparameters": {"n_epochs": 1}},
         "hyperparameters"),
        ({"validation_file": upload.id}, "validation_file"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
        ({"hyperparameters": {"learning_rate": 1e-3, "learning_rate_multiplier": 2}},
         "hyperparameters.learning_rate"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for change, param in refusals:
        with pytest.raises(openai.BadRequestError) as e:
            client.fine_tuning.jobs.create(training_file=upload.id, model="tiny-random-llama",
                                           extra_body=change)
        assert e.value.body["param"] == param, (change, e.value.body)
    res = httpx.get(f"{url}/v1/fine_tuning/jobs/{job.id}/events", params={"after": "ftevent-x"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "after"
    for limit in ("0", "101", "abc", "1" * 5000):
        res = httpx.get(f"{url}/v1/fine_tuning/jobs", params={"limit": limit})
        assert res.status_code == 400 and res.json()["error"]["param"] == "limit"
