"""OpenAI's Conversations API: the store's bookkeeping (no server), then over HTTP with the
official client: conversations and their items created, listed in pages, retrieved,
updated and deleted; a response made with `conversation` renders the conversation's items
then its input as the chat template renders the whole conversation (greedy text equal to
transformers'), and its input and output are added to the conversation; refusals."""
from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine's image

from engine_actors.checkpoint import resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.conversation_store import (CONVERSATION_BYTES, ITEM_BYTES,  # noqa: E402
                                              LOCK_S, ConversationStore)
from tests.engine_harness import hf_greedy  # noqa: E402
from tests.test_responses_api import MODEL  # noqa: E402
from tests.test_stored_responses import NO_EOS, template_ids  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from engine_actors.checkpoint import load_tokenizer
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


# ---- the store, without a server -------------------------------------------------------------
def test_the_store_counts_bytes_and_evicts_the_least_recently_used_conversation():
    one = CONVERSATION_BYTES + 10 + ITEM_BYTES + 2 + 5  # its JSON, one item ("i1", 5 bytes)
    store = ConversationStore(max_bytes=2 * one)
    assert store.create("a", "x" * 10, [("i1", "hello")])
    assert store.create("b", "y" * 10, [("i2", "world")])
    assert store.num_bytes == 2 * one
    assert store.items("a") == ["hello"]  # a is now the most recently used
    assert store.create("c", "z" * 10, [("i3", "again")])
    assert store.get("b") is None and store.get("a") == "x" * 10
    assert store.add("a", [("i4", "more!")]) is True  # over the budget: c goes, not a
    assert store.get("c") is None and store.items("a") == ["hello", "more!"]
    assert store.num_bytes == one + ITEM_BYTES + 2 + 5
    assert store.add("a", [("i5", "x" * 3 * one)]) is False  # over the whole store
    assert store.items("a") == ["hello", "more!"]
    assert store.item("a", "i4") == ("x" * 10, "more!") and store.item("a", "no")[1] is None
    assert store.delete_item("a", "i1") == ("x" * 10, True)
    assert store.delete_item("a", "i1") == ("x" * 10, False)
    assert store.update("a", "w" * 12) and store.get("a") == "w" * 12
    assert store.num_bytes == CONVERSATION_BYTES + 12 + ITEM_BYTES + 2 + 5
    assert store.add("nope", []) is None and store.items("nope") is None
    assert store.find(["i4", "i1", "i3"]) == {"i4": "more!"}  # (i1 deleted, i3 evicted)
    assert store.delete("a") and not store.delete("a") and store.num_bytes == 0
    assert store.find(["i4"]) == {} and store.item_owner == {}


def test_a_response_holds_its_conversation_until_it_ends():
    store = ConversationStore(max_bytes=10_000)
    store.create("c", "{}", [("i1", "hi")])
    assert store.begin("c", "r1", now=0.0) == ["hi"]
    assert store.begin("c", "r2", now=1.0) is False  # held by r1
    assert store.end("c", "r2", []) is True and store.begin("c", "r2", now=1.0) is False
    assert store.end("c", "r1", [("i2", "yo")]) is True  # added, released
    assert store.begin("c", "r2", now=2.0) == ["hi", "yo"]
    assert store.begin("c", "r3", now=2.0 + LOCK_S + 1) == ["hi", "yo"]  # r2's lapsed
    assert store.end("c", "r2", [("i3", "late")]) is True  # added; r3 still holds it
    assert store.begin("c", "r4", now=3.0 + LOCK_S) is False
    assert store.begin("nope", "r5", now=0.0) is None and store.end("nope", "r5", []) is None
    assert store.renew("c", "r3", now=2.0 + 2 * LOCK_S) is True  # still its holder
    assert store.begin("c", "r6", now=1.0 + 3 * LOCK_S) is False  # renewed: held
    assert store.renew("c", "r2", now=0.0) is False and store.renew("nope", "r3", 0.0) is False
    assert store.end("c", "r3", []) is True and store.renew("c", "r3", now=0.0) is False


def test_a_replica_renews_the_holds_of_its_running_responses(monkeypatch):
    """A response running past the store's LOCK_S keeps its conversation: its replica
    renews the hold (here every 10 ms, the hold lasting 50 ms) until the response ends."""
    import asyncio
    from types import SimpleNamespace
    from deployments import conversations_api
    from deployments.protocol import APIError
    from engine_actors import conversation_store
    monkeypatch.setattr(conversation_store, "LOCK_S", 0.05)
    monkeypatch.setattr(conversations_api, "RENEW_S", 0.01)
    store = ConversationStore(max_bytes=10_000)
    store.create("c", "{}", [])

    async def call(name, method, *args):
        assert name == "conversation_call"
        return getattr(store, method)(*args)

    async def ready():
        return None
    frontend = SimpleNamespace(cfg=SimpleNamespace(response_store_mib=1), ready=ready,
                               call=call)
    api = conversations_api.ConversationsAPI(frontend, stored=None)

    async def scenario():
        assert await api.begin("c", "r1") == []
        await asyncio.sleep(0.2)  # four times the hold's length: renewed meanwhile
        with pytest.raises(APIError, match="Another response is running"):
            await api.begin("c", "r2")
        await api.end("c", "r1", [])
        assert await api.begin("c", "r2") == []
        await api.end("c", "r2", [])
        await asyncio.sleep(0.05)
        assert api._renewing.done() and not api._held  # nothing left to renew
    asyncio.run(scenario())


