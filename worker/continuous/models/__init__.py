"""Compact model code per architecture family, written for the paged cache; `build` picks one."""
from __future__ import annotations

from typing import Optional

from worker.continuous.config import EngineConfig
from worker.continuous.models.gpt2 import GPT2
from worker.continuous.models.llama import Llama

FAMILIES = {"llama": Llama, "gpt2": GPT2}


def unsupported(config) -> Optional[str]:
    """Why this engine's model code cannot run `config`, or None if it can."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"no compact model code for {config.model_type!r} (have: {', '.join(FAMILIES)})"
    return family.unsupported(config)


def build(config, tensors: dict, dtype, device, products: EngineConfig, kernel=None):
    """The family's model for `config` (transformers'), its products as `products` says."""
    return FAMILIES[config.model_type](config, tensors, dtype, device, products, kernel)
