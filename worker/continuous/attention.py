"""Attention over the paged KV cache, for a step that mixes one-token decodes and prefill chunks.

The cache of one layer is a tensor [kv_heads, blocks, block_size, head_dim]: heads first, so
that gathering a batch's blocks with one `index_select` gives each KV head a contiguous
[rows, length, head_dim] block, ready for batched matrix products without another copy; and
whole blocks, because gathering a few large blocks is faster than gathering many small slots
(measured: docs/serving.md, "Measurements behind the engine's choices").

Decodes (one query token each) are done together by a small C++ kernel (kernels.py) that reads
each row's keys and values in place through its block table. Without it, in torch: the rows'
blocks are gathered, then two batched matmuls with the query heads that share a KV head stacked
as rows (torch's fused CPU attention was slower for one-token queries). A
row's context is padded to the longest in the batch with its own first block (real data, never
uninitialised memory) and masked off. Prefill chunks (a few per
step at most) each go through torch's fused attention with a causal mask offset by what the
request had computed before the chunk.

A sliding-window layer (Mistral's, Gemma 3's local ones) attends to the last `window` positions
only, its own included, as transformers' sliding mask does: the decodes' keys before that are
masked off (the C++ kernel skips them), a chunk's context starts where its first query's window
does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


SMALL_DECODE_ROWS = 4  # up to this many decode rows, attention runs in float32 (it measured faster)


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, blocks: int, block_size: int,
                 dtype, device):
        # torch.empty: pages the pool never uses are never touched, so they cost no resident memory.
        shape = (layers, kv_heads, blocks, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass
class Chunk:
    """A prefill chunk: query tokens [start, end) of the step, attending to `context` slots."""
    start: int
    end: int
    context: torch.Tensor  # slots of every token up to the chunk's last, in order
    mask: torch.Tensor  # [end - start, len(context)] True where a query may look
    first: int = 0  # the position of the chunk's first query
    windowed: dict = field(default_factory=dict)  # window -> (context, mask) of a sliding layer, made once

    def window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The context and mask of a layer that attends to the last `window` positions (0: all)."""
        start = max(0, self.first - window + 1)  # the first key any query of the chunk sees
        if not window or start == 0 and self.first + (self.end - self.start) <= window:
            return self.context, self.mask
        if window not in self.windowed:
            queries = self.first + torch.arange(self.end - self.start, device=self.mask.device)
            keys = torch.arange(start, self.context.shape[0], device=self.mask.device)
            mask = self.mask[:, start:] & (keys[None, :] > queries[:, None] - window)
            self.windowed[window] = (self.context[start:], mask)
        return self.windowed[window]


@dataclass
class StepLayout:
    """Where this step's tokens go in the cache and what each attends to."""
    slots: torch.Tensor  # [tokens] where each token's K and V are written
    decodes: int = 0  # the first `decodes` tokens are one-token decodes
    decode_tables: torch.Tensor = None  # [decodes, width] each decode row's blocks, padded
    decode_lengths: torch.Tensor = None  # [decodes] tokens each decode row attends to
    kernel: object = None  # the compiled decode kernel (worker.continuous.kernels), or None
    chunks: list[Chunk] = field(default_factory=list)


def write(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_dim], stored at `slots` (block * block_size + offset)."""
    dtype = cache.k.dtype  # rounded to it where the cache keeps fewer bits than the step (engine.cache_dtype)
    cache.k[layer].flatten(1, 2).index_copy_(1, slots, k.transpose(0, 1).to(dtype))
    cache.v[layer].flatten(1, 2).index_copy_(1, slots, v.transpose(0, 1).to(dtype))


def attend(q: torch.Tensor, cache: KVCache, layer: int, step: StepLayout, scale: float,
           window: int = 0) -> torch.Tensor:
    """q: [tokens, heads, head_dim], after this step's K and V were written; `window`: positions
    each query attends to, its own included (0: all before it). Returns the same shape."""
    k, v = cache.k[layer], cache.v[layer]
    parts = [_decode(q[:step.decodes], k, v, step, scale, window)] if step.decodes else []
    parts += [_prefill(q[c.start:c.end], k, v, c, scale, window) for c in step.chunks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(q, k_cache, v_cache, step: StepLayout, scale: float, window: int = 0) -> torch.Tensor:
    if step.kernel is not None:
        with torch.profiler.record_function("paged_decode (C++)"):  # seen in profiles by name
            return step.kernel.paged_decode(q.contiguous(), k_cache, v_cache, step.decode_tables,
                                            step.decode_lengths, scale, window)
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    blocks = step.decode_tables.flatten()
    longest = blocks.shape[0] // rows * k_cache.shape[2]
    k = k_cache.index_select(1, blocks).view(kv_heads, rows, longest, dim).to(q.dtype)
    v = v_cache.index_select(1, blocks).view(kv_heads, rows, longest, dim).to(q.dtype)
    q = q.reshape(rows, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
    dtype = q.dtype
    if rows <= SMALL_DECODE_ROWS:  # bf16 batched matmuls carry a fixed cost each, large at few rows
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [kv_heads, rows, group, longest]
    padded = torch.arange(longest, device=q.device)[None, :] >= step.decode_lengths[:, None]
    if window:  # and the keys before each row's window
        padded |= torch.arange(longest, device=q.device)[None, :] < (step.decode_lengths - window)[:, None]
    scores.masked_fill_(padded[None, :, None, :], float("-inf"))
    v = v.masked_fill(padded[None, :, :, None], 0)  # a weight of 0 times a stale NaN is still NaN
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(weights, v).to(dtype)  # [kv_heads, rows, group, dim]
    return out.transpose(0, 1).reshape(rows, heads, dim)


def _prefill(q, k_cache, v_cache, chunk: Chunk, scale: float, window: int = 0) -> torch.Tensor:
    context, mask = chunk.window(window)
    k = k_cache.flatten(1, 2).index_select(1, context).to(q.dtype)  # [kv_heads, context, dim]
    v = v_cache.flatten(1, 2).index_select(1, context).to(q.dtype)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
