"""The engine's Prometheus metrics, kept by the scheduler actor (names as vLLM's, `orca:`).

The ingress serves them on GET /metrics next to its own per-request latency metrics
(deployments/http_metrics.py). Each process has its own registry, rendered as text.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self, model_name: str, engine: int = 0):
        """`engine`: the engine's rank among data_parallel_size (vLLM's `engine` label)."""
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": str(engine)}
        r = self.registry
        self.running = Gauge("orca:num_requests_running", "Requests holding KV (started)",
                             labelnames=labels, registry=r).labels(**labels)
        self.waiting = Gauge("orca:num_requests_waiting", "Requests waiting to start",
                             labelnames=labels, registry=r).labels(**labels)
        self.kv_usage = Gauge("orca:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              labelnames=labels, registry=r).labels(**labels)
        self.batch_requests = Histogram(
            "orca:iteration_batch_requests", "Requests per iteration", labelnames=labels,
            buckets=BATCH_BUCKETS, registry=r).labels(**labels)
        self.batch_tokens = Histogram(
            "orca:iteration_batch_tokens", "Tokens per iteration", labelnames=labels,
            buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.queue_time = Histogram(
            "orca:request_queue_time_seconds", "Arrival to first scheduled iteration",
            labelnames=labels, buckets=QUEUE_BUCKETS, registry=r).labels(**labels)
        self.preemptions = Counter("orca:num_preemptions", "Requests preempted (recomputed)",
                                   labelnames=labels, registry=r).labels(**labels)
        self._finished = Counter("orca:request_finished", "Requests the engine finished, by "
                                 "finish reason", labelnames=[*labels, "finished_reason"],
                                 registry=r)
        # token throughput, as vLLM's prompt_tokens_total / generation_tokens_total
        self.prompt_tokens = Counter("orca:prompt_tokens", "Prompt tokens of requests that "
                                     "started generating", labelnames=labels,
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("orca:generation_tokens", "Generated tokens",
                                         labelnames=labels, registry=r).labels(**labels)
        self.request_prompt_tokens = Histogram(
            "orca:request_prompt_tokens", "Prompt tokens per finished request",
            labelnames=labels, buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.request_generation_tokens = Histogram(
            "orca:request_generation_tokens", "Generated tokens per finished request",
            labelnames=labels, buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        # prefix cache, in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits
        self.prefix_queries = Counter("orca:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache", labelnames=labels,
                                      registry=r).labels(**labels)
        self.prefix_hits = Counter("orca:prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache", labelnames=labels,
                                   registry=r).labels(**labels)
        self._prefix_seen = 0, 0
        self._lora_requests = Counter("orca:lora_requests", "Requests per LoRA adapter",
                                      labelnames=[*labels, "lora_name"], registry=r)
        # fine-tuning in idle time (finetune_jobs.py): micro-batches run, tokens trained, and
        # how long each took (inference waited at most that long behind it)
        self.finetune_steps = Counter("orca:finetune_steps", "Fine-tuning micro-batches run",
                                      labelnames=labels, registry=r).labels(**labels)
        self.finetune_tokens = Counter("orca:finetune_trained_tokens", "Tokens of fine-tuning "
                                       "micro-batches", labelnames=labels,
                                       registry=r).labels(**labels)
        self.finetune_step_time = Histogram(
            "orca:finetune_step_seconds", "Wall time of one fine-tuning micro-batch",
            labelnames=labels, buckets=QUEUE_BUCKETS, registry=r).labels(**labels)
        self.finetune_lent_blocks = Gauge(
            "orca:finetune_lent_kv_blocks", "KV blocks whose memory a fine-tuning step holds",
            labelnames=labels, registry=r).labels(**labels)
        # speculative decoding, as vLLM's spec_decode_* counters (engine_actors/speculative.py)
        self.spec_drafts = Counter("orca:spec_decode_num_drafts", "Drafts verified",
                                   labelnames=labels, registry=r).labels(**labels)
        self.spec_draft_tokens = Counter("orca:spec_decode_num_draft_tokens", "Draft tokens "
                                         "verified", labelnames=labels,
                                         registry=r).labels(**labels)
        self.spec_accepted = Counter("orca:spec_decode_num_accepted_tokens", "Draft tokens "
                                     "accepted", labelnames=labels, registry=r).labels(**labels)
        self._spec_per_position = Counter(
            "orca:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
            "position in their draft", labelnames=[*labels, "position"], registry=r)
        self._spec_seen: list[int] = []
        self._labels = labels
        for reason in ("stop", "length", "abort", "deadline"):  # every series from the start
            self._finished.labels(**labels, finished_reason=reason)

    def finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._finished.labels(**self._labels, finished_reason=reason).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)

    def count(self, outputs) -> None:
        """An iteration's outputs (engine_actors.scheduler.RequestOutput): generated tokens,
        the prompt tokens of requests that produced their first token, finished requests.
        The token counters move once per iteration: the loop stays cheap."""
        generated = prompt = 0
        for out in outputs:
            n = len(out.new_token_ids)
            generated += n
            if n and out.num_output_tokens == n:  # its first token: its prompt ran
                prompt += out.num_prompt_tokens
            if out.finish_reason is not None:
                self.finished(out.finish_reason, out.num_prompt_tokens, out.num_output_tokens)
        if generated:
            self.generation_tokens.inc(generated)
        if prompt:
            self.prompt_tokens.inc(prompt)

    def lora_request(self, lora_name: str) -> None:
        self._lora_requests.labels(**self._labels, lora_name=lora_name).inc()

    def prefix_cache(self, queried: int, hits: int) -> None:
        """Bring the prefix cache counters up to the KV manager's running totals."""
        seen_queried, seen_hits = self._prefix_seen
        self.prefix_queries.inc(queried - seen_queried)
        self.prefix_hits.inc(hits - seen_hits)
        self._prefix_seen = queried, hits

    def speculation(self, spec) -> None:
        """Bring the speculative decoding counters up to the speculator's totals."""
        totals = [spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                  *spec.accepted_per_position]
        counters = [self.spec_drafts, self.spec_draft_tokens, self.spec_accepted] + [
            self._spec_per_position.labels(**self._labels, position=str(i))
            for i in range(len(spec.accepted_per_position))]
        seen = self._spec_seen or [0] * len(totals)
        for counter, total, before in zip(counters, totals, seen):
            counter.inc(total - before)
        self._spec_seen = totals

    def render(self) -> bytes:
        return generate_latest(self.registry)
