"""The request pool and the per-iteration bookkeeping, free of Ray and of the model.

`schedule()` asks the policy for a batch, applies its plan to the KV manager (this class,
with the speculator it calls, is the only one that changes KV state) and builds the step
message; `process()` applies the sampled tokens, finishes requests and frees their KV at
once. The scheduler actor drives these two around the workers; tests drive them with a fake
runner. With a speculator, decodes carry n-gram drafts (speculative.py) that `process()`
verifies.

With prefix caching, a request starts from its prefix's cached blocks (taken before any
block is given out: that may evict), and `process()` registers the blocks a step filled.

No per-iteration work scans the whole pool: waiting requests are kept in the policy's order,
admitted ones (at most max_num_seqs) in their own table, deadlines in a heap.

With `allow_continuation`, a request may be scheduled again while a step that samples its
next token is still in flight: the step carries CONTINUE (-1) for that token, and the
worker substitutes the row's last sample, still on the device. Without it, the batches in
flight are disjoint (ORCA). With `stride` P (pipeline stages), a request's steps are at
least P apart: the P steps in the pipeline are disjoint while each batch's next steps
queue behind them (the first stage gets the last stage's samples: stage_link.TokenLink).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field

from engine_actors.config import EngineConfig
from engine_actors.kv_cache import KVCacheManager, context_len
from engine_actors.lora import LoRASlots
from engine_actors.messages import RequestOutput, StepInput, StepResult
from engine_actors.policies import Budget, Policy, Scheduled, make_policy
from engine_actors.request import FinishReason, Request, RequestStatus
from engine_actors.speculative import Speculator
from engine_actors.step_extras import (add_to_step, new_prompt_logprobs, new_request, trim,
                                       wants_prompt_logprobs)


class RequestRejected(ValueError):
    """The request can never run (too long for the model or the KV pool)."""


@dataclass(slots=True)
class Batch:
    step: StepInput
    scheduled: list[Scheduled]
    epochs: list[int]  # each request's num_preemptions when scheduled: later results are stale
    prompt_starts: list[int] = field(default_factory=list)  # per step.prompt_logprobs entry
    drafts: list[list[int]] | None = None  # per request, with speculative decoding


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: Policy, budget: Budget, max_model_len: int,
                 eos_token_ids: set[int], allow_continuation: bool = False,
                 loras: LoRASlots | None = None, stride: int = 1,
                 speculator: Speculator | None = None):
        self.kv = kv
        self.speculator = speculator  # n-gram drafts of decodes (None: no speculation)
        self.loras = loras  # LoRA adapter slots of the workers (None: no adapters)
        self.policy = policy
        self.budget = budget
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.allow_continuation = allow_continuation
        self.stride = stride  # steps between a request's consecutive steps, at least
        self.num_steps = 0  # steps built so far: the next one's index
        self.num_added = 0  # requests ever added (each one's Request.seq)
        self.pool: dict[str, Request] = {}  # unfinished requests
        self.admitted: dict[str, Request] = {}  # those holding a table row and KV
        self.waiting: list[Request] = []  # the others, sorted by policy.key
        self._deadlines: list[tuple[float, int, Request]] = []  # heap of unstarted deadlines
        self._seq = itertools.count()
        self.num_preemptions = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig, num_blocks: int, model_len: int,
                    eos_token_ids: set[int] | tuple[int, ...],
                    policy: Policy | None = None) -> Scheduler:
        """The one place that turns engine args into a scheduler (actor, tests, simulator).
        model_len: the checkpoint's context; `policy` overrides the configured one."""
        capacity = num_blocks * cfg.block_size
        kv = KVCacheManager(num_blocks, cfg.block_size, cfg.max_num_seqs,
                            cfg.enable_prefix_caching)
        return cls(kv, policy or make_policy(cfg.scheduling_policy),
                   Budget(cfg.max_batch_size, cfg.max_num_batched_tokens),
                   context_len(model_len, cfg.max_model_len, capacity), set(eos_token_ids),
                   allow_continuation=cfg.async_scheduling,
                   loras=LoRASlots(cfg.max_loras) if cfg.lora_enabled else None,
                   stride=cfg.pipeline_parallel_size,
                   speculator=Speculator(cfg.speculative_config)
                   if cfg.speculative_config else None)

    @property
    def num_requests(self) -> int:
        return len(self.pool)

    @property
    def num_running(self) -> int:
        """Admitted requests: each holds one table row."""
        return len(self.admitted)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_ready(self, req: Request) -> bool:
        """Can admitted `req` take part in the next step? Once its samples (received or in
        flight) reach max_tokens, the only token left uncomputed is the last sample."""
        if req.status is RequestStatus.RUNNING and (
                not self.allow_continuation or self.num_steps - req.last_step < self.stride):
            return False
        return req.num_new_tokens > 0 and req.can_sample_more

    def add(self, req: Request) -> None:
        """Put a request in the pool, or raise RequestRejected if it could never run."""
        if req.request_id in self.pool:
            raise RequestRejected(f"duplicate request id {req.request_id}")
        if req.lora is not None and self.loras is None:
            raise RequestRejected("LoRA adapters are not enabled on this server")
        if req.max_num_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) "
                f"= {req.max_num_tokens} exceeds the model's context length {self.max_model_len}")
        if not self.kv.can_ever_fit(req):
            raise RequestRejected(
                f"prompt + max_tokens = {req.max_num_tokens} tokens exceeds the KV cache capacity "
                f"of {self.kv.num_blocks * self.kv.block_size} tokens")
        req.seq = self.num_added
        self.num_added += 1
        self.pool[req.request_id] = req
        self._enqueue(req)
        if req.deadline != float("inf"):
            heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))

    def abort(self, request_id: str,
              reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Finish a request now and free its KV. A token of it still in flight is dropped:
        workers run steps in order, so freed blocks are only reused by later steps."""
        req = self.pool.get(request_id)
        if req is None:
            return None
        return self._finish(req, reason)

    def expire(self, now: float) -> list[RequestOutput]:
        """Finish the requests whose deadline passed before they could start. One that ran
        and was preempted since has started: it finishes normally."""
        late = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, req = heapq.heappop(self._deadlines)
            if not req.is_finished and req.num_iterations == 0:
                late.append(self._finish(req, FinishReason.DEADLINE))
        return late

    def schedule(self, hold_from: float | None = None) -> Batch | None:
        """The next step's batch, or None. `hold_from`: requests that arrived at or after
        this time and have not started stay waiting (FineInfer's deferral: the running
        batch drains so that a fine-tuning step can run; finetune_jobs.py)."""
        ready = [r for r in self.admitted.values() if self.is_ready(r)]
        waiting = self.waiting if hold_from is None else [
            r for r in self.waiting if r.arrival_time < hold_from or r.num_iterations]
        selection = self.policy.select(ready, waiting, list(self.admitted.values()),
                                       self.kv, self.budget, self.loras)
        for victim in selection.preempt:
            self._preempt(victim)
        if not selection.batch:
            return None
        step = StepInput()
        batch = Batch(step, selection.batch, [s.request.num_preemptions for s in selection.batch])
        # every new request takes its cached blocks before any block is given out: giving
        # out blocks may evict unreferenced cached ones
        new = {id(item.request) for item in selection.batch if not item.request.is_admitted}
        adapters = {item.request.lora.id for item in selection.batch if item.request.lora}
        for item in selection.batch:
            if id(item.request) in new:
                self._admit(item.request, item.hits, step, adapters)
        for item in selection.batch:  # every request's own tokens before any draft's
            self.kv.grow(item.request, item.request.num_computed_tokens + item.num_tokens)
        if self.speculator is not None:
            batch.drafts = self.speculator.draft(
                selection.batch, self.kv,
                self.budget.max_num_tokens - sum(item.num_tokens for item in selection.batch))
        for index, item in enumerate(selection.batch):
            req, n = item.request, item.num_tokens
            start = req.num_computed_tokens
            if id(req) in new:  # the workers learn its row's sampling settings
                step.new_requests.append(new_request(req, self.eos_token_ids))
            if wants_prompt_logprobs(req, start):
                end = start + n
                following = req.token_ids[end] if end < req.num_prompt_tokens else -1
                step.prompt_logprobs.append((index, req.sampling.prompt_logprobs, following))
                batch.prompt_starts.append(start)
            draft = batch.drafts[index] if batch.drafts else None
            req.num_inflight_samples += add_to_step(step, req, n, draft) * (1 + len(draft or ()))
            req.num_computed_tokens += n + len(draft or ())
            req.draft = draft or []
            req.num_iterations += 1
            req.num_inflight_steps += 1
            req.last_step = self.num_steps
            req.status = RequestStatus.RUNNING
        self.num_steps += 1
        return batch

    def _admit(self, req: Request, hits: list[int], step: StepInput, adapters: set[int]) -> None:
        """Give `req` KV (its cached prefix counts as computed) and its adapter's slot
        (loaded first if it is not resident; `adapters` of this step stay resident)."""
        self.waiting.remove(req)
        self.kv.admit(req, self.policy.reservation(req), hits)
        if req.lora is not None:
            req.lora_slot, load = self.loras.acquire(req.lora, adapters)
            if load:
                step.lora_loads.append((req.lora_slot, req.lora.weights, req.lora.scale))
        self.admitted[req.request_id] = req
        req.num_computed_tokens = len(hits) * self.kv.block_size
        if req.num_cached_tokens < 0:  # what its response reports: the first admission's
            req.num_cached_tokens = req.num_computed_tokens

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self.policy.key)

    def _preempt(self, req: Request) -> None:
        """Its KV goes back to the pool: it starts over from its prompt and the tokens
        generated so far. Results of its steps still in flight are dropped."""
        self._release(req)
        req.num_computed_tokens = 0
        req.num_inflight_samples = req.num_inflight_steps = 0
        req.draft = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def process(self, batch: Batch, result: StepResult | list[int]) -> list[RequestOutput]:
        """Apply one step's sampled tokens (one per request with sample=True, and one per
        draft token)."""
        if not isinstance(result, StepResult):
            result = StepResult(result)
        outputs = []
        tokens, prompt = iter(result.token_ids), new_prompt_logprobs(batch, result)
        logprobs, embeddings = iter(result.logprobs or ()), iter(result.embeddings or ())
        for index, (item, epoch, do_sample) in enumerate(zip(batch.scheduled, batch.epochs,
                                                             batch.step.sample)):
            req = item.request
            draft = batch.drafts[index] if batch.drafts else []
            count = do_sample * (1 + len(draft))
            sampled = [next(tokens) for _ in range(count)]
            token_logprobs = [next(logprobs, None) for _ in range(count)]
            embedding = next(embeddings, None) if do_sample else None
            if req.is_finished or req.num_preemptions != epoch:
                continue  # finished, aborted or preempted while this step was in flight
            req.num_inflight_steps -= 1
            req.num_inflight_samples -= count
            if draft:  # the KV of rejected draft tokens is written over later
                sampled = self.speculator.accept(draft, sampled)
                req.num_computed_tokens -= len(draft) + 1 - len(sampled)
            # the step wrote its tokens' KV: the blocks it filled may serve later prompts
            # (of the tokens known before it: never a draft's)
            end = batch.step.context_lens[index] + batch.step.query_lens[index]
            if end >= (req.num_registered_blocks + 1) * self.kv.block_size:
                self.kv.cache_blocks(req, end)
            if req.num_inflight_steps == 0:
                req.status = RequestStatus.WAITING
                req.draft = []
            new_prompt = prompt.get(index)
            if not sampled:
                if new_prompt:
                    outputs.append(self._output(req, [], prompt_logprobs=new_prompt))
                continue
            # an embedding (runner "pooling") ends its request with no token
            new, reason = ([], FinishReason.STOP) if embedding is not None else \
                req.append_sampled(sampled, self.eos_token_ids)
            k = req.sampling.logprobs
            lps = [trim(x, k) for x in token_logprobs[:len(new)] if x is not None] \
                if k is not None else None
            out = self._finish(req, reason, new) if reason is not None else \
                self._output(req, new)
            out.logprobs, out.prompt_logprobs, out.embedding = lps or None, new_prompt, embedding
            outputs.append(out)
        return outputs

    def fail_all(self) -> list[RequestOutput]:
        """Abort every request; returns their final outputs."""
        return [self._finish(req, FinishReason.ABORT) for req in list(self.pool.values())]

    def fail_started(self) -> list[RequestOutput]:
        """Abort the requests whose state lived on the workers (they failed); the ones still
        waiting keep their place and run on the new workers."""
        return [self._finish(req, FinishReason.ABORT) for req in list(self.pool.values())
                if req.is_admitted or req.num_inflight_steps]

    def _release(self, req: Request) -> None:
        """An admitted request gives back its KV, row and adapter slot."""
        self.kv.free(req)
        del self.admitted[req.request_id]
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    def _finish(self, req: Request, reason: FinishReason, tokens: list[int] | None = None):
        if req.is_admitted:
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.pool[req.request_id]
        out = self._output(req, tokens or [])
        out.finish_reason = reason.value
        return out

    @staticmethod
    def _output(req: Request, tokens: list[int], prompt_logprobs=None) -> RequestOutput:
        return RequestOutput(req.request_id, req.sink, tokens, None, req.num_prompt_tokens,
                             req.num_output_tokens, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=max(0, req.num_cached_tokens))
