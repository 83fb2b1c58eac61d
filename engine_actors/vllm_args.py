"""vLLM's engine args (and Ray Serve LLM's engine_kwargs, which carry them) in this engine's
terms: the speculative_config object, args ours name otherwise, args that name what this
engine always does, and vLLM's reranker recipe in hf_overrides. EngineConfig.from_args
translates them before validating.
"""
from __future__ import annotations

import json

import pydantic
from pydantic import PositiveInt


class ConfigError(ValueError):
    """The application args are invalid; the message says which arg and why."""


@pydantic.dataclasses.dataclass(frozen=True, slots=True, config=pydantic.ConfigDict(
    extra="forbid"))
class SpeculativeConfig:
    """vLLM's speculative_config, method "ngram" (prompt lookup): each decode step drafts
    up to num_speculative_tokens tokens that followed the latest earlier occurrence of the
    request's last n tokens, prompt_lookup_max >= n >= prompt_lookup_min (both 5 when
    neither is given, as vLLM), and verifies them in the same step
    (engine_actors/speculative.py). No drafts in a step of disable_by_batch_size requests
    or more: a full batch is no longer bound by reading the weights."""
    num_speculative_tokens: PositiveInt
    method: str = "ngram"
    model: str | None = None  # vLLM's older spelling of the method: "ngram" or "[ngram]"
    prompt_lookup_max: PositiveInt | None = None
    prompt_lookup_min: PositiveInt | None = None
    disable_by_batch_size: PositiveInt | None = None

    def __post_init__(self):
        method = self.model.strip("[]") if self.model is not None else self.method
        if method != "ngram" or self.method != "ngram":
            raise ValueError(f"method {method!r} is not supported; only "
                             "\"ngram\" (drafts from the request's own tokens) is: draft models, "
                             "EAGLE, Medusa and MTP heads are not")
        if self.min_n > self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) exceeds "
                             f"prompt_lookup_max ({self.max_n})")

    @property
    def min_n(self) -> int:
        return self.prompt_lookup_min or self.prompt_lookup_max or 5

    @property
    def max_n(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min or 5


def translate(args: dict) -> dict:
    """args with vLLM's spellings replaced by ours; ConfigError for a value we cannot serve."""
    args = _reranker_overrides(args)
    if args.get("speculative_config") is not None:  # vLLM's JSON string too
        if isinstance(args["speculative_config"], str):
            try:
                args["speculative_config"] = json.loads(args["speculative_config"])
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not JSON ({e})") from None
        if args.get("pipeline_parallel_size", 1) > 1:
            args.setdefault("async_scheduling", False)
    for name, (values, why) in VLLM_AS_IS.items():
        if name in args:
            if args[name] not in values:
                raise ConfigError(f"{name}: {args[name]!r} is not supported ({why})")
            del args[name]
    for vllm_name, ours in VLLM_NAMES.items():  # vLLM's name of one of our args
        if vllm_name in args:
            if ours in args:
                raise ConfigError(f"{vllm_name} and {ours} are the same arg: give one")
            args[ours] = args.pop(vllm_name)
    return args


def _reranker_overrides(args: dict) -> dict:
    """vLLM's recipe for a causal LM served as a reranker (Qwen3-Reranker) puts
    classifier_from_token in hf_overrides, with the sequence-classification architecture
    and is_original_qwen3_reranker: here it is our classifier_from_token arg, which implies
    the other two."""
    overrides = dict(args.get("hf_overrides") or {})
    if "classifier_from_token" not in overrides:
        return args
    if "classifier_from_token" in args:
        raise ConfigError("classifier_from_token is given twice (as an arg and in "
                          "hf_overrides): give one")
    args["classifier_from_token"] = overrides.pop("classifier_from_token")
    overrides.pop("is_original_qwen3_reranker", None)
    if all(a.endswith("ForSequenceClassification") for a in overrides.get("architectures", [])):
        overrides.pop("architectures", None)
    args["hf_overrides"] = overrides or None
    return args


# vLLM's engine args whose meaning ours have under another name (Ray Serve LLM's
# engine_kwargs carry them): max_num_seqs is the most requests one iteration runs
VLLM_NAMES = {"max_num_seqs": "max_batch_size"}
# vLLM's engine args that name what this engine always does: the values that say so are
# accepted (and change nothing), others refused with the reason
VLLM_AS_IS = {
    "enable_chunked_prefill": ((True,), "prompts are always chunked to max_num_batched_tokens"),
    "distributed_executor_backend": (("ray",), "the workers are always Ray actors"),
    "trust_remote_code": ((True, False), ""),  # no checkpoint's code is ever run here
}
