"""LoRA adapters over HTTP: `model` picks an adapter, /v1/models lists them, adapters load
and unload at run time while requests run, and what cannot be served is refused clearly."""
from __future__ import annotations

import asyncio
import json
import pathlib

import httpx
import pytest

from engine_actors.checkpoint import save_random_llama
from tests.test_lora import altered_copy, peft_greedy, save_adapter

pytestmark = pytest.mark.own_server  # conftest runs these modules last

pytest.importorskip("peft")
BASE = "lora-base"
ALIAS = "lora-base-alias"  # served_model_name's second name (vLLM's several names)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    base = str(root / "base")
    save_random_llama(base, seed=6)
    generation = pathlib.Path(base) / "generation_config.json"  # (test_max_new_tokens_...)
    generation.write_text(json.dumps({**json.loads(generation.read_text()),
                                      "max_new_tokens": 5}))
    paths = {}
    for i, (name, rank, targets) in enumerate([
            ("sql", 4, ["q_proj", "v_proj", "down_proj"]),
            ("chat", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"]),
            ("code", 2, ["o_proj", "up_proj"]),
            ("huge", 16, ["q_proj"])]):
        paths[name] = str(root / name)
        save_adapter(base, paths[name], rank, 2 * rank, targets, seed=20 + i)
    # dynamic_lora_loading_path's directory: adapters loaded when a request names them
    for i, (name, rank, targets) in enumerate([("dyn", 4, ["q_proj", "v_proj"]),
                                               ("dyn2", 2, ["o_proj", "up_proj"]),
                                               ("dynhuge", 16, ["q_proj"])]):
        paths[name] = str(root / "dynamic" / name)
        save_adapter(base, paths[name], rank, 2 * rank, targets, seed=40 + i)
    (root / "dynamic" / "empty").mkdir()
    return base, paths


@pytest.fixture(scope="module")
def url(models):
    from tests.serve_fixture import app_config, start_app, stop_app
    base, paths = models
    yield start_app(app_config(model=base, served_model_name=[BASE, ALIAS], max_loras=2,
                               max_lora_rank=8, lora_modules={"sql": paths["sql"]},
                               dynamic_lora_loading_path=str(pathlib.Path(paths["dyn"]).parent)))
    stop_app()


def complete(url: str, model: str, prompt: list[int], n: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


async def stream_tokens(url: str, model: str, prompt: list[int], n: int,
                        first_token: asyncio.Event | None = None) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    tokens = []
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        tokens += choice.get("token_ids", [])
                        if tokens and first_token is not None:
                            first_token.set()
    return tokens


def test_model_picks_the_adapter_and_models_lists_them(url, models):
    base, paths = models
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == \
        [(BASE, None), (ALIAS, None), ("sql", BASE)]
    assert httpx.get(f"{url}/v1/models/sql", timeout=30).json()["root"] == paths["sql"]
    prompt = list(range(30, 52))
    for model, adapter in [(BASE, None), (ALIAS, None), ("sql", paths["sql"])]:
        res = complete(url, model, prompt, 8)
        assert res.status_code == 200, res.text
        assert res.json()["model"] == (BASE if model == ALIAS else model)  # (vLLM's)
        assert res.json()["choices"][0]["token_ids"] == peft_greedy(base, adapter, prompt, 8)
    again = complete(url, "sql", prompt, 8).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # its own prefix
    missing = complete(url, "nope", prompt, 8)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_while_requests_run(url, models):
    base, paths = models
    prompts = {name: [7 + i] * 5 + list(range(60, 80)) for i, name in
               enumerate(["sql", "chat", "code", BASE])}

    async def scenario():
        first = asyncio.Event()
        long_sql = asyncio.create_task(stream_tokens(url, "sql", prompts["sql"], 48, first))
        await first.wait()  # sql is running
        async with httpx.AsyncClient(timeout=60) as client:
            for name in ("chat", "code"):
                r = await client.post(f"{url}/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": paths[name]})
                assert r.status_code == 200 and "added" in r.text, r.text
            # three adapters for two slots, and the base model, all at once
            others = [asyncio.create_task(stream_tokens(url, m, prompts[m], 12))
                      for m in ("chat", "code", BASE, "chat")]
            r = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 200, r.text
            results = await asyncio.gather(*others)
        return await long_sql, results

    sql_tokens, (chat, code, plain, chat2) = asyncio.run(scenario())
    # the request admitted before the unload finishes with its adapter
    assert sql_tokens == peft_greedy(base, paths["sql"], prompts["sql"], 48)
    assert chat == chat2 == peft_greedy(base, paths["chat"], prompts["chat"], 12)
    assert code == peft_greedy(base, paths["code"], prompts["code"], 12)
    assert plain == peft_greedy(base, None, prompts[BASE], 12)
    gone = complete(url, "sql", prompts["sql"], 2)
    assert gone.status_code == 404
    ids = [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    assert ids == [BASE, ALIAS, "chat", "code"]
    health = httpx.get(f"{url}/health", timeout=30).json()["lora_adapters"]
    assert health["loaded"] == ["chat", "code"] and len(health["resident"]) <= 2
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    counted = {line.split('lora_name="')[1].split('"')[0]: float(line.split()[-1])
               for line in metrics.splitlines() if line.startswith("orca:lora_requests_total{")}
    assert counted["chat"] >= 2 and counted["code"] >= 1 and counted["sql"] >= 1


def test_adapters_that_cannot_be_served_are_refused(url, models, tmp_path):
    _, paths = models
    narrow = altered_copy(paths["code"], tmp_path / "narrow", lambda t: {
        k: v[:, :-1].clone() if "lora_A" in k else v for k, v in t.items()})
    cases = [({"lora_name": "huge", "lora_path": paths["huge"]}, 400, "over max_lora_rank 8"),
             ({"lora_name": "narrow", "lora_path": narrow}, 400, "not [2, 64]"),
             ({"lora_name": "chat2", "lora_path": str(tmp_path)}, 400, "adapter_config.json"),
             ({"lora_name": BASE, "lora_path": paths["code"]}, 400, "cannot name"),
             ({"lora_name": ALIAS, "lora_path": paths["code"]}, 400, "cannot name"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for body, status, text in cases:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "lora_name"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "tok",
                                                        "lora_path": paths["code"]}, timeout=30)
    assert r.status_code == 200, r.text
    for route, body in [("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": [5]})]:
        for model, status in [("never", 404), ("tok", 200), (BASE, 200)]:
            r = httpx.post(f"{url}/{route}", json={**body, "model": model}, timeout=30)
            assert r.status_code == status, (route, model, r.text)


def test_max_new_tokens_of_the_generation_config_is_the_default_max_tokens(url):
    """As vLLM: a chat request without max_tokens gets the checkpoint's max_new_tokens."""
    def chat(**fields) -> dict:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": BASE, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()
    assert chat()["usage"]["completion_tokens"] == 5
    assert chat(max_tokens=9)["usage"]["completion_tokens"] == 9


def test_an_adapter_not_loaded_loads_from_the_dynamic_path(url, models):
    """Ray Serve LLM's dynamic_lora_loading_path: `NAME` or `<model>:NAME` loads NAME's
    directory at its first request, concurrent first requests share the load; a name with
    no directory (or one that would leave it) is a 404, an adapter that cannot be served a
    400 naming `model`."""
    base, paths = models
    prompt = [5, 9, 11, 3, 7]

    async def first_requests():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{url}/v1/completions", json={
                "model": "dyn", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}) for _ in range(4)])
    want = peft_greedy(base, paths["dyn"], prompt, 6)
    assert want != peft_greedy(base, None, prompt, 6)
    for r in asyncio.run(first_requests()):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want and r.json()["model"] == "dyn"
    r = complete(url, f"{BASE}:dyn2", prompt, 6)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == peft_greedy(base, paths["dyn2"], prompt, 6)
    loaded = httpx.get(f"{url}/health", timeout=30).json()["lora_adapters"]["loaded"]
    assert {"dyn", f"{BASE}:dyn2"} <= set(loaded)
    r = httpx.post(f"{url}/tokenize", json={"model": "dyn2", "prompt": "hi"}, timeout=30)
    assert r.status_code == 200, r.text  # (routes that never reach the engine load it too)
    for name in ["nope", "../sql", "dynamic/dyn", f"{BASE}:", "."]:
        r = complete(url, name, prompt, 2)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", name
    for name in ["dynhuge", "empty"]:
        r = complete(url, name, prompt, 2)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "model", r.text
        assert error["code"] == "invalid_lora_adapter", r.text
    # a background batch naming one loads it too
    r = httpx.post(f"{url}/orca/v1/batches", timeout=60, json={
        "model": f"{BASE}:dyn", "requests": [{"prompt": prompt, "max_tokens": 2}]})
    assert r.status_code == 200 and r.json()["status"] in ("in_progress", "completed"), r.text
    assert f"{BASE}:dyn" in httpx.get(f"{url}/health", timeout=30).json()["lora_adapters"][
        "loaded"]
