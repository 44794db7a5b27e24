"""Compact model code per architecture family, written for the paged cache; `build` picks one.

Llama, Mistral, Qwen 2/3, Gemma 3 and Phi-3 are one decoder (decoder.py) that each family's module
maps its config and tensor names onto; GPT-2 has its own. `unsupported` names what a config needs
that this code does not do: engine.build then falls back to the static engine, with the reason.
"""
from __future__ import annotations

from typing import Optional

from worker.continuous.config import EngineConfig
from worker.continuous.models.gemma3 import Gemma3
from worker.continuous.models.gpt2 import GPT2
from worker.continuous.models.llama import Llama, Mistral
from worker.continuous.models.phi3 import Phi3
from worker.continuous.models.qwen import Qwen2, Qwen3

# "gemma3": Gemma 3's multimodal config, of which the text part runs (Gemma3.text_part)
FAMILIES = {"llama": Llama, "mistral": Mistral, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3_text": Gemma3,
            "gemma3": Gemma3, "phi3": Phi3, "gpt2": GPT2}


def unsupported(config) -> Optional[str]:
    """Why this engine's model code cannot run `config`, or None if it can."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"no compact model code for {config.model_type!r} (have: {', '.join(FAMILIES)})"
    return family.unsupported(config)


def build(config, tensors: dict, dtype, device, products: EngineConfig, kernel=None):
    """The family's model for `config` (transformers'), its products as `products` says."""
    return FAMILIES[config.model_type](config, tensors, dtype, device, products, kernel)
