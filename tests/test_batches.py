"""Background batch state in the scheduler actor, without Ray."""
from __future__ import annotations

import asyncio

import pytest

from engine_actors.batches import Batches, BatchState
from engine_actors.messages import BatchRequest, Refusal
from engine_actors.request import SamplingParams
from engine_actors.messages import RequestOutput


def output(state, index, tokens, reason=None, num_prompt=3):
    return RequestOutput(state.request_id(index), state, tokens, reason, num_prompt)


def test_every_reader_of_batch_results_sees_every_result():
    """Two readers; one is busy when the last result lands: neither may miss it."""
    batches = Batches(add=None, abort=None, tokenizer=None)

    async def scenario():
        state = batches.batches["b"] = BatchState("b", 2, stop_request=None)
        seen = {"fast": [], "slow": []}

        async def read(name, pause):
            async for results in batches.results("b"):
                seen[name] += [r.index for r in results]
                await asyncio.sleep(pause)  # "busy at yield"

        readers = [asyncio.create_task(read("fast", 0.0)),
                   asyncio.create_task(read("slow", 0.05))]
        await asyncio.sleep(0.01)
        state.deliver(output(state, 0, [1, 2], "length"), None)
        await asyncio.sleep(0.01)  # the slow reader is still busy with result 0
        state.deliver(output(state, 1, [4]), None)
        state.deliver(output(state, 1, [5], "stop"), None)
        await asyncio.wait_for(asyncio.gather(*readers), timeout=2)
        return seen

    seen = asyncio.run(scenario())
    assert sorted(seen["fast"]) == [0, 1] and sorted(seen["slow"]) == [0, 1]


def test_batch_status_counts_and_tokens():
    state = BatchState("b", 3, stop_request=None)
    state.deliver(output(state, 0, [7, 8], "length"), None)
    state.aborted(output(state, 1, [], "abort"))
    assert state.status()["status"] == "in_progress"
    state.deliver(output(state, 2, [9], "stop"), None)
    status = state.status()
    assert (status["status"], status["num_completed"], status["num_cancelled"],
            status["num_failed"]) == ("completed", 2, 1, 0)
    assert state.results[0].token_ids == [7, 8]
    assert state.results[1].error == "cancelled"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine_actors.checkpoint import load_tokenizer, save_byte_tokenizer
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(str(path))
    return load_tokenizer(str(path))


def test_a_stop_string_ends_the_request_in_the_engine(tokenizer):
    added, aborted = [], []
    batches = Batches(add=lambda sink, r: added.append((sink, r)),
                      abort=lambda ids, stopped: aborted.append((ids, stopped)),
                      tokenizer=lambda: tokenizer)
    sampling = SamplingParams(max_tokens=3000)
    requests = [BatchRequest([1, 2], sampling, stop=["END"]), BatchRequest([1, 2], sampling)]
    assert asyncio.run(batches.submit("b", requests, 0, max_queued=10)) is None
    state = added[0][0]
    for text in ["ab", "cE", "ND", "zz"]:  # the stop string completes at "D"
        for tok in tokenizer.encode(text, add_special_tokens=False):
            state.deliver(output(state, 0, [tok]), None)
            state.deliver(output(state, 1, [tok]), None)
    assert aborted == [(["b-0"], True)]  # at once, not at max_tokens
    result = state.results[0]
    assert result.finish_reason == "stop" and result.stop == ["END"]
    assert tokenizer.decode(result.token_ids) == "abcEND"  # up to the token that matched
    assert 1 not in state.results  # the one without stop strings runs on


def test_a_share_of_a_batch_keeps_the_whole_batch_numbers(tokenizer):
    """Data parallelism gives each engine a share: requests first_index on, of `total`."""
    added, aborted = [], []
    batches = Batches(add=lambda sink, r: added.append(r),
                      abort=lambda ids, stopped: aborted.append((ids, stopped)),
                      tokenizer=lambda: tokenizer)
    sampling = SamplingParams(max_tokens=3000)
    share = [BatchRequest([1], sampling), BatchRequest([1], sampling, stop=["END"]),
             BatchRequest([1], sampling)]
    assert asyncio.run(batches.submit("b", share, 0, 10, first_index=4, total=9)) is None
    assert [r.request_id for r in added] == ["b-4", "b-5", "b-6"]
    state = batches.batches["b"]
    for tok in tokenizer.encode("xEND", add_special_tokens=False):
        state.deliver(output(state, 5, [tok]), None)
    assert aborted == [(["b-5"], True)] and state.results[5].finish_reason == "stop"
    state.deliver(output(state, 4, [7], "length"), None)
    assert batches.status("b")["total"] == 9 and batches.status("b")["num_requests"] == 3
    assert batches.cancel("b")["status"] == "cancelled"
    assert aborted[-1] == (["b-6"], False)  # only the one of its share still running
    state.aborted(output(state, 6, []))

    async def read():
        return [r.index async for results in batches.results("b") for r in results]

    assert sorted(asyncio.run(read())) == [4, 5, 6]
    # a refusal aborts the share's requests queued before it, named by their batch numbers
    refusing = Batches(add=lambda sink, r: None if r.request_id != "c-3" else
                       Refusal("queue_full", "full"),
                       abort=lambda ids, stopped: aborted.append((ids, stopped)),
                       tokenizer=lambda: tokenizer)
    refusal = asyncio.run(refusing.submit("c", share[:1] * 3, 0, 10, first_index=1, total=5))
    assert refusal.message == "request 3: full" and aborted[-1] == (["c-1", "c-2"], False)
