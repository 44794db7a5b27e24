"""Qwen 2 / 2.5 (biases on q, k and v) and Qwen 3 (RMS norms of q and k per head, before the
rotation; a head_dim of its own, wider than hidden / heads in some sizes): Llama's layer names.
Sliding layers, where a config turns them on, come from its layer_types (Decoder.window)."""
from __future__ import annotations

from worker.continuous.models.decoder import Decoder
from worker.continuous.models.llama import llama_layer


class Qwen2(Decoder):
    def layer(self, tensors: dict, p: str) -> dict:
        return dict(llama_layer(tensors, p), qkv_bias=[tensors[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])


class Qwen3(Decoder):
    def layer(self, tensors: dict, p: str) -> dict:
        return dict(llama_layer(tensors, p), q_norm=tensors[p + "self_attn.q_norm.weight"],
                    k_norm=tensors[p + "self_attn.k_norm.weight"])
