"""Generated token ids -> text deltas, with stop strings.

Decoding is incremental: only the tokens since the last complete character are decoded
again, and text that ends in an incomplete UTF-8 sequence is held back until the next
token completes it, so streamed deltas always concatenate to the full decoded text. Text
that could be the start of a stop string is held back too, and the stop string itself is
never returned (OpenAI's behaviour).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.token_ids: list[int] = []
        self.num_tokens_used = 0  # tokens that produced the returned text (less, after a stop)
        self.is_stopped = False
        self._prefix_offset = 0  # token window re-decoded to get context-dependent spacing right
        self._read_offset = 0
        self._text = ""  # all text decoded so far
        self._num_emitted = 0  # characters of _text already returned

    def add(self, token_ids: list[int], is_final: bool = False) -> str:
        """Append tokens; returns the new text that is safe to send (empty once stopped)."""
        if self.is_stopped:
            return ""
        if not self.stop:
            self.token_ids.extend(token_ids)
            self.num_tokens_used = len(self.token_ids)
            self._decode(is_final)
            return self._emit(is_final)
        # token by token, so a stop string is cut at the token that completed it
        out = []
        for i, token in enumerate(token_ids):
            self.token_ids.append(token)
            self.num_tokens_used = len(self.token_ids)
            self._decode(is_final and i == len(token_ids) - 1)
            out.append(self._emit(is_final and i == len(token_ids) - 1))
            if self.is_stopped:
                break
        if not token_ids and is_final:
            self._decode(True)
            out.append(self._emit(True))
        return "".join(out)

    def _decode(self, is_final: bool) -> None:
        ids = self.token_ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset],
                                       skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and (is_final or not full.endswith(REPLACEMENT)):
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _emit(self, is_final: bool) -> str:
        text, start = self._text, self._num_emitted
        if self.stop:
            longest = max(map(len, self.stop))
            search_from = max(0, start - longest + 1)
            hits = [i for i in (text.find(s, search_from) for s in self.stop) if i != -1]
            if hits:
                self.is_stopped = True
                end = max(min(hits), start)
                self._num_emitted = end
                return text[start:end]
            if not is_final:
                # hold back a tail that may grow into a stop string
                hold = max((k for s in self.stop for k in range(1, len(s))
                            if text.endswith(s[:k])), default=0)
                end = max(len(text) - hold, start)
                self._num_emitted = end
                return text[start:end]
        self._num_emitted = len(text)
        return text[start:]
