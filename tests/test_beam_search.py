"""vLLM's beam search over HTTP (`use_beam_search`, `n` beams, `length_penalty`): the choices
are the beams a reference search over transformers' fp32 log-probabilities keeps, best
first, streamed or not; what it cannot follow is a 400."""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from engine_actors.checkpoint import EOS_ID
from tests.serve_fixture import wait_idle
from tests.test_logits import hf_logprobs

PROMPTS = [[72, 101, 108, 108, 111], [9, 200, 33, 33, 150, 7, 64]]


def reference(prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
              ignore_eos: bool = False, keep_eos: bool = False) -> list[tuple[list[int], str]]:
    """vLLM's beam search, written out: each step extends every beam by its 2 * width
    likeliest tokens; EOS ends a beam; the width likeliest extensions go on; at the end
    the ended and live beams are ranked by logprob / len ** length_penalty (EOS counted);
    the output leaves EOS out unless `keep_eos`."""
    live, ended = [([], 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, total in live:
            top = hf_logprobs(prompt + tokens)[-1].topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (ended if token == EOS_ID and not ignore_eos else grown).append(
                    (tokens + [token], total + value))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
        if not live:
            break
    ranked = sorted([(t, s, "stop") for t, s in ended] + [(t, s, "length") for t, s in live],
                    key=lambda b: b[1] / max(len(b[0]), 1) ** length_penalty, reverse=True)
    return [(tokens if reason == "length" or keep_eos else tokens[:-1], reason)
            for tokens, _, reason in ranked[:width]]


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", timeout=120,
                      json={"use_beam_search": True, "return_token_ids": True, **body})


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_the_choices_are_the_reference_searchs_beams(url, length_penalty):
    r = post(url, "completions", prompt=PROMPTS, n=3, max_tokens=6,
             length_penalty=length_penalty, temperature=0.7, logprobs=2)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        want = reference(prompt, 3, 6, length_penalty)
        got = [(c["token_ids"], c["finish_reason"]) for c in choices[3 * i:3 * i + 3]]
        assert got == want, (i, got, want)
        for c in choices[3 * i:3 * i + 3]:  # each token's log-probability and the top 2
            ref = hf_logprobs(prompt + c["token_ids"])[len(prompt) - 1:-1]
            lps = c["logprobs"]
            assert len(lps["token_logprobs"]) == len(c["token_ids"])
            for t, token in enumerate(c["token_ids"]):
                assert lps["token_logprobs"][t] == pytest.approx(ref[t, token].item(), abs=1e-4)
                assert max(lps["top_logprobs"][t].values()) == \
                    pytest.approx(ref[t].max().item(), abs=1e-4)
                assert len(lps["top_logprobs"][t]) <= 3  # (tokens that decode alike: one)
    # three different beams, not three copies of the greedy output
    assert len({tuple(c["token_ids"]) for c in choices[:3]}) == 3


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 3.0])
def test_a_beam_that_picks_eos_ends_there_and_ignore_eos_goes_on(url, length_penalty):
    """The prompt ends where the random model ranks EOS among its two likeliest tokens, so
    the first step already ends a beam there; the length penalty then decides where that
    one-token beam ranks against the three-token ones."""
    rng = random.Random(0)
    text = [rng.randrange(3, 256) for _ in range(1000)]
    logprobs = hf_logprobs(text)
    ranks = (logprobs > logprobs[:, EOS_ID:EOS_ID + 1]).sum(-1)
    prompt = text[:int((ranks < 2).nonzero()[0, 0]) + 1]
    want = reference(prompt, 4, 3, length_penalty)
    # the ended beam ranks first without a penalty, second with 1, and out with 3
    assert any(reason == "stop" for _, reason in reference(prompt, 4, 3, 0.0))
    body = dict(prompt=prompt, n=4, max_tokens=3, length_penalty=length_penalty)
    choices = post(url, "completions", **body).json()["choices"]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == want
    choices = post(url, "completions", ignore_eos=True, **body).json()["choices"]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == \
        reference(prompt, 4, 3, length_penalty, ignore_eos=True)
    r = post(url, "completions", include_stop_str_in_output=True, **body).json()
    assert [(c["token_ids"], c["finish_reason"]) for c in r["choices"]] == \
        reference(prompt, 4, 3, length_penalty, keep_eos=True)
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])


