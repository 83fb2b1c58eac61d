"""Request traces with fixed seeds, saved and loaded as JSON Lines.

Each request: {"prompt_token_ids": [...], "max_tokens": int, "arrival_s": float} plus
"deadline_s" (seconds after arrival) where the workload has deadlines. EOS is ignored by
every system that replays a trace, so each request generates exactly max_tokens. Prompts
are random token ids: serving cost depends on lengths, not on which ids they are.

    python -m load_tests.traces tcb --num-requests 2000 --rate 50 --out tcb.jsonl

Workloads:
  orca      ORCA (OSDI '22) section 6.2: prompt ~ U(32, 512), output ~ U(1, 128), all at t=0.
  tcb       TCB (ICPP '22) section 6.2: lengths 3-100 from a normal distribution (mean 20,
            variance 20 or 100), Poisson arrivals, per-request deadlines (ours, see tcb_trace).
  sharegpt  a ShareGPT-like synthetic: long-tailed lognormal lengths, mean ~160 prompt /
            ~340 output tokens, clipped to a maximum context.
  shared-prefix  one system prompt of --prefix-len tokens (2000), then a distinct question
            of ~100 tokens; 128 output tokens (prefix caching).
  multi-turn  conversations of --turns turns (5): each turn sends the whole history (earlier
            prompts and answers) plus a new ~100-token user message; 100 output tokens. Only
            the new messages are stored: the load client builds each prompt from the
            answers it got (prefix caching).
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TraceRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    deadline_s: float | None = None  # must finish this long after arrival (None: no deadline)
    # multi-turn: the conversation this turn belongs to (prompt_token_ids: only its new
    # message; the client puts the history before it)
    conversation: int | None = None


def orca_trace(num_requests: int = 256, vocab_size: int = 128256, seed: int = 0,
               prompt_len: tuple[int, int] = (32, 512), output_len: tuple[int, int] = (1, 128)
               ) -> list[TraceRequest]:
    """ORCA's offline trace (section 6.2): prompt ~ U(32, 512) random ids, max_tokens ~ U(1, 128),
    all requests present at t=0."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        out.append(TraceRequest([rng.randrange(vocab_size) for _ in range(n)],
                                rng.randint(*output_len)))
    return out


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Arrival offsets (s) with gamma-distributed gaps of mean 1/rate; the first is at 0.

    burstiness is the gamma shape: 1 gives a Poisson process (exponential gaps), smaller is
    burstier (squared coefficient of variation of the gaps = 1/burstiness). rate=inf: all at 0.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def tcb_trace(num_requests: int = 1000, rate: float = 100.0, variance: float = 20.0,
              vocab_size: int = 128256, seed: int = 0, mean: float = 20.0,
              length_range: tuple[int, int] = (3, 100), slack: tuple[float, float] = (1.5, 4.0),
              per_token_s: float = 0.02) -> list[TraceRequest]:
    """TCB's online workload (section 6.2): sentence lengths 3-100 drawn from a normal
    distribution with mean 20 and variance 20 (Figs. 9-11) or 100 (Fig. 12), arriving as a
    Poisson process at `rate` requests/s.

    TCB serves a seq2seq model; for a decoder-only model the prompt length and the output
    length (max_tokens) are drawn independently from that same distribution:
    round(N(mean, variance)) clipped to [3, 100].

    TCB gives every request a deadline but not its distribution; ours is
        deadline_s = slack * (prompt_len + max_tokens) * per_token_s,  slack ~ U(1.5, 4),
    measured from arrival. Set per_token_s to the served system's unloaded time per token
    (its normalized latency at the lowest rate) so that slack reads as "times the unloaded
    latency"; the default, 20 ms, is a typical decode step of an 8B model on one GPU.
    """
    rng = random.Random(seed)
    lo, hi = length_range
    sd = math.sqrt(variance)
    arrivals = arrival_times(num_requests, rate, 1.0, seed=rng.randrange(2**31))
    out = []
    for arrival in arrivals:
        n_prompt = min(max(round(rng.gauss(mean, sd)), lo), hi)
        n_output = min(max(round(rng.gauss(mean, sd)), lo), hi)
        deadline = rng.uniform(*slack) * (n_prompt + n_output) * per_token_s
        out.append(TraceRequest([rng.randrange(vocab_size) for _ in range(n_prompt)], n_output,
                                arrival, deadline))
    return out


