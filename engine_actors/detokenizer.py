"""Generated token ids -> text deltas, with stop strings.

Decoding is incremental, in Rust: `tokenizers`' DecodeStream holds back a token until the
text it completes is valid UTF-8, so streamed deltas never split a character. At the end
of a request, bytes that never completed a character are flushed as U+FFFD, exactly as a
full decode shows them (DecodeStream alone would drop them). Text that could be the start
of a stop string is held back too, and the stop string itself is not returned (OpenAI's
behaviour) unless `include_stop` (vLLM's include_stop_str_in_output). Used by the ingress
for responses and by the scheduler actor for batches.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.num_tokens_used = 0  # tokens that produced the returned text (less, after a stop)
        self.is_stopped = False
        self.stop_string: str | None = None  # the one that stopped it
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids since the last decoded chunk
        self._context: list[int] = []  # ids of the last decoded chunk (spacing for the flush)
        self._text = ""  # all text decoded so far
        self._num_emitted = 0  # characters of _text already returned

    def add(self, token_ids: list[int], is_final: bool = False, hide_last: bool = False) -> str:
        """Append tokens; returns the new text that is safe to send (empty once stopped).
        `hide_last`: the last token counts but adds no text (a stop token, as vLLM)."""
        if self.is_stopped:
            return ""
        if hide_last and token_ids:
            text = self.add(token_ids[:-1], is_final)
            self.num_tokens_used += not self.is_stopped
            return text
        if not self.stop:
            for token in token_ids:
                self._decode(token)
            self.num_tokens_used += len(token_ids)
            if is_final:
                self._flush()
            return self._emit(is_final)
        # token by token, so a stop string is cut at the token that completed it
        out = []
        for i, token in enumerate(token_ids):
            last = is_final and i == len(token_ids) - 1
            self._decode(token)
            self.num_tokens_used += 1
            if last:
                self._flush()
            out.append(self._emit(last))
            if self.is_stopped:
                break
        if not token_ids and is_final:
            self._flush()
            out.append(self._emit(True))
        return "".join(out)

    def _decode(self, token: int) -> None:
        chunk = self._stream.step(self._backend, token)
        if chunk is None:
            self._pending.append(token)
        else:
            self._context, self._pending = self._pending + [token], []
            self._text += chunk

    def _flush(self) -> None:
        """The request ended: show the bytes of an unfinished character as a full decode
        would (replacement characters)."""
        if not self._pending:
            return
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._context, skip_special_tokens=skip)
        after = decode(self._context + self._pending, skip_special_tokens=skip)
        self._text += after[len(before):]
        self._pending = []

    def _emit(self, is_final: bool) -> str:
        text, start = self._text, self._num_emitted
        if self.stop:
            longest = max(map(len, self.stop))
            search_from = max(0, start - longest + 1)
            hits = [(i, i + len(s), s) for i, s in ((text.find(s, search_from), s)
                                                    for s in self.stop) if i != -1]
            if hits:
                self.is_stopped = True
                first, first_end, self.stop_string = min(hits)
                end = max(first_end if self.include_stop else first, start)
                self._num_emitted = end
                return text[start:end]
            if not is_final and not self.include_stop:
                # hold back a tail that may grow into a stop string
                hold = max((k for s in self.stop for k in range(1, len(s))
                            if text.endswith(s[:k])), default=0)
                end = max(len(text) - hold, start)
                self._num_emitted = end
                return text[start:end]
        self._num_emitted = len(text)
        return text[start:]
