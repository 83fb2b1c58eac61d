"""A fine-tuning job: OpenAI's fields, its examples, and the order it trains them in
(batches per epoch, split into micro-batches that fit a token cap). The scheduler actor's
FineTuning (finetune_jobs.py) runs its micro-batches and records their results here."""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Job:
    id: str
    model: str
    training_file: str
    examples: list[tuple[list[int], list[bool]]]  # tokens, trained-on mask
    n_epochs: int
    batch_size: int
    learning_rate: float
    lora: dict  # r, alpha, target_modules
    suffix: str | None
    seed: int
    learning_rate_multiplier: float = 1.0  # over the default rate (OpenAI's field)
    metadata: dict | None = None  # the client's, returned as given
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    finished_at: int | None = None
    fine_tuned_model: str | None = None
    error: dict | None = None
    trained_tokens: int = 0
    steps_done: int = 0
    events: list[dict] = field(default_factory=list)
    started: bool = False  # its trainer exists on the worker
    bytes_per_token: float | None = None  # a micro-batch's peak memory per token, measured
    measured_tokens: int = 0  # the size of the micro-batch that figure comes from
    _plan: list[list[int]] = field(default_factory=list)  # batches of example indices
    _rest: list[int] = field(default_factory=list)  # the current batch's examples not run
    _batch_tokens: int = 0  # the current batch's trained tokens
    _loss_sum: float = 0.0  # of the micro-batches recorded since the last batch ended
    num_examples: int = field(init=False)

    def __post_init__(self):
        self.num_examples = len(self.examples)

    @property
    def total_steps(self) -> int:
        return self.n_epochs * -(-self.num_examples // self.batch_size)

    def release(self) -> None:
        """The job has ended: its examples and plan are freed (its record stays)."""
        self.examples, self._plan, self._rest = [], [], []

    def to_dict(self) -> dict:
        hyper = {"n_epochs": self.n_epochs, "batch_size": self.batch_size,
                 "learning_rate_multiplier": self.learning_rate_multiplier,
                 "learning_rate": self.learning_rate}
        return {"object": "fine_tuning.job", "id": self.id, "model": self.model,
                "created_at": self.created_at, "finished_at": self.finished_at,
                "fine_tuned_model": self.fine_tuned_model, "status": self.status,
                "training_file": self.training_file, "validation_file": None,
                "hyperparameters": hyper,
                "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
                "lora": self.lora, "suffix": self.suffix, "user_provided_suffix": self.suffix,
                "metadata": self.metadata, "integrations": [], "estimated_finish": None,
                "seed": self.seed, "trained_tokens": self.trained_tokens,
                "steps_done": self.steps_done, "total_steps": self.total_steps,
                "error": self.error, "result_files": [], "organization_id": "orca-serve"}

    def event(self, message: str, data: dict | None = None, level: str = "info") -> None:
        self.events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{uuid.uuid4().hex[:24]}",
                            "created_at": int(time.time()), "level": level,
                            "message": message, "data": data or {},
                            "type": "metrics" if data else "message"})

    def next_micro(self, max_tokens: int) -> tuple[list[int], int, bool] | None:
        """The next micro-batch, taken (`peek_micro`, then `take_micro`); None when the next
        example alone is over max_tokens."""
        micro = self.peek_micro(max_tokens)
        return (micro, *self.take_micro(micro)) if micro else None

    def peek_micro(self, max_tokens: int) -> list[int]:
        """The example indices of the next micro-batch of at most max_tokens tokens, in
        order (empty when the next example alone is over it); not taken yet."""
        self._start_batch()
        micro, size = [], 0
        for i in self._rest:
            size += len(self.examples[i][0])
            if size > max_tokens:
                break
            micro.append(i)
        return micro

    def take_micro(self, micro: list[int]) -> tuple[int, bool]:
        """Take the micro-batch `peek_micro` returned: its batch's trained tokens, and
        whether it ends its batch."""
        assert micro and self._rest[:len(micro)] == micro
        del self._rest[:len(micro)]
        return self._batch_tokens, not self._rest

    def untake(self, micro: list[int]) -> None:
        """The micro-batch taken last did not run (called off): it is next again."""
        self._rest[:0] = micro

    def has_next(self) -> bool:
        """A micro-batch is left after those taken."""
        return bool(self._rest or self._plan)

    def measure_memory(self, peak_bytes: int, tokens: int) -> None:
        """A micro-batch's peak memory. The figure per token is the largest micro-batch's
        (the worst of equal ones): a small one's fixed costs (the LoRA weights cast for the
        pass) weigh more per token, and would shrink every later micro-batch."""
        if tokens > self.measured_tokens or tokens == self.measured_tokens \
                and peak_bytes / tokens > (self.bytes_per_token or 0.0):
            self.bytes_per_token, self.measured_tokens = peak_bytes / tokens, tokens

    def next_length(self) -> int:
        """Tokens of the next example to train on."""
        self._start_batch()
        return len(self.examples[self._rest[0]][0])

    def _start_batch(self) -> None:
        if self._rest:
            return
        if not self._plan:
            for epoch in range(self.n_epochs):
                order = list(range(len(self.examples)))
                random.Random(self.seed + epoch).shuffle(order)
                self._plan += [order[i:i + self.batch_size]
                               for i in range(0, len(order), self.batch_size)]
            self._plan = self._plan[self.steps_done:]
        self._rest = self._plan.pop(0)
        self._batch_tokens = sum(sum(self.examples[i][1]) for i in self._rest)

    def record(self, tokens: int, loss_sum: float, batch_loss_tokens: int,
               ends_batch: bool) -> float | None:
        """A micro-batch's result, in the order they were taken (the next one may have been
        taken before, even from the next batch); at the end of its batch, the batch's mean
        loss over its `batch_loss_tokens` (a step)."""
        self.trained_tokens += tokens
        self._loss_sum += loss_sum
        if not ends_batch:
            return None
        self.steps_done += 1
        loss, self._loss_sum = self._loss_sum / max(1, batch_loss_tokens), 0.0
        return loss
