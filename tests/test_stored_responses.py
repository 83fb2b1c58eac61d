"""Stored responses: the store's bookkeeping (no server), then over HTTP with the official
client: a conversation continued by previous_response_id or by item references renders as
the chat template renders the whole conversation (greedy text equal to transformers'),
retrieval, input items and their pages, deletion, `store: false`, and background responses
(polled, cancelled)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine's image

from deployments.responses_items import normalize_input  # noqa: E402
from engine_actors.checkpoint import resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.response_store import EVENT_BYTES, ITEM_BYTES, ResponseStore  # noqa: E402
from tests.engine_harness import hf_greedy  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_responses_api import MODEL, TOOL  # noqa: E402
from tests.test_structured_output import WEATHER  # noqa: E402

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    from engine_actors.checkpoint import load_tokenizer
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


# ---- the store, without a server -------------------------------------------------------------
def test_the_store_keeps_chains_and_evicts_the_least_recently_used():
    size = 10 + ITEM_BYTES + 2  # a record's JSON and its one item id
    store = ResponseStore(max_bytes=3 * size)
    assert store.put("a", "x" * 10, None, ["i1"])
    assert store.put("b", "y" * 10, "a", ["i2"])
    assert store.chain("b") == (["x" * 10, "y" * 10], None)
    assert store.holding(["i1", "i2", "nope"]) == {"i1": "x" * 10, "i2": "y" * 10}
    store.put("c", "z" * 10, None, ["i3"])  # three records: all fit
    store.chain("b")  # uses a and b: c is now the least recently used
    store.put("d", "w" * 10, None, ["i4"])
    assert store.get("c") is None and store.holding(["i3"]) == {}
    assert store.get("a") == "x" * 10 and store.num_bytes == 3 * size
    assert not store.put("e", "v" * (3 * size + 1), None, [])  # over the whole store: not kept
    assert store.delete("a") and not store.delete("a")
    assert store.chain("b") == ([], "a")  # a conversation through a deleted response
    assert store.get("b") == "y" * 10 and store.num_bytes == 2 * size
    assert store.stats() == {"stored_responses": 2, "stored_response_bytes": 2 * size}


def record(status: str, output=(), background=True) -> str:
    return json.dumps({"response": {"status": status, "error": None, "output": list(output),
                                    "background": background}, "input": []})


def status(store: ResponseStore, rid: str) -> tuple[str, dict | None]:
    response = json.loads(store.get(rid))["response"]
    return response["status"], response["error"]


def test_background_records_end_once_by_their_owner_a_cancel_or_the_owners_death():
    aborted = []
    store = ResponseStore(max_bytes=10_000, abort=lambda ids, **kw: aborted.append((ids, kw)))
    store.put("a", record("queued"), None, ["i1"], owner="r1", request_ids=("a-0",))
    assert store.update("a", record("in_progress"), ["i1"], "r1", running=True)
    assert not store.update("a", record("completed"), ["i1"], "r2", running=False)  # not its own
    assert store.update("a", record("completed", [{"id": "o1"}]), ["i1", "o1"], "r1", False)
    assert status(store, "a") == ("completed", None) and "o1" in store.holding(["o1"])
    assert not store.update("a", record("failed"), ["i1"], "r1", False)  # it ended
    assert store.cancel("a") == store.get("a") and not aborted  # an ended one: as it is
    # a cancel while it runs: stored as cancelled, its engine requests told; its owner's
    # own last update, which follows, is refused; a second cancel changes nothing
    store.put("b", record("in_progress"), None, [], owner="r1", request_ids=("b-0",))
    assert json.loads(store.cancel("b"))["response"]["status"] == "cancelled"
    assert aborted == [(["b-0"], {"cancelled": True})]
    assert not store.update("b", record("incomplete"), [], "r1", False)
    assert status(store, "b") == ("cancelled", None)
    store.cancel("b")
    assert len(aborted) == 1 and store.cancel("nope") is None
    # its replica stops: what it ran fails; another replica's goes on
    store.put("c", record("in_progress"), None, [], owner="r1", request_ids=("c-0",))
    store.put("d", record("in_progress"), None, [], owner="r2", request_ids=("d-0",))
    store.owner_gone("r1")
    state, error = status(store, "c")
    assert state == "failed" and error["code"] == "server_error" and "stopped" in error["message"]
    assert status(store, "d") == ("in_progress", None)
    assert store.delete("d") and aborted[-1] == (["d-0"], {"cancelled": True})  # it ends too
    # an end over the whole store's size: failed, not left running; a running update over
    # it: failed too, and its run told to stop (False)
    store.put("e", record("in_progress"), None, [], owner="r1", request_ids=("e-0",))
    assert store.update("e", record("completed", [{"id": "x" * 20_000}]), [], "r1", False)
    assert status(store, "e")[0] == "failed" and not store.update("e", record("x"), [], "r1", 0)
    store.put("f", record("queued"), None, [], owner="r1", request_ids=("f-0",))
    assert not store.update("f", record("in_progress", [{"id": "x" * 20_000}]), [], "r1", True)
    assert status(store, "f")[0] == "failed"
    assert store.num_bytes == sum(len(r.data) + sum(ITEM_BYTES + len(i) for i in r.item_ids)
                                  for r in store.records.values())


def test_eviction_spares_running_background_responses():
    store = ResponseStore(max_bytes=3 * len(record("in_progress")))
    store.put("run", record("in_progress"), None, [], owner="r1", request_ids=("run-0",))
    for rid in "abcd":  # the oldest record is the running one: the finished ones go
        store.put(rid, record("completed"), None, [])
    assert store.get("run") is not None and store.get("a") is None and store.get("d")
    assert store.num_bytes <= store.max_bytes


def event(n: int, kind: str = "response.output_text.delta") -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": n})}


def test_a_streamed_background_response_keeps_its_events_for_any_reader():
    """Its owner adds events as it runs (and the last with its final state); a reader gets
    those after the one it saw, waits for new ones while it runs, and learns that it ended;
    the events count in the store's size."""
    async def scenario():
        store = ResponseStore(max_bytes=10_000)
        store.put("s", record("queued"), None, [], owner="r1", request_ids=("s-0",),
                  events=(event(0, "response.created"),))
        store.put("plain", record("queued"), None, [], owner="r1", request_ids=("p-0",))
        assert await store.events_after("plain", -1, 0.0) == ([], False, 0)  # not streamed
        assert await store.events_after("nope", -1, 0.0) is None
        assert store.update("s", record("in_progress"), [], "r1", True,
                            [event(1, "response.in_progress")])
        assert not store.add_events("s", "r2", [event(2)])  # not its owner
        assert await store.events_after("s", -1, 0.0) == \
            ([event(0, "response.created"), event(1, "response.in_progress")], False, 2)
        assert await store.events_after("s", 1, 0.0) == ([], False, 2)  # none new yet
        waiting = asyncio.ensure_future(store.events_after("s", 1, 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert store.add_events("s", "r1", [event(2), event(3)])
        assert await asyncio.wait_for(waiting, 1.0) == ([event(2), event(3)], False, 4)
        waiting = asyncio.ensure_future(store.events_after("s", 3, 5.0))
        await asyncio.sleep(0.01)
        assert store.update("s", record("completed"), [], "r1", False,
                            [event(4, "response.completed")])
        assert await asyncio.wait_for(waiting, 1.0) == \
            ([event(4, "response.completed")], True, 5)
        assert not store.add_events("s", "r1", [event(5)])  # it ended
        assert await store.events_after("s", -1, 5.0) == (
            [event(0, "response.created"), event(1, "response.in_progress"), event(2),
             event(3), event(4, "response.completed")], True, 5)  # all, after its end
        assert store.num_bytes == sum(
            len(r.data) + sum(ITEM_BYTES + len(i) for i in r.item_ids) +
            sum(EVENT_BYTES + len(e["data"]) + len(e["event"]) for e in r.events)
            for r in store.records.values())
        # a stream that ends otherwise than by its owner's last event ends with one giving
        # its final state, numbered in turn: a cancel (which wakes a reader), its owner's
        # death, events past the store's size (its run is told to stop: False), a last
        # update without its event
        for rid in "tuvw":
            store.put(rid, record("in_progress"), None, [], owner="r1",
                      request_ids=(f"{rid}-0",), events=(event(0, "response.created"),))
        waiting = asyncio.ensure_future(store.events_after("t", 0, 5.0))
        await asyncio.sleep(0.01)
        store.cancel("t")
        last, ended, count = await asyncio.wait_for(waiting, 1.0)
        assert (len(last), ended, count) == (1, True, 2)
        assert json.loads(last[0]["data"]) == {
            "type": "error", "sequence_number": 1, "code": "cancelled",
            "message": "the response was cancelled", "param": None}
        assert not store.add_events("u", "r2", [event(1)])
        store.owner_gone("r2")  # (not u's owner: nothing changes)
        assert not store.add_events("u", "r1", [{"event": "x", "data": "x" * 20_000}])
        assert store.update("w", record("completed"), [], "r1", False, [event(1)])
        store.owner_gone("r1")
        for rid, kind in (("u", "response.failed"), ("v", "response.failed"),
                          ("w", "response.completed")):
            events, ended, count = await store.events_after(rid, -1, 0.0)
            final = json.loads(events[-1]["data"])
            assert (ended, count, final["type"], final["sequence_number"]) == \
                (True, len(events), kind, len(events) - 1), rid
            assert final["response"] == json.loads(store.get(rid))["response"]
    asyncio.run(scenario())


def test_running_streams_fail_when_their_events_do_not_fit_beside_each_other():
    """Running responses are never evicted: one whose next events would take the store
    past its size fails (its own stream says so), and the others go on."""
    store = ResponseStore(max_bytes=10_000)
    for rid in "ab":
        store.put(rid, record("in_progress"), None, [], owner="r1", request_ids=(rid,),
                  events=(event(0, "response.created"),))
    big = {"event": "x", "data": "x" * 3_000}
    assert store.add_events("a", "r1", [big]) and store.add_events("b", "r1", [big])
    assert not store.add_events("b", "r1", [big])  # 3 x 3,000 and the rest: over 10,000
    assert status(store, "b")[0] == "failed" and status(store, "a")[0] == "in_progress"
    assert store.add_events("a", "r1", [event(2)])


class FakeFrontend:
    """The scheduler's side of StoredResponses' calls: a ResponseStore in this process."""
    def __init__(self, store: ResponseStore):
        self.store = store

    async def ready(self):
        return None

    async def call(self, name: str, method: str, *args):
        assert name == "response_call"
        result = getattr(self.store, method)(*args)
        return await result if asyncio.iscoroutine(result) else result


def test_a_stream_reader_resumes_after_its_cursor_and_says_why_it_ends_early():
    from deployments.stored_responses import StoredResponses

    async def read(stored, rid, after=-1) -> list[dict]:
        return [e async for e in (await stored.stream(rid, after)).body_iterator]

    async def scenario():
        store = ResponseStore(max_bytes=100_000)
        stored = StoredResponses(FakeFrontend(store))
        store.put("s", record("in_progress"), None, [], owner="r1", request_ids=("s",),
                  events=[event(n) for n in range(4)])
        reader = asyncio.ensure_future(read(stored, "s", 1))
        await asyncio.sleep(0.05)
        store.update("s", record("completed"), [], "r1", False,
                     [event(4, "response.completed")])
        got = await asyncio.wait_for(reader, 5.0)
        assert [json.loads(e["data"])["sequence_number"] for e in got] == [2, 3, 4]
        assert await read(stored, "s", 4) == []  # past the last: nothing more
        store.put("d", record("in_progress"), None, [], owner="r1", request_ids=("d",),
                  events=[event(0)])
        reader = asyncio.ensure_future(read(stored, "d"))
        await asyncio.sleep(0.05)
        store.delete("d")  # while it is read
        got = await asyncio.wait_for(reader, 5.0)
        assert [json.loads(e["data"]) for e in got][-1]["type"] == "error"
        assert json.loads(got[-1]["data"])["code"] == "not_found"
        assert json.loads(got[-1]["data"])["sequence_number"] == 1
    asyncio.run(scenario())


def test_a_cancel_ends_the_owners_request_as_a_finish_it_receives():
    """SchedulerActor.abort(cancelled=True): the replica running the response gets its
    request's last update (a plain abort is one its caller made, and gets nothing)."""
    from engine_actors.config import EngineConfig
    from engine_actors.messages import RequestOutput
    from engine_actors.outbox import Outbox
    from engine_actors.scheduler_actor import SchedulerActor

    actor = SchedulerActor(EngineConfig())
    owner = Outbox("r1")
    owner.add("bg-0")
    owner.add("plain-0")

    class Scheduler:
        @staticmethod
        def abort(rid, reason):
            return RequestOutput(rid, owner, finish_reason=reason, num_output_tokens=3)

    actor.engine = type("Engine", (), {"scheduler": Scheduler})()
    actor.responses.put("bg", record("in_progress"), None, [], owner="r1",
                        request_ids=("bg-0",))
    asyncio.run(actor.response_call("cancel", "bg"))
    assert owner.pending["bg-0"].finish_reason == "abort" and "bg-0" not in owner.request_ids
    actor.abort(["plain-0"])
    assert "plain-0" not in owner.pending and "plain-0" not in owner.request_ids


def test_input_items_are_stored_in_one_shape_with_ids():
    items = normalize_input([
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "id": "msg_given",
         "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "item_reference", "id": "fc_1"}])
    assert [i["type"] for i in items] == ["message", "message", "function_call",
                                          "function_call_output", "item_reference"]
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["id"] != "msg_given"  # an id names one stored item: given ones are not kept
    assert items[1]["content"] == [{"type": "output_text", "text": "ab", "annotations": []}]
    assert items[3]["output"] == "ok" and items[4] == {"type": "item_reference", "id": "fc_1"}
    assert all(i["id"] for i in items) and len({i["id"] for i in items}) == 5
    assert normalize_input("hi")[0]["role"] == "user"


# ---- over HTTP -------------------------------------------------------------------------------
def template_ids(tokenizer, messages, tools=None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def test_a_conversation_continued_from_a_stored_response(client, tokenizer):
    """Turn 2 names turn 1: its prompt is turn 1's input and output, then its own input
    (turn 1's instructions are not carried over), and its greedy text is transformers' on
    that prompt. The same conversation by item references renders the same prompt."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Hi.",
                                    max_output_tokens=6, temperature=0, extra_body=NO_EOS)
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=8,
                                     extra_body=NO_EOS)
    messages = [{"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    prompt = template_ids(tokenizer, messages)
    assert second.usage.input_tokens == len(prompt)
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 8)
    assert second.output_text == tokenizer.decode(ref, skip_special_tokens=True)
    assert second.previous_response_id == first.id and second.store is True
    # the same conversation by reference to the stored items, with no previous response
    items = client.responses.input_items.list(first.id, order="asc").data
    refs = [{"type": "item_reference", "id": i.id} for i in items + first.output]
    third = client.responses.create(model=MODEL, input=refs + [messages[2]], temperature=0,
                                    max_output_tokens=8, extra_body=NO_EOS)
    assert (third.usage.input_tokens, third.output_text) == (len(prompt), second.output_text)


def test_a_tool_call_round_trip_through_previous_response_id(client, tokenizer):
    first = client.responses.create(model=MODEL, input="weather in Rome?", tools=[TOOL],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200, extra_body={"seed": 1})
    call = [item for item in first.output if item.type == "function_call"][0]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=2,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    text = "".join(p.text for item in first.output if item.type == "message"
                   for p in item.content)
    messages = [{"role": "user", "content": "weather in Rome?"},
                {"role": "assistant", "content": text, "tool_calls": [{
                    "id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert second.usage.input_tokens == len(template_ids(tokenizer, messages, [WEATHER]))


def test_retrieve_list_input_items_and_delete(client, url):
    first = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        max_output_tokens=3)
    second = client.responses.create(model=MODEL, input="three", max_output_tokens=3,
                                     previous_response_id=first.id)
    assert client.responses.retrieve(second.id) == second
    page = client.responses.input_items.list(second.id)  # newest first, 20 at most
    texts = [i.content[0].text for i in page.data]
    assert texts == ["three", first.output_text, "two", "one"] and not page.has_more
    asc = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["one", "two"] and asc.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=asc.last_id)
    assert [i.content[0].text for i in rest.data] == [first.output_text, "three"]
    assert [i.id for i in asc.data + rest.data] == [i.id for i in page.data][::-1]
    # output items sent back with the response they came from: stored anew, each id once,
    # so the client's pages (one item each) go through them all
    third = client.responses.create(model=MODEL, previous_response_id=second.id,
                                    input=second.output + [{"role": "user", "content": "x"}],
                                    max_output_tokens=2)
    ids = [item.id for item in client.responses.input_items.list(third.id, limit=1)]
    assert len(ids) == len(set(ids)) == 7
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.delete(first.id),
                 lambda: client.responses.input_items.list(second.id)):  # its chain broke
        with pytest.raises(openai.NotFoundError):
            call()
    r = httpx.post(f"{url}/v1/responses", timeout=30, json={
        "model": MODEL, "input": "x", "max_output_tokens": 2, "previous_response_id": first.id})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "previous_response_not_found"
    r = httpx.post(f"{url}/v1/responses", timeout=30, json={
        "model": MODEL, "max_output_tokens": 2, "input": [{"type": "item_reference",
                                                           "id": "msg_nope"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.id"
    for limit in ("0", "1" * 5000):  # (thousands of digits: int() refuses them)
        r = httpx.get(f"{url}/v1/responses/{second.id}/input_items?limit={limit}", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def poll(client, response_id: str, until: tuple[str, ...], timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while (res := client.responses.retrieve(response_id)).status not in until:
        assert time.monotonic() < deadline, res
        time.sleep(0.05)
    return res


def test_a_background_response_is_polled_to_transformers_greedy_text(client, tokenizer):
    res = client.responses.create(model=MODEL, input="Count on.", max_output_tokens=8,
                                  temperature=0, background=True, extra_body=NO_EOS)
    assert (res.status, res.background, res.store, res.output) == ("queued", True, True, [])
    done = poll(client, res.id, ("completed", "incomplete", "failed"))
    prompt = template_ids(tokenizer, [{"role": "user", "content": "Count on."}])
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 8)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == tokenizer.decode(ref, skip_special_tokens=True)
    assert done.usage.output_tokens == 8 and done.background is True
    assert client.responses.cancel(res.id) == done  # one that ended: as it is
    running = client.responses.create(model=MODEL, input="x", max_output_tokens=3000,
                                      background=True, extra_body=NO_EOS)
    with pytest.raises(openai.BadRequestError, match="still"):  # not until it has ended
        client.responses.create(model=MODEL, input="y", previous_response_id=running.id)
    client.responses.cancel(running.id)
    # it continues a conversation as any stored response
    nxt = client.responses.create(model=MODEL, input="More.", previous_response_id=res.id,
                                  max_output_tokens=2)
    assert nxt.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_a_background_response_cancelled_stops_generating(client, url):
    before = wait_idle(url)
    res = client.responses.create(model=MODEL, input="go on", max_output_tokens=3000,
                                  background=True, extra_body=NO_EOS)
    poll(client, res.id, ("in_progress",))
    cancelled = client.responses.cancel(res.id)
    assert cancelled.status == "cancelled" and cancelled.id == res.id
    after = wait_idle(url, timeout=30)  # its engine request ended: no 3,000 steps
    assert after["num_steps"] - before["num_steps"] < 2500, (before, after)
    time.sleep(0.5)  # (its replica's own last update came, and was refused)
    assert client.responses.retrieve(res.id).status == "cancelled"
    assert client.responses.cancel(res.id).status == "cancelled"
    # deleting one that runs ends it too
    res = client.responses.create(model=MODEL, input="go on", max_output_tokens=3000,
                                  background=True, extra_body=NO_EOS)
    poll(client, res.id, ("in_progress",))
    client.responses.delete(res.id)
    wait_idle(url, timeout=30)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    r = httpx.post(f"{url}/v1/responses/{plain.id}/cancel", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/responses/resp_nope/cancel", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_background_stream_resumes_after_the_last_event_seen(client, tokenizer, url):
    """`background` and `stream`: the client leaves after five events; the response is
    generated all the same, and GET ?stream=true&starting_after=4 (the official client's
    retrieve) gives the rest, live (it is still running); together, one stream numbered
    without a gap whose text is transformers' greedy text. After its end the whole stream
    is still there."""
    stream = client.responses.create(model=MODEL, input="Count on.", max_output_tokens=400,
                                     temperature=0, background=True, stream=True,
                                     extra_body=NO_EOS, timeout=60)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 5:
            break
    stream.close()
    assert [e.type for e in seen[:2]] == ["response.created", "response.in_progress"]
    assert (seen[0].response.status, seen[1].response.status) == ("queued", "in_progress")
    response_id = seen[0].response.id
    assert client.responses.retrieve(response_id).status == "in_progress"
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=4,
                                          timeout=60))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    prompt = template_ids(tokenizer, [{"role": "user", "content": "Count on."}])
    ref = tokenizer.decode(hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 400),
                           skip_special_tokens=True)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ref == events[-1].response.output_text
    stored = client.responses.retrieve(response_id)
    assert stored.status == "incomplete" and stored.output_text == ref
    replay = list(client.responses.retrieve(response_id, stream=True, timeout=60))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events]
    # what cannot be streamed: a background response made without stream, any other
    # response, a bad cursor, an unknown response
    quiet = client.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                    background=True)
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    for rid, query, code in [(quiet.id, "", 400), (plain.id, "", 400),
                             (response_id, "&starting_after=x", 400),
                             ("resp_nope", "", 404)]:
        r = httpx.get(f"{url}/v1/responses/{rid}?stream=true{query}", timeout=30)
        assert r.status_code == code and r.json()["error"]["message"], (rid, query, r.text)


def test_a_cancelled_background_stream_ends_its_readers(client, url):
    before = wait_idle(url)
    stream = client.responses.create(model=MODEL, input="go on", max_output_tokens=3000,
                                     background=True, stream=True, extra_body=NO_EOS,
                                     timeout=60)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            client.responses.cancel(events[0].response.id)
            break
    rest = list(stream)  # the stream goes on from the record, and ends with the cancel
    after = wait_idle(url, timeout=30)
    assert after["num_steps"] - before["num_steps"] < 2500, (before, after)
    assert len(events) + len(rest) < 2500
    assert rest[-1].type == "error" and rest[-1].code == "cancelled"
    assert client.responses.retrieve(events[0].response.id).status == "cancelled"


def test_store_false_keeps_nothing_and_a_stream_is_stored_before_it_ends(client):
    res = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert res.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    # greedy: sampled, an end-of-text token within the 4 came now and then, and the stream's
    # completed response is then the openai client's ParsedResponse, never equal to a Response
    with client.responses.stream(model=MODEL, input="y", max_output_tokens=4,
                                 temperature=0) as stream:
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                # the client may continue from it the moment it sees the end
                assert client.responses.retrieve(event.response.id) == event.response
                final = event.response
    assert final.store is True and final.output_text
