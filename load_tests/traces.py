"""Request traces with fixed seeds, saved and loaded as JSON Lines.

Each request: {"prompt_token_ids": [...], "max_tokens": int, "arrival_s": float}; EOS is
ignored by every system that replays a trace, so each request generates exactly max_tokens.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TraceRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0


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


def save_jsonl(trace: list[TraceRequest], path: str) -> None:
    with open(path, "w") as f:
        for req in trace:
            f.write(json.dumps(asdict(req)) + "\n")


def load_jsonl(path: str) -> list[TraceRequest]:
    with open(path) as f:
        return [TraceRequest(**json.loads(line)) for line in f if line.strip()]
