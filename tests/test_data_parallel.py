"""data_parallel_size 2 through HTTP: two engines, each its own scheduler, workers and KV
cache, behind one application (deployments/engines.py)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_actors.checkpoint import save_random_llama
from engine_actors.config import EngineConfig
from engine_actors.scheduler_actor import NAMESPACE, actor_name
from tests.serve_fixture import app_config, start_app, stop_app, wait_healthy, wait_idle
from tests.test_lora import peft_greedy, save_adapter
from tests.test_stored_responses import poll

pytestmark = pytest.mark.own_server  # conftest runs these modules last
pytest.importorskip("peft")
MODEL = "dp-base"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    base, adapter = str(root / "base"), str(root / "adapter")
    save_random_llama(base, seed=8)
    save_adapter(base, adapter, 4, 8, ["q_proj", "v_proj", "down_proj"], seed=9)
    return base, adapter


def app_args(models) -> dict:
    return app_config(model=models[0], served_model_name=MODEL, enable_lora=True,
                      data_parallel_size=2, num_cpus_per_worker=0.5,
                      dtype="float32")["args"]  # (on GPUs too: greedy parity)


@pytest.fixture(scope="module")
def url(models):
    url = start_app({**app_config(), "args": app_args(models)})
    yield url
    stop_app()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def finished_per_engine(url: str) -> dict[str, float]:
    """orca:request_finished_total of each engine, all finish reasons."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "orca:request_finished_total":
                counts[s.labels["engine"]] = counts.get(s.labels["engine"], 0) + s.value
    return counts


def test_both_engines_serve_transformers_greedy_tokens(client, url, models):
    prompts = [[(11 * i + j) % 256 for j in range(5 + 7 * i)] for i in range(8)]
    before = finished_per_engine(url)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                       extra_body={**NO_EOS, "return_token_ids": True})
            for p in prompts])

    results = asyncio.run(run())
    for p, res in zip(prompts, results):
        assert res.choices[0].token_ids == peft_greedy(models[0], None, p, 6)
    after = finished_per_engine(url)
    served = {e: after[e] - before.get(e, 0) for e in after}
    assert set(served) == {"0", "1"} and min(served.values()) >= 2, served
    health = wait_idle(url)
    assert health["data_parallel_size"] == 2 and len(health["engines"]) == 2
    assert health["num_blocks"] == sum(e["num_blocks"] for e in health["engines"])
    assert health["num_free_blocks"] == health["num_blocks"]


def test_a_conversation_stays_on_the_engine_that_has_its_prefix(client, url):
    """Turns sent one after another: round robin would alternate the two idle engines."""
    wait_idle(url)
    before = finished_per_engine(url)
    prompt = [(5 * j + 3) % 256 for j in range(80)]
    for turn in range(4):
        res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                        temperature=0, extra_body={**NO_EOS,
                                                                   "return_token_ids": True})
        prompt = prompt + res.choices[0].token_ids + [7, 8, 9]
    after = finished_per_engine(url)
    served = sorted(after[e] - before.get(e, 0) for e in after)
    assert served == [0, 4], served


def test_background_responses_cancelled_stop_on_either_engine(client, url):
    """The stored responses live with the first engine; a cancel ends the requests that
    the second one runs too."""
    before = wait_idle(url)
    ids = [client.responses.create(model=MODEL, input=f"go on {i}", max_output_tokens=3000,
                                   background=True, extra_body=NO_EOS).id for i in range(2)]
    for response_id in ids:
        poll(client, response_id, ("in_progress",))
    running = [e["num_requests"] for e in httpx.get(f"{url}/health", timeout=30).json()["engines"]]
    assert running == [1, 1]  # one on each engine
    for response_id in ids:
        assert client.responses.cancel(response_id).status == "cancelled"
    after = wait_idle(url, timeout=30)
    steps = [a["num_steps"] - b["num_steps"] for a, b in zip(after["engines"], before["engines"])]
    assert max(steps) < 2500, steps  # neither ran its 3,000 tokens
    time.sleep(0.5)
    assert [client.responses.retrieve(i).status for i in ids] == ["cancelled"] * 2


