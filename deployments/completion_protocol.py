"""The completions route's request schema (protocol.py has the sampling fields it shares
with chat completions, chat_protocol.py the chat request)."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from deployments.protocol import CHAT_ONLY, APIError, SamplingFields

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    UNFOLLOWED: ClassVar[dict[str, object]] = {**SamplingFields.UNFOLLOWED, **CHAT_ONLY}
    prompt: Prompt
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})  # (as vLLM's)
    # null: as chat's unset max_tokens; 0 with echo: the prompt alone (OpenAI's legacy
    # scoring call, as lm-eval's loglikelihood sends it)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    # per generated token (and prompt token, with echo): its logprob and k alternatives
    logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: max_logprobs (vLLM's)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS) around text prompts

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt "
                           "alone)", "max_tokens", "invalid_value")
        if self.echo_only and self.min_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) exceeds max_tokens (0)",
                           "min_tokens", "invalid_value")
        if self.echo_only and self.use_beam_search:
            raise APIError(400, "max_tokens 0 (echo only) cannot be combined with "
                           "use_beam_search", "max_tokens", "invalid_value")
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
