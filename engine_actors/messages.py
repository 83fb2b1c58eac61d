"""Plain values that cross actor boundaries.

Between the scheduler and the workers, once per iteration: `StepInput` (lists and ints). A
request's sampling settings travel once, when it is admitted (`NewRequest`); after that it
is named by its row in the workers' tables, and block ids travel as deltas.

Between the scheduler actor and its callers (ingress replicas, benchmarks, tests):
`EngineRequest` in, `Refusal` back when it cannot be queued, then `RequestUpdate`s on the
caller's output stream (read with `engine_actors.output_stream`); `BatchRequest` and
`BatchResult` for background batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_actors.request import SamplingParams


@dataclass(slots=True)
class ProcessorSettings:
    """A request's logits processors (see engine_actors/logits_processors.py)."""
    num_prompt_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    num_generated: int = 0  # tokens generated before admission (recomputed after preemption)
    stop_ids: tuple[int, ...] = ()  # EOS and stop token ids, masked before min_tokens
    allowed_ids: tuple[int, ...] | None = None  # None: any token may be sampled
    bad_words: tuple[tuple[int, ...], ...] | None = None  # token ids of each word
    recent: tuple[int, ...] = ()  # the last generated tokens, as far as bad words look back
    # vLLM's thinking_token_budget: (<think> id or -1, </think> id, budget; thinking_budget.py)
    thinking_budget: tuple[int, int, int] | None = None
    generated: tuple[int, ...] = ()  # the tokens generated so far, with a thinking budget


@dataclass(slots=True)
class NewRequest:
    row: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_p: float = 0.0
    num_skip_draws: int = 0  # a recomputed seeded request resumes its random stream here
    processors: ProcessorSettings | None = None
    logprobs: int = -1  # alternatives returned with each sampled token's logprob; -1: none
    grammar: tuple[str, str] | None = None  # structured output (engine_actors/grammar.py)
    replay_tokens: list[int] = field(default_factory=list)  # generated before (recomputed)
    lora_slot: int = -1  # the LoRA adapter slot of its tokens (-1: the base model)


@dataclass(slots=True)
class StepInput:
    step_id: int = 0  # consecutive per worker group; workers run steps in this order
    new_requests: list[NewRequest] = field(default_factory=list)
    # one entry per scheduled request, in batch order
    rows: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # tokens already in the KV cache
    query_lens: list[int] = field(default_factory=list)  # new tokens this iteration
    sample: list[bool] = field(default_factory=list)  # False for a prompt chunk that is not the last
    # speculative decoding: each request's draft tokens, the last of its query tokens; the
    # step samples at each and the token before them (empty: no draft in the step)
    num_drafts: list[int] = field(default_factory=list)
    # batch indices of the requests that continue from a step in flight with a draft: the
    # scheduler placed their tokens as if every draft token were accepted, the worker moves
    # them back by the draft tokens it rejected (speculative.py)
    shifted: list[int] = field(default_factory=list)
    # [T], all new tokens, flattened; -1 = the token this row's previous step samples
    token_ids: list[int] = field(default_factory=list)
    # block-table deltas: block_table[rows[k]][cols[k]] = blocks[k]
    table_rows: list[int] = field(default_factory=list)
    table_cols: list[int] = field(default_factory=list)
    table_blocks: list[int] = field(default_factory=list)
    # requests whose prompt log-probabilities this chunk computes: (index in the batch,
    # alternatives k, the prompt token after the chunk or -1 when the chunk ends the prompt)
    prompt_logprobs: list[tuple[int, int, int]] = field(default_factory=list)
    # LoRA adapters to load before this step runs: (slot, weights file's bytes or their
    # ray.put ref, scale)
    lora_loads: list[tuple[int, object, float]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# A sampled id that is no token: the request's own masks (allowed_token_ids, bad_words,
# min_tokens, a grammar) left it none, and it ends there (finish reason "stop")
NO_TOKEN = -1

# One token's log-probabilities: (its logprob, the top ids, their logprobs, its rank: of
# prompt tokens only, 0 for sampled ones)
TokenLogprobs = tuple[float, list[int], list[float], int]


@dataclass(slots=True)
class StepResult:
    """What the sampling worker returns for one step."""
    token_ids: list[int]  # one per request with sample=True (1 + its drafts), in batch order
    logprobs: list[TokenLogprobs | None] | None = None  # aligned with token_ids
    # per StepInput.prompt_logprobs entry: one TokenLogprobs per prompt position of the
    # chunk that has a next prompt token (the logprob of that next token)
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    # runner "pooling": each sampling row's embedding (float32 bytes) instead of a token
    embeddings: list[bytes] | None = None


@dataclass(slots=True)
class EngineRequest:
    """One request submitted to the scheduler actor."""
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention); batches get 1
    deadline_ms: float | None = None  # must start within this long, else finish "deadline"
    lora_name: str | None = None  # a LoRA adapter (the request's `model`); None: the base
    continues: bool = False  # a step of a request already admitted (a beam search's): no
    # queue limit or drain refuses it
    search: str | None = None  # the beam search whose step it is: a drain waits for the
    # search's next steps until its caller ends it (SchedulerActor.end_search)
    cache_salt: str = ""  # vLLM's: it shares cached prefix blocks only with this salt


@dataclass(slots=True)
class Refusal:
    """Why the scheduler did not queue a request. code: "too_long" (it could never run),
    "queue_full" (admission control), "draining" (shutting down), "batch_too_large"."""
    code: str
    message: str


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object: up to `limit` of `items` that follow the one whose id is
    `after` (from the first when None). KeyError when no item has that id."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise KeyError(after)
        items = items[ids.index(after) + 1:]
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


@dataclass(slots=True)
class RequestOutput:
    """What the scheduler produced for one request in one step, for the request's sink."""
    request_id: str
    sink: Any  # the request's sink (see Request.sink)
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # of the next prompt positions
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the cache
    embedding: bytes | None = None  # runner "pooling": the prompt's (float32), when it ends


@dataclass(slots=True)
class RequestUpdate:
    """What one request produced since the caller's previous stream item."""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set on the request's last update
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why the engine ended it, when it failed
    logprobs: list[TokenLogprobs] | None = None  # of each new token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # of the next prompt positions
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    embedding: bytes | None = None  # runner "pooling": the prompt's (float32), at its end
    # the engine is unreachable (set by the reader of the stream, never by the engine)
    unavailable: bool = False

    # On the stream, an update travels as a plain list of its fields but the last, in
    # order: a stream item holds one per request of the caller, every iteration, and Ray
    # pickles lists several times faster than dataclasses (or named tuples).
    def to_wire(self) -> list:
        return [self.token_ids, self.finish_reason, self.num_prompt_tokens,
                self.num_output_tokens, self.error, self.logprobs, self.prompt_logprobs,
                self.num_cached_tokens, self.embedding]

    @staticmethod
    def from_wire(item: list) -> RequestUpdate:
        return RequestUpdate(*item)

    def merge(self, later: RequestUpdate) -> None:
        self.token_ids.extend(later.token_ids)
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        if later.finish_reason is not None:
            self.finish_reason, self.error = later.finish_reason, later.error
            self.embedding = later.embedding


@dataclass(slots=True)
class BatchRequest:
    """One request of a background batch."""
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_ms: float | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: the request ends at one
    lora_name: str | None = None  # a LoRA adapter (the batch's `model`); None: the base


@dataclass(slots=True)
class BatchResult:
    """A finished request of a batch. When a stop string matched, token_ids end with the
    token that completed it."""
    index: int
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    error: str | None = None
    stop: list[str] = field(default_factory=list)  # its stop strings, to cut the text again
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
