"""Log-probabilities in OpenAI's response shapes.

Completions: {"tokens", "token_logprobs", "top_logprobs" ({token: logprob}: the k likeliest and
the chosen token, so up to k + 1), "text_offset"},
the prompt's tokens first with `echo` (the first one has no log-probability: null).
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}. Tokens are shown as their own decoded text (or "token_id:{id}", vLLM's
return_tokens_as_token_ids); log-probabilities are of the
model's distribution (log-softmax of its logits, before temperature and penalties).
vLLM's prompt_logprobs: [null, {"token id": {"logprob", "rank", "decoded_token"}}, ...], of
each prompt token and its k likeliest alternatives (ranked 1 to k).
"""
from __future__ import annotations

from deployments.protocol import APIError
from engine_actors.messages import TokenLogprobs

LOGPROB_FIELDS = {"logprobs": "sample", "top_logprobs": "sample", "prompt_logprobs": "prompt"}


def resolve_logprobs(req, max_logprobs: int, vocab_size: int) -> None:
    """A request's logprob fields within vLLM's max_logprobs (-1: the vocabulary): -1 asks
    for that many, more is a 400 in vLLM's words. Sets the fields of `req`."""
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name, kind in LOGPROB_FIELDS.items():
        value = getattr(req, name, None)
        if value is None or isinstance(value, bool):  # (chat's logprobs is a switch)
            continue
        if value == -1:
            setattr(req, name, limit)
        elif value > limit:
            raise APIError(400, f"Requested {kind} logprobs of {value}, which is greater than "
                                f"max allowed: {limit}", name, "invalid_value")


class LogprobsWriter:
    def __init__(self, tokenizer, chat: bool, num_top: int = 0, as_ids: bool = False):
        self.tokenizer, self.chat = tokenizer, chat
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: "token_id:{id}"
        self.num_top = num_top  # alternatives per token
        self.entries: list[tuple[int, TokenLogprobs | None]] = []  # (token id, its logprobs)
        self.num_taken = 0  # entries already streamed
        self.offset = 0  # characters of the returned text before the next token

    def add(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        self.entries += zip(token_ids, logprobs)

    def add_prompt(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        """The prompt tokens (echo): the first has no log-probability."""
        self.entries += zip(prompt_ids, [None] + list(logprobs))

    def cut(self, num_generated: int, num_prompt: int = 0) -> None:
        """Keep the prompt entries and the first num_generated generated ones (a stop
        string ended the text there)."""
        del self.entries[num_prompt + num_generated:]

    def take(self) -> dict | None:
        """The entries since the last take, in the response shape (streaming)."""
        new, self.num_taken = self.entries[self.num_taken:], len(self.entries)
        return self._shape(new) if new else None

    def result(self) -> dict:
        self.offset = 0
        return self._shape(self.entries)

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    def _shape(self, entries) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(i, lp) for i, lp in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in entries:
            text = self._token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp[0])
            top = None
            if lp is not None:  # tokens that decode alike keep the likeliest's value
                top = {}
                for i, v in zip(lp[1], lp[2]):
                    top.setdefault(self._token(i), v)
                top.setdefault(text, lp[0])  # the chosen token too, as OpenAI and vLLM
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, token_id: int, lp: TokenLogprobs) -> dict:
        def one(i: int, value: float) -> dict:
            text = self._token(i)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}
        return {**one(token_id, lp[0]), "top_logprobs": [one(i, v) for i, v in zip(lp[1], lp[2])]}


class PromptLogprobs:
    """One prompt's log-probabilities in vLLM's prompt_logprobs shape."""

    def __init__(self, tokenizer, prompt_ids: list[int], num_top: int):
        self.tokenizer, self.prompt_ids, self.num_top = tokenizer, prompt_ids, num_top
        self.entries: list[TokenLogprobs] = []  # of prompt tokens 1, 2, ...

    def add(self, logprobs: list[TokenLogprobs]) -> None:
        self.entries += logprobs

    def result(self) -> list[dict | None]:
        out: list[dict | None] = [None]  # the first token has no log-probability
        for token_id, (lp, ids, values, rank) in zip(self.prompt_ids[1:], self.entries):
            entry = {str(token_id): self._one(token_id, lp, rank)}
            for r, (i, v) in enumerate(zip(ids[:self.num_top], values), 1):
                entry[str(i)] = self._one(i, v, r)
            out.append(entry)
        return out

    def _one(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank,
                "decoded_token": self.tokenizer.decode([token_id])}
