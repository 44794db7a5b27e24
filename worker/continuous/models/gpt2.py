"""GPT-2 over a flat batch of tokens and a paged cache: learned positions, LayerNorm, GELU."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from worker.continuous import attention
from worker.continuous.attention import KVCache, StepLayout
from worker.continuous.config import EngineConfig
from worker.continuous.linear import EVERY_STEP, Linear
from worker.continuous.models.decoder import activation_function
from worker.continuous.weights import dense_float, quantize_q4_1


class GPT2:
    @staticmethod
    def unsupported(config) -> Optional[str]:
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            return "attention scaled by layer index / reordered"
        if not config.scale_attn_weights:
            return "unscaled attention weights"
        return None

    def __init__(self, config, tensors: dict, dtype, device, products: EngineConfig, kernel=None):
        """`config`: the model's (transformers'); `products`: how the layers' products run (here only
        the head's: int4_head, small_kernel); `kernel`: the C++ kernels, or None."""
        int4_head, small = products.int4_head, products.small_kernel
        self.heads = self.kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.layers = config.n_layer
        self.eps = config.layer_norm_epsilon
        self.act = activation_function(config.activation_function)
        self.scale = 1 / math.sqrt(self.head_dim)

        def tensor(name):
            return tensors["transformer." + name].to(device=device, dtype=dtype)

        def conv1d(name):  # GPT-2 stores its projections as [in, out]
            return Linear(tensors[f"transformer.{name}.weight"].t(), tensor(name + ".bias"), dtype, device)

        self.wte, self.wpe = tensor("wte.weight"), tensor("wpe.weight")
        self.blocks = []
        for i in range(self.layers):
            p = f"h.{i}."
            self.blocks.append(dict(
                ln1=(tensor(p + "ln_1.weight"), tensor(p + "ln_1.bias")),
                qkv=conv1d(p + "attn.c_attn"), o=conv1d(p + "attn.c_proj"),
                ln2=(tensor(p + "ln_2.weight"), tensor(p + "ln_2.bias")),
                fc=conv1d(p + "mlp.c_fc"), proj=conv1d(p + "mlp.c_proj")))
        self.ln_f = (tensor("ln_f.weight"), tensor("ln_f.bias"))
        head = tensors.get("lm_head.weight", self.wte)
        head = quantize_q4_1(dense_float(head)) if int4_head else head
        self.head = Linear(head, None, dtype, device, EVERY_STEP if int4_head else 0, kernel, small=small)

    def linears(self) -> list:
        return [b[name] for b in self.blocks for name in ("qkv", "o", "fc", "proj")] + [self.head]

    def rows_decoder(self, kernel) -> bool:
        return False  # torch's norms and products, layer by layer

    def _norm(self, x, weights):
        return F.layer_norm(x, x.shape[-1:], weights[0], weights[1], self.eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                step: StepLayout) -> torch.Tensor:
        x = self.wte.index_select(0, ids) + self.wpe.index_select(0, positions)  # see llama.py
        tokens = ids.shape[0]
        for layer, b in enumerate(self.blocks):
            q, k, v = b["qkv"](self._norm(x, b["ln1"])).view(tokens, 3, self.heads, self.head_dim).unbind(1)
            attention.write(cache, layer, k, v, step.slots)
            out = attention.attend(q, cache, layer, step, self.scale)
            x = x + b["o"](out.reshape(tokens, -1))
            x = x + b["proj"](self.act(b["fc"](self._norm(x, b["ln2"]))))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self._norm(hidden, self.ln_f))