def test_streamed_and_chat_beams_equal_the_plain_ones(url):
    messages = [{"role": "user", "content": "beams"}]
    plain = post(url, "chat/completions", messages=messages, n=2, max_tokens=5,
                 logprobs=True, top_logprobs=1).json()
    texts = [c["message"]["content"] for c in plain["choices"]]
    assert [len(c["logprobs"]["content"]) for c in plain["choices"]] == \
        [len(c["token_ids"]) for c in plain["choices"]]
    prompt = plain["choices"][0]["prompt_token_ids"]
    assert [c["token_ids"] for c in plain["choices"]] == \
        [tokens for tokens, _ in reference(prompt, 2, 5)]
    r = post(url, "chat/completions", messages=messages, n=2, max_tokens=5, stream=True)
    streamed = ["", ""]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts
    assert plain["usage"]["completion_tokens"] == sum(len(c["token_ids"])
                                                      for c in plain["choices"])


def test_only_a_searchs_first_step_is_subject_to_admission_control():
    """Its later steps continue a request already admitted: a full queue or a drain must
    not fail a search half done."""
    import asyncio

    from deployments.beam_search import BeamSearch
    from engine_actors.config import EngineConfig
    from engine_actors.messages import EngineRequest, Refusal, RequestUpdate
    from engine_actors.request import SamplingParams
    from engine_actors.scheduler_actor import SchedulerActor

    class Queue:  # the scheduler's admission, its queue always full
        added = []

        def queue_full(self):
            return Refusal("queue_full", "full")

        def add(self, r, sink, lora):
            self.added.append(r.request_id)

    actor = SchedulerActor(EngineConfig())
    actor.engine = Queue()
    request = EngineRequest("r", [1], SamplingParams(max_tokens=1))
    assert actor._add(None, request).code == "queue_full"
    actor.draining = True
    assert actor._add(None, request).code == "draining"
    assert actor._add(None, EngineRequest("c", [1], SamplingParams(max_tokens=1),
                                          continues=True)) is None
    assert Queue.added == ["c"]

    class Client:  # answers every step with tokens 5 and 6, records what it was sent
        sent = []

        async def submit(self, requests, wake_each_update):
            self.sent += requests
            return Steps([r.request_id for r in requests])

        def end_search(self, search):
            self.ended = search

    class Steps:
        def __init__(self, ids):
            self.ids = ids

        async def __aiter__(self):
            for rid in self.ids:
                yield rid, RequestUpdate([5], "length", logprobs=[(-1.0, [5, 6], [-1.0, -2.0],
                                                                   0)])

        def close(self):
            pass

    client = Client()

    async def search():
        beams = BeamSearch(client, [("b", [1, 2], 3)], 1, (9,), False, False, 1.0, 1, None)
        await beams.start()
        updates = [update async for update in beams]
        beams.close()  # (the route's finally)
        return updates
    [(rid, update)] = asyncio.run(search())
    assert rid == "b-0" and update.token_ids == [5, 5, 5]
    assert [r.continues for r in Client.sent] == [False, True, True]
    # every step names its search, which the route's close ends (a drain waits for it)
    assert {r.search for r in Client.sent} == {"b-search"} and client.ended == "b-search"


@pytest.mark.parametrize("body,param", [
    ({"stop": ["x"]}, "stop"), ({"echo": True, "logprobs": 0}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"n": 11}, "n"),
    ({"guided_regex": "[ab]+"}, "use_beam_search"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ({"length_penalty": 2000}, "length_penalty")])
def test_what_beam_search_cannot_follow_is_a_400(url, body, param):
    r = post(url, "completions", prompt="a", max_tokens=3, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param



def prompt_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("orca:prompt_tokens_total"))


def test_a_search_out_of_time_is_a_408_and_submits_no_more_steps(url):
    r = post(url, "completions", prompt="a", n=4, max_tokens=300, ignore_eos=True,
             timeout_s=0.5)
    assert r.status_code == 408, r.text
    before = prompt_tokens(url)
    time.sleep(1.0)
    assert prompt_tokens(url) == before
    wait_idle(url)


def test_a_search_cancelled_while_starting_still_ends_and_a_late_step_does_not_reopen_it():
    """A client that leaves during the first step's submission: the search is ended (a
    drain must not wait for it), and a step Ray delivers after the end registers nothing."""
    import asyncio

    from deployments.beam_search import BeamSearch
    from engine_actors.outbox import Outbox

    class Client:  # its submissions never return
        ended = None

        async def submit(self, requests, wake_each_update):
            await asyncio.sleep(60)

        def end_search(self, search):
            self.ended = search

    async def cancelled() -> None:
        beams = BeamSearch(client, [("c", [1, 2], 3)], 2, (9,), False, False, 1.0, 1, None)
        task = asyncio.ensure_future(beams.start())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    client = Client()
    asyncio.run(cancelled())
    assert client.ended == "c-search"
    outbox = Outbox("replica")
    outbox.add("c-s0-0", "c-search")
    outbox.end_search("c-search")
    outbox.add("c-s1-0", "c-search")  # reordered after the end
    assert not outbox.searches
