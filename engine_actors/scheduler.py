"""The request pool and the per-iteration bookkeeping, free of Ray and of the model.

`schedule()` asks the policy for a batch, allocates KV blocks and builds the step message;
`process()` applies the sampled tokens, finishes requests and frees their KV at once. The
scheduler actor drives these two around the workers; tests drive them with a fake runner.

With `allow_continuation`, a request may be scheduled again while a step that samples its
next token is still in flight (overlapped scheduling): the step message carries
CONTINUE (-1) for that token and the worker substitutes its own last sample for the row.
Without it, the batches in flight are disjoint (ORCA, needed with pipeline stages).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_actors.kv_cache import KVCacheManager
from engine_actors.messages import NewRequest, StepInput
from engine_actors.policies import Budget, Policy, Scheduled
from engine_actors.request import FinishReason, Request, RequestStatus


CONTINUE = -1  # "the token this row's previous step samples", resolved on the worker


class RequestRejected(ValueError):
    """The request can never run (too long for the model or the KV pool)."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    client_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(slots=True)
class Batch:
    step: StepInput
    scheduled: list[Scheduled]
    epochs: list[int]  # each request's num_preemptions when scheduled: later results are stale


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: Policy, budget: Budget, max_model_len: int,
                 eos_token_ids: set[int], allow_continuation: bool = False):
        self.kv = kv
        self.policy = policy
        self.budget = budget
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.allow_continuation = allow_continuation
        self.pool: dict[str, Request] = {}  # unfinished requests, in arrival order
        self.num_preemptions = 0

    @property
    def num_requests(self) -> int:
        return len(self.pool)

    @property
    def num_running(self) -> int:
        """Admitted requests: each holds one table row."""
        return self.kv.max_num_seqs - self.kv.num_free_rows

    def is_ready(self, req: Request) -> bool:
        """Can `req` take part in the next step? Once its samples (received or in flight)
        reach max_tokens, the only token left uncomputed is the last sample, never needed."""
        if req.status is RequestStatus.RUNNING and not self.allow_continuation:
            return False
        return req.num_new_tokens > 0 and req.can_sample_more

    def add(self, req: Request) -> None:
        """Put a request in the pool, or raise RequestRejected if it could never run."""
        if req.request_id in self.pool:
            raise RequestRejected(f"duplicate request id {req.request_id}")
        if req.max_num_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) "
                f"= {req.max_num_tokens} exceeds the model's context length {self.max_model_len}")
        if not self.kv.can_ever_fit(req):
            raise RequestRejected(
                f"prompt + max_tokens = {req.max_num_tokens} tokens exceeds the KV cache capacity "
                f"of {self.kv.num_blocks * self.kv.block_size} tokens")
        self.pool[req.request_id] = req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its KV. A token of it still in flight is dropped:
        workers run steps in order, so freed blocks are only reused by later steps."""
        req = self.pool.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT)

    def expire(self, now: float) -> list[RequestOutput]:
        """Finish the requests whose deadline passed before they could start. One that ran
        and was preempted since has started: it finishes normally."""
        late = [r for r in self.pool.values() if r.num_iterations == 0 and r.deadline < now]
        return [self._finish(r, FinishReason.DEADLINE) for r in late]

    def schedule(self, now: float = 0.0) -> Batch | None:
        ready = [r for r in self.pool.values() if self.is_ready(r)]
        admitted = [r for r in self.pool.values() if r.is_admitted]
        selection = self.policy.select(ready, self.kv, self.budget, now, admitted)
        for victim in selection.preempt:
            self._preempt(victim)
        if not selection.batch:
            return None
        step = StepInput()
        for item in selection.batch:
            req, n = item.request, item.num_tokens
            start = req.num_computed_tokens
            if start == 0:  # just admitted: the workers learn its row's sampling settings
                s = req.sampling
                step.new_requests.append(NewRequest(req.row, s.temperature, s.top_p, s.top_k,
                                                    s.seed, req.num_output_tokens))
            self.kv.grow(req, req.num_computed_tokens + n)  # a no-op if the policy grew it
            first_col = req.num_blocks_sent  # the workers' table row has blocks up to here
            new_blocks = req.blocks[first_col:]
            req.num_blocks_sent = len(req.blocks)
            step.table_rows.extend([req.row] * len(new_blocks))
            step.table_cols.extend(range(first_col, first_col + len(new_blocks)))
            step.table_blocks.extend(new_blocks)
            step.rows.append(req.row)
            step.context_lens.append(start)
            step.query_lens.append(n)
            known = req.token_ids[start:start + n]
            step.token_ids.extend(known)
            step.token_ids.extend([CONTINUE] * (n - len(known)))
            sample = start + n == req.num_tokens + req.num_inflight_samples
            step.sample.append(sample)
            req.num_inflight_samples += sample
            req.num_computed_tokens += n
            req.num_iterations += 1
            req.num_inflight_steps += 1
            req.status = RequestStatus.RUNNING
        return Batch(step, selection.batch, [s.request.num_preemptions for s in selection.batch])

    def _preempt(self, req: Request) -> None:
        """Its KV is gone (the policy freed it): it starts over from its prompt and the
        tokens generated so far. Results of its steps still in flight are dropped."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_inflight_samples = req.num_inflight_steps = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1

    def process(self, batch: Batch, sampled: list[int]) -> list[RequestOutput]:
        """Apply one step's sampled tokens (one per request with sample=True)."""
        outputs = []
        tokens = iter(sampled)
        for item, epoch, do_sample in zip(batch.scheduled, batch.epochs, batch.step.sample):
            req = item.request
            token = next(tokens) if do_sample else None
            if req.is_finished or req.num_preemptions != epoch:
                continue  # finished, aborted or preempted while this step was in flight
            req.num_inflight_steps -= 1
            req.num_inflight_samples -= do_sample
            if req.num_inflight_steps == 0:
                req.status = RequestStatus.WAITING
            if token is None:
                continue
            req.token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                outputs.append(self._finish(req, reason, [token]))
            else:
                outputs.append(self._output(req, [token]))
        return outputs

    def fail_all(self) -> list[RequestOutput]:
        """Abort every request; returns their final outputs."""
        return [self._finish(req, FinishReason.ABORT) for req in list(self.pool.values())]

    def fail_started(self) -> list[RequestOutput]:
        """Abort the requests whose state lived on the workers (they failed); the ones still
        waiting keep their place and run on the new workers."""
        return [self._finish(req, FinishReason.ABORT) for req in list(self.pool.values())
                if req.is_admitted or req.num_inflight_steps]

    @property
    def num_waiting(self) -> int:
        return len(self.pool) - self.num_running

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        s = req.sampling
        if not s.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in s.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= s.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, tokens: list[int] | None = None):
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req)
        del self.pool[req.request_id]
        out = self._output(req, tokens or [])
        out.finish_reason = reason.value
        return out

    @staticmethod
    def _output(req: Request, tokens: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, req.client_id, tokens, None,
                             req.num_prompt_tokens, req.num_output_tokens)
