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
    return as_ids(gen.get("eos_token_id")), sampling_defaults(gen, generation_config)


def sampling_defaults(gen: dict, source: str) -> dict:
    """The sampling defaults a generation config gives (max_new_tokens as max_tokens);
    ValueError naming `source` for one that SamplingParams refuses."""
    defaults = {k: gen[k] for k in SAMPLING_DEFAULTS if gen.get(k) is not None}
    try:
        SamplingParams(1, **{**defaults, "top_k": max(defaults.get("top_k", 0), 0)})
        if gen.get("max_new_tokens") is not None:
            defaults["max_tokens"] = SamplingParams(gen["max_new_tokens"]).max_tokens
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: unusable sampling defaults: {e}") from None
    return defaults


def generation_defaults(cfg, path: str) -> tuple[set[int], dict]:
    """(more eos ids, sampling defaults) of the engine args `cfg` for the checkpoint at
    `path`: its generation_config.json's eos ids always; the defaults as `generation_config`
    says ("auto", "vllm" or a folder), override_generation_config's over them."""
    eos, defaults = read_generation_config(path)
    if cfg.generation_config == "vllm":
        defaults = {}
    elif cfg.generation_config != "auto":
        if not os.path.isfile(os.path.join(cfg.generation_config, "generation_config.json")):
            raise ValueError(f"generation_config {cfg.generation_config!r}: not \"auto\", "
                             "\"vllm\" or a folder holding a generation_config.json")
        defaults = read_generation_config(cfg.generation_config)[1]
    override = cfg.override_generation_config or {}
    unknown = sorted(set(override) - {*SAMPLING_DEFAULTS, "max_new_tokens"})
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; known: "
                         f"{[*SAMPLING_DEFAULTS, 'max_new_tokens']}")
    return eos, {**defaults, **sampling_defaults(override, "override_generation_config")}
