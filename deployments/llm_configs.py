"""Ray Serve LLM's application args (`llm_configs`, as `ray.serve.llm.build_openai_app`
takes them) read as ours, so that a Ray Serve LLM config runs here with only its
`import_path` changed:

    args:
      llm_configs:
        - model_loading_config: {model_id: qwen, model_source: /models/Qwen2.5-7B-Instruct}
          engine_kwargs: {tensor_parallel_size: 2, max_model_len: 8192}
          accelerator_type: H100
          deployment_config: {num_replicas: 2}

An entry is an LLMConfig's fields or the path of a YAML file holding them. One model per
application: each model gets an application of its own. `engine_kwargs` are our engine args
(vLLM's names, EngineConfig); `deployment_config` goes to the ingress deployment's options;
`lora_config` turns LoRA on with `max_num_adapters_per_replica` resident adapters, loaded
on demand from `dynamic_lora_loading_path` when it is a local directory. What has
no counterpart here is refused by name (ConfigError), never ignored.
"""
from __future__ import annotations

import os

import yaml

from engine_actors.config import ConfigError

KNOWN = {"model_loading_config", "engine_kwargs", "accelerator_type", "deployment_config",
         "lora_config", "log_engine_metrics"}
LORA_KEYS = {"max_num_adapters_per_replica", "dynamic_lora_loading_path",
             "download_timeout_s", "max_download_tries"}


def from_llm_configs(args: dict) -> tuple[dict, dict]:
    """(our application args, the ingress deployment's options) of args holding
    `llm_configs`; other args beside it (api_key, say) are kept."""
    rest = {k: v for k, v in args.items() if k != "llm_configs"}
    configs = args["llm_configs"]
    if not isinstance(configs, list) or len(configs) != 1:
        raise ConfigError("llm_configs: one model per application here (got "
                          f"{len(configs) if isinstance(configs, list) else configs!r}): give "
                          "each model an application of its own")
    llm = _load(configs[0])
    unknown = sorted(set(llm) - KNOWN)
    if unknown:
        raise ConfigError(f"llm_configs[0]: {unknown} are not supported here; supported: "
                          f"{sorted(KNOWN)}")
    loading = llm.get("model_loading_config")
    if not isinstance(loading, dict) or not isinstance(loading.get("model_source"), str):
        raise ConfigError("llm_configs[0].model_loading_config.model_source: the local "
                          "checkpoint directory to serve (a string) is required")
    extra = sorted(set(loading) - {"model_id", "model_source"})
    if extra:
        raise ConfigError(f"llm_configs[0].model_loading_config: {extra} are not supported "
                          "(checkpoints load from a local directory)")
    ours = {**rest, **(llm.get("engine_kwargs") or {}), "model": loading["model_source"]}
    if loading.get("model_id"):
        ours["served_model_name"] = loading["model_id"]
    if llm.get("accelerator_type"):
        ours["accelerator_type"] = llm["accelerator_type"]
    ours.update(_lora_args(llm.get("lora_config")))
    if llm.get("log_engine_metrics") is False:
        raise ConfigError("llm_configs[0].log_engine_metrics: false is not supported (the "
                          "engine's metrics are always on /metrics)")
    return ours, dict(llm.get("deployment_config") or {})


def _load(entry) -> dict:
    if isinstance(entry, str):  # a YAML (or JSON) file of the LLMConfig's fields
        if not os.path.isfile(entry):
            raise ConfigError(f"llm_configs[0]: no file {entry!r}")
        with open(entry) as f:
            entry = yaml.safe_load(f)
    if not isinstance(entry, dict):
        raise ConfigError("llm_configs[0]: an LLMConfig's fields, or a YAML file of them")
    return entry


def _lora_args(lora) -> dict:
    if not lora:
        return {}
    unknown = sorted(set(lora) - LORA_KEYS)
    if unknown:
        raise ConfigError(f"llm_configs[0].lora_config: unknown keys {unknown}")
    args = {"enable_lora": True}
    path = lora.get("dynamic_lora_loading_path")
    if path:
        if "://" in path:
            raise ConfigError("llm_configs[0].lora_config.dynamic_lora_loading_path: a local "
                              f"directory (adapters are not downloaded here), got {path!r}")
        args["dynamic_lora_loading_path"] = path
    if lora.get("max_num_adapters_per_replica"):
        args["max_loras"] = lora["max_num_adapters_per_replica"]
    return args
