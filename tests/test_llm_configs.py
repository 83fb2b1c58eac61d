"""Ray Serve LLM's `llm_configs` application args, read as ours (deployments/llm_configs.py),
and a server started from them."""
from __future__ import annotations

import httpx
import pytest
import yaml

from deployments.llm_configs import from_llm_configs
from engine_actors.config import ConfigError, EngineConfig
from engine_actors.executor import worker_bundle

pytestmark = pytest.mark.own_server  # its own server (conftest runs these modules last)

LLM = {"model_loading_config": {"model_id": "qwen", "model_source": "tiny-random-llama"},
       "engine_kwargs": {"tensor_parallel_size": 1, "max_model_len": 512,
                         "enable_prefix_caching": True},
       "accelerator_type": "H100", "deployment_config": {"num_replicas": 2},
       "lora_config": {"max_num_adapters_per_replica": 3}, "log_engine_metrics": True}


def test_an_llm_config_becomes_our_args_and_the_ingress_options(tmp_path):
    args, options = from_llm_configs({"llm_configs": [LLM], "api_key": "k"})
    assert args == {"api_key": "k", "model": "tiny-random-llama", "served_model_name": "qwen",
                    "tensor_parallel_size": 1, "max_model_len": 512,
                    "enable_prefix_caching": True, "accelerator_type": "H100",
                    "enable_lora": True, "max_loras": 3}
    assert options == {"num_replicas": 2}
    cfg = EngineConfig.from_args(args)
    assert (cfg.model_name, cfg.max_loras, cfg.accelerator_type) == ("qwen", 3, "H100")
    path = tmp_path / "llm.yaml"  # an entry may be a file of the fields
    path.write_text(yaml.safe_dump(LLM))
    assert from_llm_configs({"llm_configs": [str(path)]}) == from_llm_configs(
        {"llm_configs": [LLM]})


@pytest.mark.parametrize("llm_configs,message", [
    ([LLM, LLM], "one model per application"),
    ([{**LLM, "runtime_env": {}}], r"\['runtime_env'\] are not supported"),
    ([{"engine_kwargs": {}}], "model_source: the local checkpoint directory"),
    ([{"model_loading_config": {"model_id": "q", "model_source": "x",
                                "cloud_mirror_config": {"bucket_uri": "s3://b/m"}}}],
     r"\['cloud_mirror_config'\] are not supported"),
    ([{**LLM, "lora_config": {"dynamic_lora_loading_path": "s3://b/loras"}}],
     "dynamic_lora_loading_path: a local directory"),
    ([{**LLM, "log_engine_metrics": False}], "log_engine_metrics: false"),
    (["/no/such/llm.yaml"], "no file"),
])
def test_what_has_no_counterpart_is_refused_by_name(llm_configs, message):
    with pytest.raises(ConfigError, match=message):
        from_llm_configs({"llm_configs": llm_configs})


def test_a_local_dynamic_lora_loading_path_is_ours():
    args, _ = from_llm_configs({"llm_configs": [{**LLM, "lora_config": {
        "dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 2}}]})
    assert (args["dynamic_lora_loading_path"], args["max_loras"]) == ("/adapters", 2)
    assert EngineConfig.from_args(args).lora_enabled


def test_a_vllm_engine_kwarg_we_lack_is_named():
    args, _ = from_llm_configs({"llm_configs": [{**LLM, "engine_kwargs": {
        "max_model_len": 512, "swap_space": 4}}]})
    with pytest.raises(ConfigError, match=r"unknown application args \['swap_space'\]"):
        EngineConfig.from_args(args)


def test_the_accelerator_type_is_a_resource_of_each_gpu_worker():
    cfg = EngineConfig.from_args({"accelerator_type": "A10G", "num_cpus_per_worker": 2})
    assert worker_bundle(cfg, "cuda") == {"CPU": 2, "GPU": 1, "accelerator_type:A10G": 0.001}
    assert worker_bundle(EngineConfig.from_args({}), "cuda") == {"CPU": 1.0, "GPU": 1}
    with pytest.raises(ValueError, match="accelerator_type A10G needs GPU workers"):
        worker_bundle(cfg, "cpu")


@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    llm = {"model_loading_config": {"model_id": "my-llama", "model_source": "tiny-random-llama"},
           "engine_kwargs": {"max_model_len": 256}, "deployment_config": {"num_replicas": 2}}
    yield start_app(app_config(llm_configs=[llm]))
    stop_app()


def test_a_server_from_llm_configs_serves_its_model_id(url):
    from ray import serve
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["my-llama"] and models[0]["max_model_len"] == 256
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "my-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    deployments = serve.status().applications["orca"].deployments
    assert deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2


def test_vllm_max_num_seqs_is_our_max_batch_size():
    assert EngineConfig.from_args({"max_num_seqs": 48}).max_batch_size == 48
    with pytest.raises(ConfigError, match="max_num_seqs and max_batch_size are the same"):
        EngineConfig.from_args({"max_num_seqs": 48, "max_batch_size": 16})


def test_vllm_reranker_recipe_in_hf_overrides_is_our_classifier_from_token():
    """vLLM's Qwen3-Reranker recipe: hf_overrides with the classification architecture,
    classifier_from_token and is_original_qwen3_reranker."""
    cfg = EngineConfig.from_args({"runner": "pooling", "hf_overrides": {
        "architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True,
        "classifier_from_token": ["no", "yes"]}})
    assert cfg.classifier_from_token == ["no", "yes"] and cfg.hf_overrides is None
    kept = EngineConfig.from_args({"runner": "pooling", "hf_overrides": {
        "classifier_from_token": ["yes"], "max_position_embeddings": 8192}})
    assert kept.classifier_from_token == ["yes"]
    assert kept.hf_overrides == {"max_position_embeddings": 8192}
    with pytest.raises(ConfigError, match="classifier_from_token is given twice"):
        EngineConfig.from_args({"runner": "pooling", "classifier_from_token": ["yes"],
                                "hf_overrides": {"classifier_from_token": ["yes"]}})


def test_vllm_args_that_name_what_this_engine_always_does():
    cfg = EngineConfig.from_args({"enable_chunked_prefill": True, "trust_remote_code": True,
                                  "distributed_executor_backend": "ray"})
    assert cfg == EngineConfig.from_args({})
    with pytest.raises(ConfigError, match="enable_chunked_prefill: False is not supported "
                                          r"\(prompts are always chunked"):
        EngineConfig.from_args({"enable_chunked_prefill": False})
    with pytest.raises(ConfigError, match="distributed_executor_backend: 'mp'"):
        EngineConfig.from_args({"distributed_executor_backend": "mp"})
