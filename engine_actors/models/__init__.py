"""The supported architectures: `architectures[0]` of a checkpoint's config.json -> model."""
from __future__ import annotations

from engine_actors.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine_actors.models.granite import GraniteForCausalLM
from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.models.moe import (MixtralForCausalLM, Qwen2MoeForCausalLM,
                                      Qwen3MoeForCausalLM)
from engine_actors.models.olmo import Exaone4ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM
from engine_actors.models.phi3 import Phi3ForCausalLM
from engine_actors.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, SeedOssForCausalLM
from engine_actors.models.smollm3 import SmolLM3ForCausalLM

MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
          "Qwen2ForCausalLM": Qwen2ForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
          "Phi3ForCausalLM": Phi3ForCausalLM, "Gemma2ForCausalLM": Gemma2ForCausalLM,
          "Gemma3ForCausalLM": Gemma3ForCausalLM, "MixtralForCausalLM": MixtralForCausalLM,
          "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
          "GraniteForCausalLM": GraniteForCausalLM, "Olmo2ForCausalLM": Olmo2ForCausalLM,
          "Olmo3ForCausalLM": Olmo3ForCausalLM, "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
          "SeedOssForCausalLM": SeedOssForCausalLM, "Exaone4ForCausalLM": Exaone4ForCausalLM}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    return MODELS[architecture]