# ---- over HTTP -------------------------------------------------------------------------------
def test_conversations_and_their_items(client, url):
    conv = client.conversations.create(
        items=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}],
        metadata={"topic": "numbers"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "numbers"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "three"}]}])
    assert [item.content[0].text for item in added.data] == ["three"]
    texts = [item.content[0].text for item in client.conversations.items.list(conv.id)]
    assert texts == ["three", "two", "one"]  # newest first, paged through by the client
    pages = client.conversations.items.list(conv.id, order="asc", limit=2)
    assert [i.content[0].text for i in pages.data] == ["one", "two"] and pages.has_more
    assert [i.content[0].text for i in pages] == ["one", "two", "three"]
    first = pages.data[0]
    assert client.conversations.items.retrieve(first.id, conversation_id=conv.id).id == first.id
    assert client.conversations.items.delete(first.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(first.id, conversation_id=conv.id)
    updated = client.conversations.update(conv.id, metadata={"topic": "letters"})
    assert client.conversations.retrieve(conv.id).metadata == updated.metadata == \
        {"topic": "letters"}
    assert client.conversations.update(conv.id, metadata=None).metadata == {}
    r = httpx.post(f"{url}/v1/conversations/{conv.id}", json={})  # (metadata: required)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conv.id)


def test_responses_continue_a_conversation_and_add_to_it(client, tokenizer):
    """Turn 1 runs on the conversation's items then its input; turn 2 on all of that, turn
    1's output and its own input; each greedy text is transformers' on its prompt."""
    conv = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."},
                                              {"role": "assistant", "content": "Hello Ada."}])
    first = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id,
                                    max_output_tokens=6, temperature=0, extra_body=NO_EOS)
    messages = [{"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": "What is my name?"}]
    prompt = template_ids(tokenizer, messages)
    assert first.usage.input_tokens == len(prompt) and first.conversation.id == conv.id
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 6)
    assert first.output_text == tokenizer.decode(ref, skip_special_tokens=True)
    listed = client.conversations.items.list(conv.id, order="asc").data
    assert [i.role for i in listed] == ["user", "assistant", "user", "assistant"]
    assert listed[-1].id == first.output[0].id
    second = client.responses.create(model=MODEL, input="Again?", max_output_tokens=4,
                                     conversation={"id": conv.id}, stream=True,
                                     temperature=0, extra_body=NO_EOS)
    done = [event for event in second if event.type in (
        "response.completed", "response.incomplete")][0].response  # (incomplete: 4 tokens)
    messages += [{"role": "assistant", "content": first.output_text},
                 {"role": "user", "content": "Again?"}]
    assert done.usage.input_tokens == len(template_ids(tokenizer, messages))
    assert len(client.conversations.items.list(conv.id).data) == 6  # (streamed: added too)
    third = client.responses.create(model=MODEL, input="Once more.", conversation=conv.id,
                                    background=True, max_output_tokens=3, extra_body=NO_EOS)
    deadline = time.monotonic() + 60
    while third.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        third = client.responses.retrieve(third.id)
    assert third.status == "incomplete"
    newest = client.conversations.items.list(conv.id, limit=2).data
    assert [i.id for i in newest] == [third.output[0].id, newest[1].id]
    assert newest[1].content[0].text == "Once more."


def test_a_second_response_on_a_held_conversation_is_refused_until_the_first_ends(client):
    """The first response streams and is left unread: the second is a 400 with code
    conversation_locked; once the first's stream is closed, the conversation is free."""
    conv = client.conversations.create(items=[{"role": "user", "content": "hi"}])
    first = client.responses.create(model=MODEL, input="one", conversation=conv.id,
                                    stream=True, max_output_tokens=400, extra_body=NO_EOS)
    next(iter(first))  # (response.created: it holds the conversation)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="two", conversation=conv.id,
                                max_output_tokens=2)
    assert e.value.body["code"] == "conversation_locked"
    first.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            client.responses.create(model=MODEL, input="two", conversation=conv.id,
                                    max_output_tokens=2)
            break
        except openai.BadRequestError:
            assert time.monotonic() < deadline, "the closed stream's hold was not released"
            time.sleep(0.2)
    texts = [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc")]
    assert texts[:2] == ["hi", "two"]  # (the closed stream added nothing)


def test_items_of_a_conversation_can_be_referenced(client):
    conv = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    item = client.conversations.items.list(conv.id).data[0]
    ref = {"type": "item_reference", "id": item.id}
    answer = client.responses.create(model=MODEL, input=[ref, {"role": "user", "content": "Hi"}],
                                     max_output_tokens=2, extra_body=NO_EOS)
    plain = client.responses.create(model=MODEL, max_output_tokens=2, extra_body=NO_EOS,
                                    input=[{"role": "user", "content": "My name is Ada."},
                                           {"role": "user", "content": "Hi"}])
    assert answer.usage.input_tokens == plain.usage.input_tokens
    other = client.conversations.create(items=[ref])
    copied = client.conversations.items.list(other.id).data[0]
    assert copied.id != item.id and copied.content[0].text == "My name is Ada."


@pytest.mark.parametrize("body,status,param", [
    ({"conversation": "conv_nope"}, 400, "conversation"),
    ({"conversation": "conv_x", "previous_response_id": "resp_x"}, 400, "conversation"),
    ({"conversation": {"name": "x"}}, 400, "conversation"),
])
def test_responses_refuse_what_a_conversation_can_not_take(client, body, status, param):
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                extra_body=body)
    assert e.value.status_code == status and e.value.body["param"] == param


def test_bad_items_are_refused_by_their_index(client, url):
    r = httpx.post(f"{url}/v1/conversations", json={"items": [
        {"role": "user", "content": "ok"}, {"type": "computer_call", "id": "c"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items.1.type"
    r = httpx.post(f"{url}/v1/conversations", json={"items": [{"role": "user",
                                                                "content": "x"}] * 21})
    assert r.status_code == 400 and "at most 20" in r.json()["error"]["message"]
