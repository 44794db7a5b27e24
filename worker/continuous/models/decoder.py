"""The decoder-only transformer that Llama, Mistral, Qwen 2/3, Gemma 3 and Phi-3 are variants of,
over a flat batch of tokens and a paged cache. A family's module says only how its config and its
tensors (by Hugging Face name) map onto this: `layer` (the tensors of one layer) and a few hooks.

Tokens of every request in the step are one [tokens, hidden] tensor; the cache layout (who attends
to what) comes in the StepLayout. Query, key and value are one fused product, as are gate and up.
A layer is: norm, qkv (+ bias), per-head q/k norms, rotary over the first `rotary_dim` dims of each
head, attention (over the last `window` positions only, for a sliding layer), o, an optional norm
of its output, the residual; then norm, gate_up, activation, down, an optional norm, the residual.
Norms are kept as the multipliers they apply (Gemma's x * (1 + w) as 1 + w), so one RMS norm does
for every family, here and in the C++ decoder.

Rotary angles are tables built once with the family's own transformers class, so every rope
variant it knows (default, linear, llama3, yarn, longrope's short factors…) is right here too;
a family whose layers differ (Gemma 3's local and global ones) has a table per kind of layer.

With the C++ kernels, the whole step runs row by row in the C++ decoder (kernels.cpp), every token
a row whatever its step holds: the same bits for a request alone or in a crowd (docs/serving.md).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.continuous import attention
from worker.continuous.attention import KVCache, StepLayout
from worker.continuous.config import EngineConfig
from worker.continuous.huge_pages import HugePages, enabled_on_this_system
from worker.continuous.linear import EVERY_STEP, KQUANT_PATHS, Linear
from worker.continuous.kquants import KQuant
from worker.continuous.weights import dense_float, fuse, quantize_q4_1

# transformers' activation names, as the C++ decoder calls the same function (both GELUs are the tanh form)
KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(config, layer_type: Optional[str] = None) -> dict:
    """The rope's parameters (one layer kind's, for a config that has them per kind)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


