"""runner "pooling": a decoder model serves embeddings, as vLLM's pooling runner does for
a causal LM (Qwen3-Embedding, gte-Qwen2, e5-mistral). A request runs its prompt only; the
step of its last prompt chunk returns the final (normed) hidden state of the last prompt
token instead of a sampled token, L2-normalized by default, and the request ends there.

A sentence-transformers checkpoint says how it pools in modules.json: its Pooling module's
config must pool the last token (other modes, mean or CLS, are refused at start), and a
Normalize module after it means normalized embeddings. Without modules.json: the last
token, normalized (vLLM's default for a causal LM).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_actors.messages import StepResult


@dataclass(frozen=True, slots=True)
class Pooling:
    normalize: bool = True


def read_pooling(path: str) -> Pooling:
    """The checkpoint's pooling (ValueError for one this engine does not do)."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return Pooling()
    with open(modules_file) as f:
        modules = json.load(f)
    types = [m.get("type", "") for m in modules]
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            with open(os.path.join(path, m.get("path", ""), "config.json")) as f:
                config = json.load(f)
            modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
            if modes != ["pooling_mode_lasttoken"]:
                raise ValueError(f"the checkpoint pools with {modes or 'no mode'} "
                                 f"({m.get('path')}/config.json); runner pooling takes the "
                                 "last token's hidden state (pooling_mode_lasttoken) only")
    return Pooling(normalize=any(t.endswith("Normalize") for t in types))


def embed(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Final hidden states [N, H] -> embeddings [N, H], fp32."""
    out = hidden.float()
    return F.normalize(out, dim=-1) if pooling.normalize else out


def embeddings_result(host: torch.Tensor) -> StepResult:
    """A pooling step's result: each sampling row's embedding as float32 bytes, which travel
    as they are to the route (its token: 0, unused)."""
    rows = host.numpy()
    return StepResult([0] * len(rows), embeddings=[row.tobytes() for row in rows])
