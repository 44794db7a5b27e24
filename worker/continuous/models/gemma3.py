"""Gemma 3's text model (1B, and the language part of 4B and larger): the embeddings scaled by
sqrt(hidden) in the model's dtype; RMS norms x * (1 + w) (kept as the multipliers 1 + w) before
and after both attention and feed-forward; RMS norms of q and k per head; GELU-tanh; queries
scaled by query_pre_attn_scalar ** -0.5; local layers (sliding_attention: the last sliding_window
positions) and global ones (full_attention), each kind with its own rope (rope_parameters[kind])."""
from __future__ import annotations

from typing import Optional

from worker.continuous.models.decoder import Decoder
from worker.continuous.models.llama import llama_layer

LANGUAGE_MODEL = "model.language_model."  # the multimodal model's text part, under Gemma3ForConditionalGeneration


def text_part(config, tensors: Optional[dict] = None):
    """The text model's config (a "gemma3" config may be the whole multimodal one) and its tensors
    under the text model's names."""
    config = getattr(config, "text_config", None) or config
    if tensors is not None and any(n.startswith(LANGUAGE_MODEL) for n in tensors):
        tensors = {("model." + n[len(LANGUAGE_MODEL):] if n.startswith(LANGUAGE_MODEL) else n): t
                   for n, t in tensors.items()}
    return config, tensors


class Gemma3(Decoder):
    norm_offset = 1.0

    @classmethod
    def unsupported(cls, config) -> Optional[str]:
        return super().unsupported(text_part(config)[0])

    def __init__(self, config, tensors: dict, *args, **kwargs):
        super().__init__(*text_part(config, tensors), *args, **kwargs)
        if getattr(config, "text_config", None) is not None:
            self.notes.append("Gemma 3 with a vision tower: its text model runs, images are not read")

    @staticmethod
    def activation(config) -> str:
        return config.hidden_activation  # Gemma's own key (its hidden_act is not what runs)

    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar ** -0.5

    def embedding_scale(self, config) -> float:
        return config.hidden_size ** 0.5

    def layer(self, tensors: dict, p: str) -> dict:
        return dict(llama_layer(tensors, p), q_norm=tensors[p + "self_attn.q_norm.weight"],
                    k_norm=tensors[p + "self_attn.k_norm.weight"],
                    post_attn_norm=tensors[p + "post_attention_layernorm.weight"],
                    norm2=tensors[p + "pre_feedforward_layernorm.weight"],
                    post_ffn_norm=tensors[p + "post_feedforward_layernorm.weight"])
