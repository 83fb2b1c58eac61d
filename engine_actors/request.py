"""The core data model: a request, its sampling parameters, status and counters."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int  # tokens to generate at most
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None  # a seeded request samples the same tokens in any batch
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def check(self) -> str | None:
        """Why these parameters cannot run, or None. The ingress validates its own inputs;
        this guards the engine against any other caller (one bad request must not take a
        step, and with it every request in the batch, down)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            return "max_tokens must be an integer >= 1"
        if not 0.0 <= self.temperature < float("inf"):
            return "temperature must be a finite number >= 0"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p must be in (0, 1]"
        if not 0 <= self.top_k < 2**31:
            return "top_k must be in [0, 2^31)"
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            return "seed must be a 64-bit integer"
        return None


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the pool, not in an in-flight batch (started or not)
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
    client_id: str = ""
    priority: int = 0  # higher runs first under the priority policy
    deadline: float = float("inf")  # absolute (arrival + deadline_ms); DAS/EDF order by it
    # prompt followed by the generated tokens received so far
    token_ids: list[int] = field(default_factory=list)
    # tokens whose keys/values are in the KV cache or being computed by an in-flight step
    num_computed_tokens: int = 0
    num_inflight_samples: int = 0  # tokens sampled by in-flight steps, not yet received
    num_inflight_steps: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_iterations: int = 0  # iterations this request took part in
    num_preemptions: int = 0  # times its KV was taken away (it is then recomputed)

    # KV bookkeeping, owned by KVCacheManager
    row: int = -1  # row in the workers' block table; -1 until admitted
    blocks: list[int] = field(default_factory=list)
    num_reserved_blocks: int = 0  # reserved for this request but not yet allocated
    num_blocks_sent: int = 0  # blocks the workers' table row already holds

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
    def can_sample_more(self) -> bool:
        return self.num_output_tokens + self.num_inflight_samples < self.sampling.max_tokens

    @property
    def max_num_tokens(self) -> int:
        """ORCA's max_tokens: the most tokens this request can ever hold."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_admitted(self) -> bool:
        return self.row >= 0

    @property
    def is_started(self) -> bool:
        """Holds KV (admitted and not preempted since)."""
        return self.row >= 0

    @property
    def utility(self) -> float:
        """TCB's utility: 1 / length, the length being all the tokens it can take."""
        return 1.0 / self.max_num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
