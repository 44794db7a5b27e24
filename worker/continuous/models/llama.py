"""The Llama family (SmolLM2, TinyLlama, Llama 2/3…): the shared decoder (decoder.py) with Llama's
tensor names, and Mistral, which is Llama with a sliding window over every layer."""
from __future__ import annotations

from worker.continuous.models.decoder import Decoder


def llama_layer(tensors: dict, p: str) -> dict:
    """Llama's names for one layer, shared by the families that kept them (Mistral, Qwen 2/3, Gemma 3)."""
    return dict(norm1=tensors[p + "input_layernorm.weight"],
                qkv=[tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"],
                o=[tensors[p + "self_attn.o_proj.weight"]],
                norm2=tensors[p + "post_attention_layernorm.weight"],
                gate_up=[tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]],
                down=[tensors[p + "mlp.down_proj.weight"]])


class Llama(Decoder):
    def layer(self, tensors: dict, p: str) -> dict:
        return llama_layer(tensors, p)


class Mistral(Llama):
    """Llama's layer; `sliding_window` applies to every layer (Decoder.window)."""
