"""Engine configuration: one frozen dataclass, validated once from the application args.

`serve_config.yaml` passes `applications[].args` to `deployments.app.build_app`, which
calls `EngineConfig.from_args`. Everything below the ingress receives this object; nothing
deeper reads environment variables.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from engine_actors import vllm_args
from engine_actors.vllm_args import ConfigError, SpeculativeConfig

DEFAULT_MODEL = "tiny-random-llama"


HTTP_ONLY = {"api_key", "request_timeout_s", "served_model_name", "tool_call_parser",
             "reasoning_parser", "default_chat_template_kwargs",
             "exclude_tools_when_tool_choice_none", "enable_auto_tool_choice"}


Name = Annotated[str, Field(min_length=1)]


@pydantic.dataclasses.dataclass(frozen=True, slots=True, config=pydantic.ConfigDict(
    extra="forbid", allow_inf_nan=False))
class EngineConfig:
    # Model: a local Hugging Face checkpoint directory, or DEFAULT_MODEL (built at start-up).
    model: str = DEFAULT_MODEL
    # the names clients may use in `model` (vLLM's: one, or several, the first reported)
    served_model_name: Name | Annotated[tuple[Name, ...], Field(min_length=1)] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    max_model_len: PositiveInt | None = None  # default: the checkpoint's max_position_embeddings
    # "fp8": quantize an unquantized checkpoint's projections to FP8 as they load (one
    # scale per output channel; vLLM's). FP8 checkpoints (quantization_config "fp8" or
    # compressed-tensors) are served as such either way. "gptq", "gptq_marlin", "awq",
    # "awq_marlin", "compressed-tensors", "moe_wna16" (vLLM's names): the checkpoint must be
    # of that method (moe_wna16: GPTQ or AWQ), served as it would be without them.
    # engine_actors/quantization.py.
    quantization: Literal["fp8", "gptq", "gptq_marlin", "awq", "awq_marlin",
                          "compressed-tensors", "moe_wna16"] | None = None
    # vLLM's hf_overrides: set on the checkpoint's transformers config before anything reads
    # it (a multimodal checkpoint's: on its text config), e.g. {"rope_scaling": {"rope_type":
    # "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    # "max_position_embeddings": 131072} for Qwen2.5's long context
    hf_overrides: dict | None = None
    # vLLM's generation_config: the sampling defaults of requests that give none, from
    # "auto" (the checkpoint's generation_config.json), "vllm" (none: the API's defaults) or
    # a folder holding a generation_config.json; override_generation_config's keys
    # (temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
    # frequency_penalty, max_new_tokens) take precedence over them
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    seed: int = 0

    # Scheduling (ORCA Algorithm 1).
    scheduling_policy: Literal["fcfs", "priority", "das", "sjf", "edf"] = "fcfs"
    max_batch_size: PositiveInt = 32  # requests per iteration
    max_num_batched_tokens: PositiveInt = 4096  # tokens per iteration; longer prompts are chunked
    # Admission control: requests waiting to start, beyond which new ones get HTTP 429.
    max_queued_requests: PositiveInt = 4096
    # A request still unfinished after this many seconds ends with HTTP 408 (or an SSE error
    # event once streaming began); requests may set a shorter `timeout_s`. None: no limit.
    request_timeout_s: PositiveFloat | None = None
    # vLLM's: the most log-probabilities per token a request may ask for (logprobs,
    # top_logprobs, prompt_logprobs); a request's -1 asks for this many. -1 here: the whole
    # vocabulary (then prompt_logprobs of a long prompt can take gigabytes on the device).
    max_logprobs: Annotated[int, Field(ge=-1)] = 20
    # The Responses API's stored responses (`store`, `previous_response_id`), kept in the
    # scheduler actor's memory up to this size (least recently used go first); 0: none.
    response_store_mib: NonNegativeInt = 256
    # On shutdown: requests still running after this many seconds end with finish_reason
    # "abort". Keep below the ingress deployment's graceful_shutdown_timeout_s.
    drain_timeout_s: NonNegativeFloat = 10.0
    # Overlap: schedule the next iteration while the current one runs (a running request
    # continues from the worker's own last sampled token). Off: one step in flight per stage.
    async_scheduling: bool = True
    # vLLM's speculative_config (method "ngram" only): decode steps verify n-gram drafts,
    # several tokens per step where the output repeats its prompt or itself. With pipeline
    # stages it needs async_scheduling off (the default then).
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False  # True: no CUDA graphs (decode and mixed steps run eagerly)
    # vLLM's: "generate" serves text; "pooling" serves embeddings (POST /v1/embeddings) of
    # the same decoder models: each prompt's last-token hidden state (engine_actors/pooling.py)
    runner: Literal["generate", "pooling"] = "generate"
    # vLLM's hf_overrides key for a causal LM served as a reranker (Qwen3-Reranker: ["no",
    # "yes"]): with runner pooling, a pair's score is sigmoid(logit(yes) - logit(no)) at its
    # last token (one token: sigmoid(logit)); POST /v1/score and /v1/rerank serve it (the
    # workers return the logit)
    classifier_from_token: list[str] | None = None

    # KV cache: a pool of `max_num_tokens` token slots, allocated in blocks of `block_size`.
    max_num_tokens: PositiveInt | None = None  # default: 16384 on CPU, sized from free GPU memory
    block_size: PositiveInt = 16
    # vLLM's: "auto" keeps keys/values in the model's dtype; "fp8" (= "fp8_e4m3") and
    # "fp8_e5m2" store them in 8 bits (twice the tokens in the same memory), divided by the
    # checkpoint's per-layer k_scale/v_scale if it has them, else by 1.0 (kernels/kv_write.py)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # Reuse the KV of full blocks of a prompt prefix computed before (the system prompt,
    # a conversation's earlier turns) instead of recomputing it.
    enable_prefix_caching: bool = True
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9

    # Placement: workers form pipeline_parallel_size stages of tensor_parallel_size ranks.
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    # vLLM's: this many engines, each its own scheduler and tensor_parallel_size x
    # pipeline_parallel_size workers (its own KV cache); each ingress replica sends a request
    # to the engine that ran its prompt's prefix, unless that one is busier than the least
    # busy by more than a few requests (deployments/engines.py). A batch is shared out over
    # them; the first engine also keeps the stored responses and conversations.
    data_parallel_size: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_cpus_per_worker: NonNegativeFloat = 1.0
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # Ray Serve LLM's: GPU workers only on nodes of this accelerator (Ray's
    # "accelerator_type:<type>" node resource, e.g. "H100", "A10G", "L4")
    accelerator_type: str | None = None
    # True: every tensor-parallel all-reduce goes through NCCL; False: small ones (decode
    # steps) through peer memory, one kernel (kernels/all_reduce.py), as vLLM's custom one
    disable_custom_all_reduce: bool = False
    distributed_timeout_s: PositiveFloat = 600.0  # collectives that wait longer fail the step
    # The workers' placement group must be placed within this time, or the start fails
    # naming the resources it asked for and those the cluster has.
    placement_timeout_s: PositiveFloat = 120.0

    # LoRA adapters (PEFT format) served beside the base model; a request picks one by its
    # `model` field. lora_modules: name -> local directory, loaded at start (implies
    # enable_lora); enable_lora: adapters may also be loaded at run time.
    enable_lora: bool = False
    lora_modules: dict[str, str] = Field(default_factory=dict)
    max_loras: PositiveInt = 4  # adapters resident on the device at once (a slot each)
    # Ray Serve LLM's dynamic_lora_loading_path (a local directory here; implies LoRA): a
    # request naming an adapter that is not loaded, `NAME` or `<model>:NAME`, loads
    # <path>/NAME first when that directory exists
    dynamic_lora_loading_path: str | None = None
    max_lora_rank: PositiveInt = 16
    # Fine-tuning jobs (POST /v1/fine_tuning/jobs) train LoRA adapters when serving leaves
    # the GPU idle (implies LoRA serving: a finished job's adapter is served at once). A
    # new request is deferred (not added to the running batch, which drains, so a training
    # step can run) only while its wait plus the step's measured time stays within
    # finetune_deferral_ms (FineInfer's deferred continuous batching); a micro-batch holds at most
    # finetune_max_tokens tokens; adapters are saved under finetune_dir (default: a temp dir).
    # A micro-batch measured longer than the bound runs in pieces of a few ms instead, so a
    # request waits a few ms, not a whole micro-batch (BENCHMARKS.md, 2026-11-27: 4,096
    # tokens keep the device, not the host, the bottleneck of pieces: 0.96-0.97 of the
    # trainer alone with no load, against 0.86 at 2,048).
    # finetune_busy_share > 0: while requests run, training also takes about this share of
    # the GPU's time, in pieces of a few ms between steps (running requests slow by up to
    # about twice that share at half load; engine_actors/finetune_busy.py). 0: only
    # FineInfer's rule.
    enable_finetuning: bool = False
    finetune_deferral_ms: PositiveFloat = 200.0
    finetune_busy_share: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    finetune_max_tokens: PositiveInt = 4096
    finetune_dir: str | None = None

    # Tool calls: the output format to parse ("auto": from the chat template's tags, else
    # the architecture: llama3_json for Llama, hermes for the rest; deployments/tool_parsers).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "qwen3_coder", "mistral",
                              "granite", "pythonic"] = "auto"
    # vLLM's --enable-auto-tool-choice: tool_choice "auto" (a request's tools without a
    # tool_choice too) parses calls; off, such a request is a 400 as in vLLM. On by default
    # here: the parser is always known (tool_call_parser "auto").
    enable_auto_tool_choice: bool = True
    # tool_choice "none" still renders the tools (the model is told of them, calls are not
    # parsed), as vLLM does, unless this is set (vLLM's --exclude-tools-when-tool-choice-none)
    exclude_tools_when_tool_choice_none: bool = False
    # The chat routes return <think>...</think> apart from the answer (deployments/reasoning.py).
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    # Template variables of every chat request (a request's chat_template_kwargs go over
    # them), e.g. {"enable_thinking": false} to turn Qwen3's thinking off by default.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # A Jinja chat template, or a file holding one, in place of the checkpoint's (vLLM's
    # --chat-template); requests may send their own only with trust_request_chat_template.
    chat_template: str | None = None
    trust_request_chat_template: bool = False

    # Security: when set, every route but /health and /metrics needs this bearer token.
    # build_app also reads it from ORCA_SERVE_API_KEY.
    api_key: str | None = None

    def __post_init__(self):
        if self.runner == "pooling" and self.lora_enabled:
            raise ValueError("runner pooling with LoRA adapters or fine-tuning is not "
                             "supported")
        if self.classifier_from_token is not None and (
                self.runner != "pooling" or len(self.classifier_from_token) not in (1, 2)):
            raise ValueError("classifier_from_token takes one or two tokens ([no, yes]), "
                             "with runner pooling")
        if self.speculative_config is not None and (self.runner != "generate" or (
                self.async_scheduling and self.pipeline_parallel_size > 1)):
            raise ValueError("speculative_config needs runner generate, and with pipeline "
                             "stages async_scheduling false (the first stage would need the "
                             "last one's accepted tokens)")
        if self.enable_finetuning and self.data_parallel_size > 1:
            raise ValueError("enable_finetuning needs data_parallel_size 1 (a job trains on "
                             "one engine; serving its adapter from the others is not built)")
        if self.enable_finetuning and self.pipeline_parallel_size > 1:
            raise ValueError("enable_finetuning needs pipeline_parallel_size 1 (training "
                             "through pipeline stages is not supported)")

    @classmethod
    def from_args(cls, args: dict | None) -> EngineConfig:
        args = vllm_args.translate(dict(args or {}))
        try:
            return _ADAPTER.validate_python(args, strict=False)
        except pydantic.ValidationError as e:
            unknown = sorted(str(err["loc"][0]) for err in e.errors()
                             if err["type"] == "unexpected_keyword_argument"
                             and len(err["loc"]) == 1)
            if unknown:
                known = sorted(f.name for f in dataclasses.fields(cls))
                raise ConfigError(f"unknown application args {unknown}; known args: {known}") \
                    from None
            msgs = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: " * bool(err["loc"])
                + err["msg"].removeprefix("Value error, ") for err in e.errors())
            raise ConfigError(f"invalid application args: {msgs}") from None

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_steps_in_flight(self) -> int:
        """ORCA keeps one batch per pipeline stage in flight (Algorithm 1's n_workers). With
        async_scheduling each batch's next step is queued behind it (continuing from the
        samples still on the device), so the control plane's round trip is hidden."""
        return self.pipeline_parallel_size * (2 if self.async_scheduling else 1)

    @property
    def max_drafts(self) -> int:
        """Draft tokens a request may carry in one step (speculative decoding)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def max_num_seqs(self) -> int:
        """Rows of the workers' tables: an admitted request holds one until it finishes."""
        return self.max_batch_size * self.max_steps_in_flight

    @property
    def uses_cuda_graphs(self) -> bool:  # (a pooling step's output is not the graphs' logits)
        return not self.enforce_eager and self.runner == "generate"

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.enable_finetuning or \
            self.dynamic_lora_loading_path is not None

    @property
    def model_name(self) -> str:
        """The name clients use in the `model` field (vLLM's served_model_name's first)."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name of the base model in `model` (served_model_name's, else model)."""
        names = self.served_model_name or self.model
        return (names,) if isinstance(names, str) else names

    def fingerprint(self) -> str:
        """A short stable hash of the engine's args: one scheduler actor per distinct engine
        configuration (the API key and HTTP-side limits do not change the engine)."""
        engine = {k: v for k, v in dataclasses.asdict(self).items() if k not in HTTP_ONLY}
        blob = json.dumps(engine, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


_ADAPTER = pydantic.TypeAdapter(EngineConfig)
