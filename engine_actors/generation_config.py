"""A checkpoint's generation_config.json: more end-of-sequence ids, and the sampling defaults
of a request that gives none (temperature, top_p, ...; max_new_tokens as vLLM's default
max_tokens)."""
from __future__ import annotations

import json
import os

from engine_actors.request import SamplingParams

SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")


def as_ids(value) -> set[int]:
    """A config's token id, or list of them, as a set."""
    return set() if value is None else {value} if isinstance(value, int) else set(value)


def read_generation_config(path: str) -> tuple[set[int], dict]:
    """(its eos ids, its sampling defaults); none without the file, and ValueError for a
    default that SamplingParams refuses (each request would fail on it)."""
    generation_config = os.path.join(path, "generation_config.json")
    if not os.path.isfile(generation_config):
        return set(), {}
    with open(generation_config) as f:
        gen = json.load(f)
    defaults = {k: gen[k] for k in SAMPLING_DEFAULTS if gen.get(k) is not None}
    try:
        SamplingParams(1, **{**defaults, "top_k": max(defaults.get("top_k", 0), 0)})
        if gen.get("max_new_tokens") is not None:
            defaults["max_tokens"] = SamplingParams(gen["max_new_tokens"]).max_tokens
    except (TypeError, ValueError) as e:
        raise ValueError(f"{generation_config}: unusable sampling defaults: {e}") from None
    return as_ids(gen.get("eos_token_id")), defaults
