"""A model's transformers config as plain data, as the scheduler sends it to the workers.

Importing transformers' config classes costs a process 4-5 s of CPU (its lazy import tables,
its kernel hub and torch.distributed.tensor), the better part of a CPU worker's start. The
scheduler reads the config anyway (model_info), so each worker gets its attributes as a dict
and reads them as attributes of a SimpleNamespace: the models only read attributes.
"""
from __future__ import annotations

from types import SimpleNamespace


def config_data(hf_config) -> dict:
    """Every attribute of the config, and its aliases (Qwen3-MoE's num_experts)."""
    data = hf_config.to_dict()
    for alias, name in type(hf_config).attribute_map.items():
        data.setdefault(alias, data.get(name))
    return data


def plain_config(data: dict) -> SimpleNamespace:
    return SimpleNamespace(**data)


def transformers_config(config):
    """A plain config as its transformers class again, for transformers' functions that call
    its methods (the scaled rope variants): only such models pay for the import."""
    if not isinstance(config, SimpleNamespace):
        return config
    from transformers import AutoConfig
    data = dict(vars(config))
    cls = type(AutoConfig.for_model(data["model_type"]))
    return cls.from_dict({k: v for k, v in data.items() if k not in cls.attribute_map})
