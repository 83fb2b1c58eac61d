"""The completions route's request schema (protocol.py has the sampling fields it shares
with chat completions, chat_protocol.py the chat request)."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from deployments.protocol import CHAT_ONLY, MAX_LOGPROBS, APIError, SamplingFields

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    UNFOLLOWED: ClassVar[dict[str, object]] = {**SamplingFields.UNFOLLOWED, **CHAT_ONLY}
    prompt: Prompt
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})  # (as vLLM's)
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # null: as chat's unset max_tokens
    echo: bool = False
    # per generated token (and prompt token, with echo): its logprob and k alternatives
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS) around text prompts

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix",
                           "unsupported_parameter")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported by this server (it would sample "
                           "best_of completions and return the n best)", "best_of",
                           "unsupported_parameter")

    def logprob_fields(self) -> dict:
        """The engine's logprobs and prompt_logprobs: the prompt's for echo, for
        prompt_logprobs, or both (as many alternatives as the larger asks)."""
        asked = None if self.stream else self.prompt_logprobs  # (a stream shows none)
        prompt = [k for k in (self.logprobs if self.echo else None, asked) if k is not None]
        return {"logprobs": self.logprobs, "prompt_logprobs": max(prompt, default=None)}
