"""SmolLM3 (SmolLM3ForCausalLM): Llama whose layers marked 0 in the config's no_rope_layers
(every fourth, in the released 3B) have no rotary at all (NoPE). Its sliding window, if
any, is on the layers its layer_types mark (as transformers' masks follow them; the config
marks them only with use_sliding_window). LoRA adapters are served; fine-tuning is refused
(its training pass is Llama's: model_checks.py).
"""
from __future__ import annotations

from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        return LlamaDecoderLayer(cfg, self.rotary if cfg.no_rope_layers[i] else None,
                                 parallel, opts, layer_window(cfg, i, max_positions))
