"""SmolLM3 (SmolLM3ForCausalLM): Llama whose layers marked 0 in the config's no_rope_layers
(every fourth, in the released 3B) have no rotary at all (NoPE), and whose sliding window,
if any, applies only with use_sliding_window (to the layers its layer_types mark). LoRA
adapters are served; fine-tuning is refused (its training pass is Llama's: model_checks.py).
"""
from __future__ import annotations

from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        window = layer_window(cfg, i, max_positions) if cfg.use_sliding_window else 0
        return LlamaDecoderLayer(cfg, self.rotary if cfg.no_rope_layers[i] else None,
                                 parallel, opts, window)
