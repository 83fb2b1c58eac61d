"""Application args: validated once, by pydantic, with messages that name the arg."""
from __future__ import annotations

import dataclasses

import pytest

from engine_actors.config import ConfigError, EngineConfig
from engine_actors.request import SamplingParams


@pytest.mark.parametrize("args,words", [
    ({"max_batch_size": 0}, ["max_batch_size", "greater than 0"]),
    ({"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization"]),
    ({"drain_timeout_s": -1}, ["drain_timeout_s"]),
    ({"request_timeout_s": float("nan")}, ["request_timeout_s"]),
    ({"scheduling_policy": "lifo"}, ["scheduling_policy"]),
    ({"max_batch_sise": 8}, ["unknown application args ['max_batch_sise']", "max_batch_size"]),
    ({"enable_finetuning": True, "pipeline_parallel_size": 2},
     ["enable_finetuning needs pipeline_parallel_size 1"]),
])
def test_bad_args_are_refused_naming_the_arg(args, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_args(args)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_yaml_strings_are_coerced_and_the_config_is_frozen():
    cfg = EngineConfig.from_args({"max_batch_size": "8", "async_scheduling": "false"})
    assert cfg.max_batch_size == 8 and cfg.async_scheduling is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_batch_size = 9


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=1, top_p=0.0),
                                    dict(max_tokens=1, temperature=float("inf")),
                                    dict(max_tokens=1, top_k=2**31),
                                    dict(max_tokens=1, seed=2**63),
                                    dict(max_tokens=1, typo=1)])
def test_sampling_params_cannot_be_built_wrong(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