def test_an_adapter_loads_and_unloads_on_every_engine(url, models):
    base, adapter = models
    r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "tuned", "lora_path": adapter})
    assert r.status_code == 200, r.text
    prompts = [[(13 * i + j) % 256 for j in range(6 + 5 * i)] for i in range(6)]
    before = finished_per_engine(url)

    async def run(model):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}) for p in prompts])

    for p, r in zip(prompts, asyncio.run(run("tuned"))):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == peft_greedy(base, adapter, p, 5)
    after = finished_per_engine(url)
    assert min(after[e] - before.get(e, 0) for e in ("0", "1")) >= 2
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tuned"}, timeout=60)
    assert r.status_code == 200, r.text
    assert [r.status_code for r in asyncio.run(run("tuned"))] == [404] * len(prompts)


def test_stored_responses_and_conversations_are_the_first_engines(client):
    """Every replica reads them from the first engine, whichever engine runs a turn."""
    first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3,
                                    temperature=0, extra_body=NO_EOS)
    nxt = client.responses.create(model=MODEL, input="More.", max_output_tokens=2,
                                  previous_response_id=first.id, extra_body=NO_EOS)
    assert nxt.usage.input_tokens > first.usage.input_tokens + 3
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi."}])
    client.responses.create(model=MODEL, input="Go.", max_output_tokens=2,
                            conversation=conversation.id, extra_body=NO_EOS)
    items = client.conversations.items.list(conversation.id).data
    assert len(items) == 3  # its first item, the turn's input and its output


def batch_results(url: str, batch_id: str) -> list[dict]:
    with httpx.stream("GET", f"{url}/orca/v1/batches/{batch_id}/results", timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return sorted((json.loads(line[6:]) for line in lines[:-1]), key=lambda x: x["index"])


def test_a_batch_is_shared_out_over_both_engines(url, models):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    wait_idle(url)
    prompts = [[(17 * i + j) % 256 for j in range(4 + 3 * i)] for i in range(6)]
    before = finished_per_engine(url)
    batch = httpx.post(f"{url}/orca/v1/batches", timeout=30, json={"requests": [
        {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        for p in prompts]}).json()
    assert batch["num_requests"] == 6
    results = batch_results(url, batch["id"])
    assert [x["index"] for x in results] == list(range(6))
    for p, x in zip(prompts, results):
        assert x["text"] == tokenizer.decode(peft_greedy(models[0], None, p, 5))
    after = finished_per_engine(url)
    assert [after[e] - before.get(e, 0) for e in ("0", "1")] == [3, 3]
    status = httpx.get(f"{url}/orca/v1/batches/{batch['id']}", timeout=30).json()
    assert (status["status"], status["num_requests"], status["num_completed"]) == \
        ("completed", 6, 6)
    # a cancel ends both engines' shares
    batch = httpx.post(f"{url}/orca/v1/batches", timeout=30, json={"requests": [
        {"prompt": [5] * 10, "max_tokens": 3000, "ignore_eos": True}] * 4}).json()
    cancelled = httpx.delete(f"{url}/orca/v1/batches/{batch['id']}", timeout=30).json()
    assert (cancelled["status"], cancelled["num_requests"]) == ("cancelled", 4)
    assert [x["finish_reason"] for x in batch_results(url, batch["id"])] == ["abort"] * 4
    wait_idle(url)


def test_an_engine_that_dies_fails_only_its_own_requests(url, models):
    import ray
    wait_idle(url)

    async def long(token: int) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await http.post("/v1/completions", json={
                "model": MODEL, "prompt": [token] * 20, "max_tokens": 600, "ignore_eos": True})

    async def scenario():
        tasks = [asyncio.create_task(long(token)) for token in (1, 2)]  # one on each engine
        await asyncio.sleep(1.0)
        second = actor_name(EngineConfig.from_args(app_args(models)), 1)
        ray.kill(ray.get_actor(second, namespace=NAMESPACE))
        return await asyncio.gather(*tasks)

    assert sorted(r.status_code for r in asyncio.run(scenario())) == [200, 503]
    for token in range(40, 44):  # the first engine serves them while the second restarts
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [token] * 20, "max_tokens": 2})
        assert r.status_code == 200, r.text
    health = wait_healthy(url)  # both engines again
    assert [e["state"] for e in health["engines"]] == ["ready", "ready"]