def rope_tables(config, layer_type: Optional[str], positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, rotary_dim] of one kind of layer, as the families' rotary embeddings in
    transformers make them (Llama's, Qwen's, Mistral's, Phi-3's with its partial rotary, Gemma 3's
    per layer kind): the same angles bit for bit (tests/test_families.py compares them), from
    transformers' own initialisers for every scaled rope. Written here rather than taken from the
    modelling modules because importing those costs a worker ~100 MiB (torch.distributed and the
    rest they pull in) that nothing else in it needs."""
    params = rope_parameters(config, layer_type)
    kind = rope_type(params)
    if kind == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    else:
        per_kind = layer_type is not None and isinstance(getattr(config, "rope_parameters", {}).get(layer_type), dict)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, None, layer_type=layer_type if per_kind else None)
    freqs = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def activation_function(name: str):
    """transformers' activation `name` (torch's ops), imported when first asked for: the module pulls in
    torch.distributed (~80 MiB), which a worker running the C++ decoder never calls."""
    from transformers.activations import ACT2FN
    return ACT2FN[name]


def known_activation(name: str) -> bool:
    if name in KERNEL_ACTIVATIONS:
        return True
    from transformers.activations import ACT2FN
    return name in ACT2FN


class Decoder:
    norm_offset = 0.0  # added to every norm's weight: Gemma's norms multiply by 1 + w

    @classmethod
    def unsupported(cls, config) -> Optional[str]:
        """What of `config` this code does not implement, or None. Families add their own."""
        for layer_type in sorted(set(getattr(config, "layer_types", None) or [None])):
            if layer_type is not None and layer_type not in LAYER_TYPES:
                return f"layers of type {layer_type!r}"
            kind = rope_type(rope_parameters(config, layer_type))
            if kind == "dynamic":  # its angles change with the sequence's length: a table cannot hold them
                return "dynamic rope scaling (angles depend on the sequence length)"
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                return f"{name} (logit soft-capping)"
        # Biases are read on q/k/v only, where a family's `layer` names them (Qwen 2), and only
        # there does the C++ decoder take one; attention_bias puts one on o too, mlp_bias on the MLP.
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return "biases on the attention's or the MLP's products"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention"
        if not known_activation(cls.activation(config)):
            return f"activation {cls.activation(config)!r}"
        return None

    # --- what a family says (its tensors' names; the hooks' defaults are Llama's) ---

    def layer(self, tensors: dict, p: str) -> dict:
        """The tensors of the layer named by prefix `p` ("model.layers.3."): norm1, qkv (a list of
        matrices stacked into one product), o, norm2, gate_up (a list), down; and where the family
        has them qkv_bias (a list), q_norm, k_norm, post_attn_norm, post_ffn_norm."""
        raise NotImplementedError

    @staticmethod
    def activation(config) -> str:
        return config.hidden_act

    def attention_scale(self, config) -> float:
        return 1 / math.sqrt(self.head_dim)

    def embedding_scale(self, config) -> Optional[float]:
        return None  # Gemma: sqrt(hidden)

    def layer_types(self, config) -> list[Optional[str]]:
        """Each layer's kind: its window and its rope table follow it."""
        return list(getattr(config, "layer_types", None) or [None] * self.layers)

    def window(self, config, layer_type: Optional[str]) -> int:
        """Positions a layer of `layer_type` attends to (its own included), 0 for all. transformers
        applies `sliding_window` to every layer of a family without layer types (Mistral, Phi-3)."""
        if layer_type not in (None, "sliding_attention"):
            return 0
        return getattr(config, "sliding_window", None) or 0

    # --- the shared part ---

    def __init__(self, config, tensors: dict, dtype, device, products: EngineConfig, kernel=None):
        """`config`: the model's (transformers'); `products`: how the layers' products run (int4_rows,
        int4_head, small_kernel); `kernel`: the C++ kernels, or None."""
        int4_rows, int4_head, small = products.int4_rows, products.int4_head, products.small_kernel
        self.dtype = dtype
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.act_name = self.activation(config)
        self.scale = self.attention_scale(config)
        self.notes: list[str] = []  # what the engine logs at start about how this model runs

        def norm(t):
            return None if t is None else (t.float() + self.norm_offset).to(device=device, dtype=dtype)

        def linear(parts, bias=None):  # one part as it is: fuse() would make a Q8_0 matrix dense
            bias = None if bias is None else torch.cat([b.float() for b in bias])
            weight = parts[0] if len(parts) == 1 else fuse(parts)
            return Linear(weight, bias, dtype, device, int4_rows, kernel, small=small)

        embed = tensors["model.embed_tokens.weight"]  # quantized in a GGUF file (SmolLM2's: Q8_0)
        # A K-quant table (a Q4_K_M file's Q6_K: 82 MB for SmolLM2-1.7B's, 192 MB as bf16) stays in
        # the file's blocks, a step's rows dequantized as it needs them (the same values as the
        # whole table's), or, where it is also the head and the head runs on the K-quant kernel, in
        # the head's panels (HeadRows, below); the others are a dense table, looked up by index.
        in_blocks = isinstance(embed, KQuant) and device.type == "cpu"
        self.embed = None if in_blocks else \
            (embed.dequantize() if hasattr(embed, "dequantize") else embed).to(device=device, dtype=dtype)
        scale = self.embedding_scale(config)  # rounded to the model's dtype first, as transformers does
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=dtype, device=device)
        self.blocks = []
        for i in range(self.layers):
            w = self.layer(tensors, f"model.layers.{i}.")
            self.blocks.append(dict(
                norm1=norm(w["norm1"]), qkv=linear(w["qkv"], w.get("qkv_bias")),
                q_norm=norm(w.get("q_norm")), k_norm=norm(w.get("k_norm")), o=linear(w["o"]),
                post_attn_norm=norm(w.get("post_attn_norm")), norm2=norm(w["norm2"]),
                gate_up=linear(w["gate_up"]), down=linear(w["down"]), post_ffn_norm=norm(w.get("post_ffn_norm"))))
        self.norm = norm(tensors["model.norm.weight"])
        # The file's own head, or the embedding (for SmolLM2 its Q8_0 blocks, kept for small steps;
        # its dense copy is the embedding table itself).
        tied = "lm_head.weight" not in tensors or getattr(config, "tie_word_embeddings", False)
        head = tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]
        head = quantize_q4_1(dense_float(head)) if int4_head else head
        self.head = Linear(head, None, dtype, device, EVERY_STEP if int4_head else int4_rows, kernel, small=small,
                           dense=self.embed if tied else None)
        if products.huge_pages:  # before HeadRows and the C++ decoder hold the tensors
            self._place_weights()
        self.embed_rows = None if not in_blocks else \
            HeadRows(self.head) if tied and self.head.small in KQUANT_PATHS else embed.owned()

        # Positions the tables cover: the context, or for longrope the original one, where its short
        # factors apply (past it transformers switches every position to the long ones).
        self.context = config.max_position_embeddings
        types = self.layer_types(config)
        for layer_type in sorted(set(types), key=str):
            params = rope_parameters(config, layer_type)
            if rope_type(params) == "longrope":
                original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
                if original < self.context:
                    self.notes.append(f"longrope: the context is capped to original_max_position_embeddings "
                                      f"({original} of {self.context} tokens), where its short factors always apply")
                    self.context = original
        positions = torch.arange(self.context)
        tables = {t: rope_tables(config, t, positions, dtype) for t in sorted(set(types), key=str)}
        tables = {t: (cos.to(device).contiguous(), sin.to(device).contiguous()) for t, (cos, sin) in tables.items()}
        self.tables = [tables[t] for t in types]  # each layer's (cos, sin), shared by the layers of a kind
        self.rotary_dim = self.tables[0][0].shape[-1]
        self.windows = [self.window(config, t) for t in types]
        self._note_windows()
        self.decoder = None  # the whole step in C++ (kernels.cpp), made at its first use

    def _place_weights(self):
        """The layers' and head's weights, as the kernels read them every step, into huge pages."""
        pages = HugePages()
        for layer in self.linears():
            layer.place_weights(pages)
        if pages.placed:
            self.notes.append(f"{pages.placed / 2 ** 20:.0f} MiB of weights in memory asked to be 2 MiB pages "
                              f"(transparent huge pages: {enabled_on_this_system() or 'unknown'})")

    def _note_windows(self):
        sliding = sorted(set(w for w in self.windows if w))
        if not sliding:
            return
        count, what = sum(1 for w in self.windows if w), "/".join(map(str, sliding))
        if count < self.layers:
            self.notes.append(f"{count} of {self.layers} layers are sliding-window layers: they attend to their "
                              f"last {what} tokens; their blocks are kept for the global layers, which see the "
                              f"whole context")
        else:
            self.notes.append(f"every layer attends to its last {what} tokens (sliding window); blocks outside "
                              f"the window are kept, not freed (one block table serves all layers), so the cache "
                              f"holds the whole context as for a model without a window")

    def linears(self) -> list:
        return [b[name] for b in self.blocks for name in ("qkv", "o", "gate_up", "down")] + [self.head]

    @functools.cached_property
    def act(self):
        """The activation as torch's layers run it (where the C++ decoder does not): looked up once,
        at first use, since transformers.activations costs ~80 MiB to import."""
        return activation_function(self.act_name)

    def rows_decoder(self, kernel) -> bool:
        """Whether every step runs in the C++ decoder (its norms, rotary and attention, row by row)."""
        return self._fused(kernel) is not None

    def _fused(self, kernel):
        """The C++ decoder holding this model's weights (shared, not copied), or None if it can't run it."""
        if self.decoder is None and kernel is not None and self.act_name in KERNEL_ACTIVATIONS:
            self.decoder = kernel.Decoder(self.heads, self.kv_heads, self.head_dim, self.eps,
                                          KERNEL_ACTIVATIONS[self.act_name])
            for b, (cos, sin), window in zip(self.blocks, self.tables, self.windows):
                self.decoder.add_layer(b["norm1"], b["qkv"].for_kernel(), b["qkv"].bias, b["q_norm"], b["k_norm"],
                                       b["o"].for_kernel(), b["post_attn_norm"], b["norm2"],
                                       b["gate_up"].for_kernel(), b["down"].for_kernel(), b["post_ffn_norm"],
                                       cos, sin, window)
        return self.decoder

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], weight, self.eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                step: StepLayout) -> torch.Tensor:
        if self.embed_rows is not None:
            x = self.embed_rows.dequantize_rows(ids).to(device=ids.device, dtype=self.dtype)
        else:
            x = self.embed.index_select(0, ids)  # not F.embedding: it measured slower (docs/serving.md)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if not step.chunks and step.kernel is not None and self._fused(step.kernel) is not None:
            return self.decoder.forward(x, positions, cache.k, cache.v, step.slots, step.decode_tables,
                                        step.decode_lengths, self.scale)
        tokens, heads, dim = ids.shape[0], self.heads, self.head_dim
        k_end = (heads + self.kv_heads) * dim
        angles = {}  # each table's rows at this step's positions, gathered once for its layers
        for layer, b in enumerate(self.blocks):
            table = self.tables[layer]
            if id(table) not in angles:
                angles[id(table)] = (table[0][positions][:, None], table[1][positions][:, None])
            cos, sin = angles[id(table)]
            qkv = b["qkv"](self._norm(x, b["norm1"]))
            qk = qkv[:, :k_end].view(tokens, -1, dim)
            if b["q_norm"] is not None:  # per head, before the rotation
                qk = torch.cat([self._norm(qk[:, :heads], b["q_norm"]), self._norm(qk[:, heads:], b["k_norm"])], 1)
            # Queries and keys are rotated together: one set of operations instead of two.
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(tokens, self.kv_heads, dim)
            attention.write(cache, layer, k, v, step.slots)
            out = b["o"](attention.attend(q, cache, layer, step, self.scale, self.windows[layer]).reshape(tokens, -1))
            x = x + (out if b["post_attn_norm"] is None else self._norm(out, b["post_attn_norm"]))
            gate, up = b["gate_up"](self._norm(x, b["norm2"])).chunk(2, dim=-1)
            out = b["down"](self.act(gate) * up)
            x = x + (out if b["post_ffn_norm"] is None else self._norm(out, b["post_ffn_norm"]))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self._norm(hidden, self.norm))


class HeadRows:
    """A tied head on the K-quant kernel looked up as the embedding table: a step's rows are read
    from the head's panels (csrc/kquants.h, kquant_rows), the same values as the file's blocks give
    (tests/test_kquants.py), so the table is not held twice (SmolLM2-1.7B's Q6_K: 82 MB)."""

    def __init__(self, head: Linear):
        self.head = head

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.kernel.kquant_rows(self.head.packed, self.head.code, self.head.in_features, ids)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers applies it: halves (not interleaved pairs) of the
    first cos.shape[-1] dims of each head; the rest pass through (Phi-3's partial rotary)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
