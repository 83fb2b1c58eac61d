from __future__ import annotations

import random

import pytest

from engine_actors.detokenizer import TextStream


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import save_byte_tokenizer
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(str(path))
    return AutoTokenizer.from_pretrained(str(path))


TEXTS = ["plain ascii", "héllo wörld", "emoji 👋🏽 family 👨‍👩‍👧", "quotes \"'` and \\ back",
         "new\nlines\ttabs\x01\x7f", "中文字符と日本語", "mixed 😀a😀b"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_deltas_concatenate_to_the_text(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer)
    pieces = [stream.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.add([], is_final=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_invalid_bytes_match_a_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        stream = TextStream(tokenizer)
        text = "".join(stream.add([t]) for t in ids) + stream.add([], is_final=True)
        assert text == tokenizer.decode(ids)


def test_stop_string_across_tokens_is_cut_and_counted(tokenizer):
    ids = tokenizer.encode("abc STOP def", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["STOP", "zzz"])
    text = "".join(stream.add([t]) for t in ids)
    assert text == "abc " and stream.is_stopped
    assert stream.num_tokens_used == len("abc STOP")  # the token completing the stop string
    assert stream.add(ids) == ""


def test_partial_stop_is_released_when_it_does_not_match(tokenizer):
    ids = tokenizer.encode("xx STA STOQ", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["STOP"])
    pieces = [stream.add([t]) for t in ids]
    assert "".join(pieces) + stream.add([], is_final=True) == "xx STA STOQ"
    assert not stream.is_stopped


def test_special_tokens_are_not_shown(tokenizer):
    stream = TextStream(tokenizer)
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert stream.add(ids, is_final=True) == "hi"


def test_random_ids_with_special_tokens_in_any_chunking_match_a_full_decode(tokenizer):
    """What a random-weight model emits: invalid UTF-8, special tokens, and a request that
    ends in the middle of a character (its bytes show as U+FFFD, as a full decode shows)."""
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(258) for _ in range(rng.randint(1, 40))]
        chunk = rng.choice([1, 3, 8])
        stream = TextStream(tokenizer)
        pieces = [stream.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        text = "".join(pieces) + stream.add([], is_final=True)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_request_ending_mid_character_flushes_it(tokenizer):
    ids = tokenizer.encode("ok 你", add_special_tokens=False)[:-1]  # last byte missing
    stream = TextStream(tokenizer)
    assert stream.add(ids) == "ok "  # held back while it may still complete
    assert stream.add([], is_final=True) == tokenizer.decode(ids)[3:]
