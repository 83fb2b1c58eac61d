"""Rotary tables: the inverse frequencies and scaling of every supported rope type are
transformers' own (engine_actors/layers/rotary.py computes them without its modeling code)."""
import pytest
import torch

from engine_actors.checkpoint import tiny_llama_config
from engine_actors.layers.rotary import inverse_frequencies
from engine_actors.plain_config import config_data, plain_config

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("head_dim", [None, 32])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_inverse_frequencies_equal_transformers(rope, head_dim):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    overrides = {"rope_parameters": ROPES[rope]} if ROPES[rope] else {}
    if head_dim:
        overrides["head_dim"] = head_dim
    cfg = tiny_llama_config(**overrides)
    hf = LlamaRotaryEmbedding(cfg)
    for config in (cfg, plain_config(config_data(cfg))):  # (the second: as workers get it)
        inv_freq, scale = inverse_frequencies(config)
        assert torch.equal(inv_freq.float(), hf.inv_freq.float())
        assert scale == pytest.approx(hf.attention_scaling, rel=0, abs=0)
    if rope != "default":  # the scaled ones differ from the plain table
        plain, _ = inverse_frequencies(tiny_llama_config(**{"head_dim": head_dim} if head_dim
                                                          else {}))
        assert not torch.equal(inv_freq.float(), plain)


def test_rope_types_that_rescale_at_run_time_are_refused():
    cfg = tiny_llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                             "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        inverse_frequencies(cfg)
