"""The native batch API's request schema (see protocol.py for the sampling fields it shares
with the OpenAI routes, and batch_api.py for the routes)."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from deployments.protocol import CHAT_ONLY, MAX_BATCH, SamplingFields, SamplingOptions, _Base


class BatchItem(SamplingOptions):
    """One request of a submitted batch. Fields of the completions route that it does not
    follow are refused, not ignored."""
    UNFOLLOWED: ClassVar[dict[str, object]] = {
        **SamplingOptions.UNFOLLOWED, **SamplingFields.UNFOLLOWED, **CHAT_ONLY, "n": 1,
        "best_of": (None, 1), "logprobs": None, "echo": False, "stream": False, "suffix": None,
        "return_token_ids": False, "response_format": None, "structured_outputs": None,
        "guided_json": None, "guided_regex": None, "guided_choice": None,
        "guided_grammar": None, "tools": None, "cache_salt": None, "add_special_tokens": True,
        "return_tokens_as_token_ids": False, "request_id": None, "timeout_s": None,
        "priority": None}  # (the batch's priority is the batch's field)
    prompt: str | list[int]
    max_tokens: Annotated[int, Field(ge=1)] = 16


class BatchSubmit(_Base):
    """A background batch (native endpoint): scheduled per request, at priority 1 (after
    interactive requests' 0) unless it gives its own."""
    RUNNER: ClassVar[str | None] = "generate"
    model: str | None = None
    requests: Annotated[list[BatchItem], Field(min_length=1, max_length=MAX_BATCH)]
    priority: Annotated[int, Field(ge=-100, le=100)] = 1

    def check_supported(self) -> None:
        pass
