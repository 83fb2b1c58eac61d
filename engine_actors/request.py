"""The core data model: a request, its sampling parameters, status and counters."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Annotated, Any

import pydantic
from pydantic import ConfigDict, Field

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows (the default max_logprobs)


# Validated on construction (pydantic), so the engine never holds parameters that could take a
# step, and with it every request of the batch, down; any caller gets a ValidationError.
@pydantic.dataclasses.dataclass(frozen=True, slots=True,
                                config=ConfigDict(extra="forbid", allow_inf_nan=False))
class SamplingParams:
    max_tokens: Annotated[int, Field(ge=1)]  # tokens to generate at most
    temperature: Annotated[float, Field(ge=0.0)] = 1.0  # 0 means greedy
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0, lt=2**31)] = 0  # 0 means off
    # keep tokens at least min_p times as likely as the likeliest (after temperature)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    # a seeded request samples the same tokens in any batch
    seed: Annotated[int, Field(ge=-(2**63), le=MAX_SEED)] | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # False when the client left max_tokens unset (it is then the rest of the context):
    # ORCA's FCFS reserves KV for prompt + max_tokens only for requests that gave it
    max_tokens_given: bool = True
    # logits processors, applied to the model's logits before temperature and top-k/p:
    # OpenAI's presence/frequency penalties over generated tokens, transformers'
    # repetition penalty over prompt and generated tokens, token id -> bias, no EOS or
    # stop token before min_tokens, no token outside allowed_token_ids, and no bad word
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: Annotated[int, Field(ge=0)] = 0
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[tuple[int, ...], ...] | None = None  # never complete these (token ids)
    # log-probabilities of the model's distribution (log-softmax of the raw logits): of each
    # sampled token plus this many top alternatives; of each prompt token (None: none). The
    # ingress bounds them by EngineConfig.max_logprobs; the workers by the vocabulary.
    logprobs: Annotated[int, Field(ge=0)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    # structured output: (kind, spec) for engine_actors/grammar.py: "json_schema" (the
    # schema as JSON), "json_object", "regex", "structural_tag" (xgrammar's, as JSON)
    grammar: tuple[str, str] | None = None
    # vLLM's thinking_token_budget: (the <think> token, or -1 when the prompt opens the
    # thinking; the </think> token; the tokens the answer may have before </think>)
    thinking_budget: tuple[int, int, int] | None = None

    @property
    def has_processors(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.allowed_token_ids is not None or bool(self.bad_words)
                    or self.thinking_budget is not None)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the pool, not in an in-flight batch (admitted or not)
    RUNNING = "running"  # part of at least one batch that the workers are executing
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the server
    DEADLINE = "deadline"  # its deadline passed before it could start


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    sink: Any = None  # who receives this request's outputs; opaque to the scheduler
    priority: int = 0  # lower runs first (vLLM's convention); batches get 1
    deadline: float = float("inf")  # absolute (arrival + deadline_ms); DAS/EDF order by it
    seq: int = 0  # the scheduler's count of requests added before this one
    # prompt followed by the generated tokens received so far
    token_ids: list[int] = field(default_factory=list)
    # tokens whose keys/values are in the KV cache or being computed by an in-flight step
    num_computed_tokens: int = 0
    # tokens sampled by in-flight steps, not yet received (a step with a speculative draft:
    # 1 + the draft's tokens, as if all were accepted)
    num_inflight_samples: int = 0
    num_inflight_steps: int = 0
    last_step: int = -1  # index of the latest step that scheduled it (Scheduler.num_steps)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_iterations: int = 0  # iterations this request took part in
    num_preemptions: int = 0  # times its KV was taken away (it is then recomputed)
    num_prompt_logprobs: int = 0  # prompt positions whose log-probabilities were delivered

    # KV bookkeeping, owned by KVCacheManager
    row: int = -1  # row in the workers' block table; -1 until admitted
    blocks: list[int] = field(default_factory=list)
    num_reserved_blocks: int = 0  # reserved for this request but not yet allocated
    num_blocks_sent: int = 0  # blocks the workers' table row already holds
    # prefix caching: hashes of its full blocks so far, how many of its blocks are
    # registered as reusable, what keys its cache entries (a LoRA adapter, say)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    cache_salt: str = ""
    num_cached_tokens: int = -1  # prompt tokens reused at its first admission (-1: not yet)
    # LoRA: its adapter (engine_actors.lora.AdapterInfo; None: the base model), and the
    # adapter's slot on the workers while admitted
    lora: Any = None
    lora_slot: int = -1
    # speculative decoding (speculative.py): its tokens as bytes for the n-gram lookup, and
    # the draft of its latest step in flight ([]: none)
    draft_index: Any = None
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.lora is not None:  # its KV differs from the base model's on the same tokens
            self.cache_salt = f"{self.lora.cache_salt}\x00{self.cache_salt}"

    @property
    def arrival(self) -> tuple[float, int]:
        """Arrival order, total (policies order and preempt by it): requests with the same
        arrival_time in the order the scheduler got them, so no two preempt each other."""
        return (self.arrival_time, self.seq)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens that can run next: the uncomputed known ones plus those being sampled now
        (a worker substitutes its own last sample for those)."""
        return self.num_tokens + self.num_inflight_samples - self.num_computed_tokens

    @property
    def num_cacheable_tokens(self) -> int:
        """How many of its first tokens a prefix-cache hit may cover: all known ones but the
        last (the step computing it gives the logits to sample from), or the prompt's only
        (presence/frequency penalties count the generated tokens as they go through the
        model), or none (prompt log-probabilities and the repetition penalty need every
        prompt position computed)."""
        s = self.sampling
        if s.prompt_logprobs is not None or s.repetition_penalty != 1.0:
            return 0
        if s.presence_penalty or s.frequency_penalty:
            return self.num_prompt_tokens - 1
        return self.num_tokens - 1

    @property
    def can_sample_more(self) -> bool:
        return self.num_output_tokens + self.num_inflight_samples < self.sampling.max_tokens

    @property
    def max_num_tokens(self) -> int:
        """ORCA's max_tokens: the most tokens this request can ever hold."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_admitted(self) -> bool:
        """Holds a table row and its KV (started, and not preempted since)."""
        return self.row >= 0

    @property
    def utility(self) -> float:
        """TCB's utility: 1 / length, the length being all the tokens it can take."""
        return 1.0 / self.max_num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_sampled(self, tokens: list[int], eos_token_ids: set[int]
                       ) -> tuple[list[int], FinishReason | None]:
        """Append a step's sampled tokens (several with a speculative draft) up to the first
        that ends the request: EOS, a stop token, max_tokens, or a negative id (NO_TOKEN:
        its masks left no token; it ends the request without being appended). Returns the
        tokens appended and why the request ends (None: it goes on)."""
        s = self.sampling
        for n, token in enumerate(tokens):
            if token < 0:
                return tokens[:n], FinishReason.STOP
            self.token_ids.append(token)
            if (not s.ignore_eos and token in eos_token_ids) or token in s.stop_token_ids:
                return tokens[:n + 1], FinishReason.STOP
            if self.num_output_tokens >= s.max_tokens:
                return tokens[:n + 1], FinishReason.LENGTH
        return list(tokens), None
