"""Phi-3 / 3.5 / 4-mini: q, k and v already one matrix (qkv_proj), gate and up too (gate_up_proj,
gate first, as transformers splits it); rotary over the first partial_rotary_factor of each head
(the table's width says how much: rope_tables makes it). Longrope (Phi-3.5, Phi-4-mini):
the context is capped to original_max_position_embeddings, where the short factors apply to every
position (Decoder, noted in the log); past it transformers switches to the long factors, whose
angles would change the cache already written. A sliding_window covers every layer."""
from __future__ import annotations

from worker.continuous.models.decoder import Decoder


class Phi3(Decoder):
    def layer(self, tensors: dict, p: str) -> dict:
        return dict(norm1=tensors[p + "input_layernorm.weight"], qkv=[tensors[p + "self_attn.qkv_proj.weight"]],
                    o=[tensors[p + "self_attn.o_proj.weight"]], norm2=tensors[p + "post_attention_layernorm.weight"],
                    gate_up=[tensors[p + "mlp.gate_up_proj.weight"]], down=[tensors[p + "mlp.down_proj.weight"]])