def sharegpt_trace(num_requests: int = 1000, vocab_size: int = 128256, seed: int = 0,
                   prompt_mean: float = 160.0, output_mean: float = 340.0,
                   prompt_sigma: float = 1.0, output_sigma: float = 0.8,
                   max_context: int = 2048) -> list[TraceRequest]:
    """A ShareGPT-like synthetic: lognormal (long-tailed) lengths whose unclipped means are
    `prompt_mean` and `output_mean` (mu = ln(mean) - sigma^2 / 2), rounded, the prompt clipped
    to [4, max_context // 2] and the output to [1, max_context - prompt]. Clipping trims the
    tail, so sample means come out a few percent below the targets. All arrive at t=0: the
    load client assigns arrival times per rate."""
    rng = random.Random(seed)
    mu_p = math.log(prompt_mean) - prompt_sigma ** 2 / 2
    mu_o = math.log(output_mean) - output_sigma ** 2 / 2
    out = []
    for _ in range(num_requests):
        n_prompt = min(max(round(rng.lognormvariate(mu_p, prompt_sigma)), 4), max_context // 2)
        n_output = min(max(round(rng.lognormvariate(mu_o, output_sigma)), 1),
                       max_context - n_prompt)
        out.append(TraceRequest([rng.randrange(vocab_size) for _ in range(n_prompt)], n_output))
    return out


def shared_prefix_trace(num_requests: int = 1000, vocab_size: int = 128256, seed: int = 0,
                        prefix_len: int = 2000, question_len: tuple[int, int] = (90, 110),
                        output_len: int = 128) -> list[TraceRequest]:
    """Every prompt is the same system prompt of prefix_len random ids followed by its own
    question of ~100 random ids; all arrive at t=0."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [TraceRequest(system + [rng.randrange(vocab_size)
                                   for _ in range(rng.randint(*question_len))], output_len)
            for _ in range(num_requests)]


def multi_turn_trace(num_requests: int = 1000, vocab_size: int = 128256, seed: int = 0,
                     turns: int = 5, message_len: tuple[int, int] = (80, 120),
                     output_len: int = 100) -> list[TraceRequest]:
    """ceil(num_requests / turns) conversations of `turns` user messages (~100 random ids
    each), in order; a turn's prompt is built by the client (history + this message)."""
    rng = random.Random(seed)
    out = []
    for c in range(-(-num_requests // turns)):
        for _ in range(turns):
            message = [rng.randrange(vocab_size) for _ in range(rng.randint(*message_len))]
            out.append(TraceRequest(message, output_len, conversation=c))
    return out


def save_jsonl(trace: list[TraceRequest], path: str) -> None:
    with open(path, "w") as f:
        for req in trace:
            row = {k: v for k, v in asdict(req).items() if v is not None}
            f.write(json.dumps(row) + "\n")


def load_jsonl(path: str) -> list[TraceRequest]:
    with open(path) as f:
        return [TraceRequest(**json.loads(line)) for line in f if line.strip()]


def make_trace(name: str, num_requests: int, vocab_size: int, seed: int, rate: float = 100.0,
               variance: float = 20.0, per_token_s: float = 0.02,
               max_context: int = 2048, prefix_len: int = 2000,
               turns: int = 5) -> list[TraceRequest]:
    """A named workload, or a saved JSONL trace when `name` is a path."""
    if name == "orca":
        return orca_trace(num_requests, vocab_size, seed)
    if name == "tcb":
        return tcb_trace(num_requests, rate, variance, vocab_size, seed, per_token_s=per_token_s)
    if name == "sharegpt":
        return sharegpt_trace(num_requests, vocab_size, seed, max_context=max_context)
    if name == "shared-prefix":
        return shared_prefix_trace(num_requests, vocab_size, seed, prefix_len)
    if name == "multi-turn":
        return multi_turn_trace(num_requests, vocab_size, seed, turns)
    if name.endswith(".jsonl"):
        return load_jsonl(name)
    raise ValueError(f"unknown trace {name!r}: use orca, tcb, sharegpt, shared-prefix, "
                     "multi-turn or a .jsonl file")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["orca", "tcb", "sharegpt", "shared-prefix",
                                        "multi-turn"])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=256,
                   help="prompt ids are drawn below this (256 fits every model here)")
    p.add_argument("--rate", type=float, default=100.0, help="tcb: Poisson arrival rate, req/s")
    p.add_argument("--variance", type=float, default=20.0, help="tcb: length variance (20/100)")
    p.add_argument("--per-token-ms", type=float, default=20.0, help="tcb: deadline unit")
    p.add_argument("--max-context", type=int, default=2048, help="sharegpt: prompt + output cap")
    p.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: its length")
    p.add_argument("--turns", type=int, default=5, help="multi-turn: turns per conversation")
    p.add_argument("--out", required=True, help="JSON Lines file to write")
    args = p.parse_args(argv)
    trace = make_trace(args.workload, args.num_requests, args.vocab_size, args.seed, args.rate,
                       args.variance, args.per_token_ms / 1e3, args.max_context,
                       args.prefix_len, args.turns)
    save_jsonl(trace, args.out)
    print(f"wrote {len(trace)} requests to {args.out}")


if __name__ == "__main__":
    main()
