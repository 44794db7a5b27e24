"""The Llama family (SmolLM2, TinyLlama, Llama 2/3…) over a flat batch of tokens and a paged cache.

Tokens of every request in the step are one [tokens, hidden] tensor; the cache layout (who
attends to what) comes in the StepLayout. Query, key and value are one fused product, as are gate
and up. Rotary angles are a table built once with transformers' own rotary embedding, so every
rope variant it knows (default, linear, llama3, yarn…) is right here too.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from worker.continuous import attention
from worker.continuous.attention import KVCache, StepLayout
from worker.continuous.config import EngineConfig
from worker.continuous.linear import EVERY_STEP, Linear
from worker.continuous.weights import dense_float, fuse, quantize_q4_1


class Llama:
    @staticmethod
    def unsupported(config) -> Optional[str]:
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return "biases in attention or MLP"
        rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
            return f"rope type {rope.get('rope_type')!r} depends on the sequence length"
        return None

    def __init__(self, config, tensors: dict, dtype, device, products: EngineConfig, kernel=None):
        """`config`: the model's (transformers'); `products`: how the layers' products run (int4_rows,
        int4_head, small_kernel); `kernel`: the C++ kernels, or None."""
        int4_rows, int4_head, small = products.int4_rows, products.int4_head, products.small_kernel
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act]
        self.scale = 1 / math.sqrt(self.head_dim)

        def tensor(name):
            return tensors[name].to(device=device, dtype=dtype)

        def linear(names):
            return Linear(fuse([tensors[n] for n in names]), None, dtype, device, int4_rows, kernel, small=small)

        self.embed = tensors["model.embed_tokens.weight"]
        self.embed = self.embed.dequantize() if hasattr(self.embed, "dequantize") else self.embed
        self.embed = self.embed.to(device=device, dtype=dtype)
        self.blocks = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            self.blocks.append(dict(
                norm1=tensor(p + "input_layernorm.weight"),
                qkv=linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                o=linear([p + "self_attn.o_proj.weight"]),
                norm2=tensor(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=linear([p + "mlp.down_proj.weight"])))
        self.norm = tensor("model.norm.weight")
        # The file's own head, or the embedding (for SmolLM2 its Q8_0 blocks, kept for small steps;
        # its dense copy is the embedding table itself).
        tied = "lm_head.weight" not in tensors
        head = tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]
        head = quantize_q4_1(dense_float(head)) if int4_head else head
        self.head = Linear(head, None, dtype, device, EVERY_STEP if int4_head else int4_rows, kernel, small=small,
                           dense=self.embed if tied else None)

        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(config.max_position_embeddings)[None]
        cos, sin = rotary(torch.zeros((), dtype=dtype), positions)
        self.cos, self.sin = cos[0].to(device).contiguous(), sin[0].to(device).contiguous()  # [positions, head_dim]
        self.silu = config.hidden_act == "silu"
        self.decoder = None  # the whole decode step in C++ (kernels.cpp), made at its first use

    def linears(self) -> list:
        return [b[name] for b in self.blocks for name in ("qkv", "o", "gate_up", "down")] + [self.head]

    def rows_decoder(self, kernel) -> bool:
        """Whether every step runs in the C++ decoder (its norms, rotary and attention, row by row)."""
        return self._fused(kernel) is not None

    def _fused(self, kernel):
        """The C++ decoder holding this model's weights (shared, not copied), or None if it can't run it."""
        if self.decoder is None and kernel is not None and self.silu and hasattr(kernel, "LlamaDecoder"):
            self.decoder = kernel.LlamaDecoder(self.heads, self.kv_heads, self.head_dim, self.eps)
            for b in self.blocks:
                self.decoder.add_layer(b["norm1"], b["qkv"].for_kernel(), b["o"].for_kernel(), b["norm2"],
                                       b["gate_up"].for_kernel(), b["down"].for_kernel())
        return self.decoder

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                step: StepLayout) -> torch.Tensor:
        x = self.embed.index_select(0, ids)  # not F.embedding: it measured slower (docs/serving.md)
        if not step.chunks and step.kernel is not None and self._fused(step.kernel) is not None:
            return self.decoder.forward(x, positions, self.cos, self.sin, cache.k, cache.v, step.slots,
                                        step.decode_tables, step.decode_lengths, self.scale)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        tokens = ids.shape[0]
        k_end = (self.heads + self.kv_heads) * self.head_dim
        for layer, b in enumerate(self.blocks):
            qkv = b["qkv"](F.rms_norm(x, x.shape[-1:], b["norm1"], self.eps))
            # Queries and keys are rotated together: one set of operations instead of two.
            qk = rotate(qkv[:, :k_end].view(tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.heads], qk[:, self.heads:]
            v = qkv[:, k_end:].view(tokens, self.kv_heads, self.head_dim)
            attention.write(cache, layer, k, v, step.slots)
            out = attention.attend(q, cache, layer, step, self.scale)
            x = x + b["o"](out.view(tokens, -1))
            gate, up = b["gate_up"](F.rms_norm(x, x.shape[-1:], b["norm2"], self.eps)).chunk(2, dim=-1)
            x = x + b["down"](self.act(gate) * up)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as transformers' Llama applies it (halves, not interleaved pairs)."""
    return x * cos + rotate_half(x) * sin
