"""A linear layer that holds its weight twice: bf16 for big steps, 4-bit for small ones.

At a few tokens per step a decode is bound by memory bandwidth, and the 4-bit copy (the GGUF's
own Q4_1 blocks, repacked for torch's int4 CPU kernel without changing a value) streams a quarter
of the bytes. At many tokens per step it is bound by arithmetic, and the bf16 matrix product wins.
The choice is made per call, by the number of rows.

On the CPU the bf16 weight is stored pre-packed in oneDNN's blocked layout, the same kernel that
torch.compile's freezing pass uses: measured here, 1.1-2x faster than F.linear on the same
weight, with no compile step. Float32 keeps F.linear, so the exactness tests compare like with like.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from worker.continuous.weights import Q41

GROUP = 32  # Q4_1's block: one scale and one minimum per 32 weights of a row
PACK_ROWS_HINT = 64  # oneDNN blocks the packed weight for steps of about this many rows


class Linear:
    def __init__(self, weight: Union[torch.Tensor, Q41], bias: Optional[torch.Tensor], dtype,
                 device, int4_rows: int = 0):
        quantized = isinstance(weight, Q41)
        self.weight = (weight.dequantize() if quantized else weight).to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.out_features = self.weight.shape[0]
        self.onednn = device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
        if self.onednn:  # the plain copy is not kept: the packed one is all the products need
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
        self.int4_rows = int4_rows if quantized and device.type == "cpu" else 0
        self.packed = self.scales_zeros = None
        if self.int4_rows:
            self.packed, self.scales_zeros = weight.pack_int4(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.int4_rows:
            out = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
            return out if self.bias is None else out + self.bias
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fuse(parts: list) -> Union[torch.Tensor, Q41]:
    """Weights stacked by output rows (QKV, gate and up): one matrix product instead of several."""
    if all(isinstance(p, Q41) for p in parts):
        return Q41.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, Q41) else p for p in parts])


def quantize_q4_1(weight: torch.Tensor) -> Q41:
    """Round a float matrix to Q4_1 (per 32 weights: a scale and a minimum), for the --int4-head flag."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q41(q=q.view(rows, cols), d=scale, m=low)
