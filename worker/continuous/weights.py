"""The quantized forms the engine keeps a GGUF file's weights in (Q41, Q80), their packings for the
kernels, and the decoding of one tensor's bytes (gguf_reader.py reads the file and names them).

transformers' GGUF loader dequantizes every block and throws the 4-bit form away; the Q4_1 and Q8_0
matrices are kept here still quantized, so the model can run small steps on the file's own blocks
(linear.py). The few transforms the models make before their layers take the weights live here too:
projections stacked into one matrix (`fuse`), a weight made float (`dense_float`), a float head
rounded to Q4_1 for --int4-head (`quantize_q4_1`). The timings behind these choices:
docs/serving.md, "Measurements behind the engine's choices".
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Union

import gguf
import numpy as np
import torch

from worker.continuous.kquants import KQuant, packable

GROUP = 32  # Q4_1 and Q8_0 blocks: 32 weights along the input dimension share a scale
PANEL = 16  # output features csrc/panels.h takes together (one int32 lane each)

_Q40_BLOCK = 18  # float16 d, 16 bytes of nibbles
_Q41_BLOCK = 20  # float16 d, float16 m, 16 bytes of nibbles
_Q80_BLOCK = 34  # float16 d, 32 int8

_F32, _F16, _BF16 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                     gguf.GGMLQuantizationType.BF16)
_Q4_0, _Q4_1, _Q8_0 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                       gguf.GGMLQuantizationType.Q8_0)
_NUMPY_FLOAT = {_F32: np.float32, _F16: np.float16}


@dataclass
class Q41:
    """A Q4_1 matrix, unpacked but still quantized: w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    d: torch.Tensor  # float32 [N, K // 32]
    m: torch.Tensor  # float32 [N, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        rows, cols = self.shape
        q = self.q.reshape(rows, cols // GROUP, GROUP).float()
        # A multiply then an add, as ggml's reference does, so the result is bit-identical to it
        # (a fused multiply-add would round once instead of twice).
        return (q * self.d[..., None] + self.m[..., None]).reshape(rows, cols)

    @staticmethod
    def cat(parts: list[Q41]) -> Q41:
        """The matrices stacked along rows (output features): a fused QKV or gate-up projection."""
        return Q41(q=torch.cat([p.q for p in parts]), d=torch.cat([p.d for p in parts]),
                   m=torch.cat([p.m for p in parts]))

    def rows(self, index: torch.Tensor) -> Q41:
        """Rows picked (or reordered) by `index`: a row owns its scales, so they move with it."""
        return Q41(q=self.q[index], d=self.d[index], m=self.m[index])

    def nibbles(self) -> torch.Tensor:
        """uint8 [N, K // 2], as the file packs them: per group of 32, 16 bytes whose low nibbles are
        weights 0-15 and high nibbles weights 16-31 (csrc/quantized.h reads this)."""
        rows, cols = self.shape
        halves = self.q.reshape(rows, cols // GROUP, 2, GROUP // 2)
        return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()

    def int8_packed(self) -> torch.Tensor:
        """uint8 [N, K // 32 * 20]: the file's Q4_1 bytes in csrc/int8.h's order, per chunk of 4
        groups: their 64 bytes of nibbles, then their 4 scales, then their 4 minimums (float16)."""
        return _chunked([self.nibbles(), _halves(self.d), _halves(self.m)], 4)

    def panel_packed(self) -> torch.Tensor:
        """uint8 [N // 16, K // 32 * 320]: csrc/panels.h's layout, 16 output features to a panel and
        per group: 4 blocks of 64 bytes (byte b of feature f in block j: weight 4j + b in its low
        nibble, 16 + 4j + b in its high one), then the 16 scales and the 16 minimums (float16)."""
        rows, cols = self.shape
        q = self.q.reshape(rows // PANEL, PANEL, cols // GROUP, 2, 4, 4)  # [P, f, G, half, j, b]
        nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, G, j, f, b]
        return _panels(nibbles, [self.d, self.m])

    def pack_int4(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scales_and_zeros) for `torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`.

        `x` must be of `dtype`: the kernel wants scales of the activations' type. It computes
        w = (q - 8) * scale + zero in float32 and sums in float32, so Q4_1's d * q + m is scale = d,
        zero = m + 8 * d. In float32 that is the file's weights exactly; in bfloat16, d and the zero
        are rounded to 8 significant bits, which moves a weight by up to 2^-9 (|q - 8| d + |zero|).
        The kernel needs N to be a multiple of 16.
        """
        # The CPU kernel takes the nibbles as int32 [N, K] and packs them itself; its second argument
        # (inner k tiles, a CUDA layout parameter) makes no difference on the CPU.
        packed = torch._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32).contiguous(), 1)
        zero = self.m + 8 * self.d  # in float32, rounded to `dtype` once
        scales_and_zeros = torch.stack([self.d, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
        return packed, scales_and_zeros  # [N, K // 2] uint8, [K // 32, N, 2]


@dataclass
class Q80:
    """A Q8_0 matrix (the GGUF's embedding table, tied to the output head), still quantized:
    w[n, k] = d[n, k // 32] * q[n, k]."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float32 [N, K // 32]
    m = None  # no minimum: Q8_0 is symmetric

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the same float32 product as ggml's reference."""
        rows, cols = self.shape
        return (self.q.reshape(rows, cols // GROUP, GROUP).float() * self.d[..., None]).reshape(rows, cols)

    @staticmethod
    def cat(parts: list[Q80]) -> Q80:
        """The matrices stacked along rows (output features): a fused QKV or gate-up projection."""
        return Q80(q=torch.cat([p.q for p in parts]), d=torch.cat([p.d for p in parts]))


    def int8_packed(self) -> torch.Tensor:
        """uint8 [N, K // 32 * 34]: the file's Q8_0 bytes in csrc/int8.h's order, per chunk of 2
        groups: their 64 weights, then their 2 scales (float16)."""
        return _chunked([self.q.view(torch.uint8), _halves(self.d)], 2)

    def panel_packed(self) -> torch.Tensor:
        """uint8 [N // 16, K // 32 * 544]: csrc/panels.h's layout, 16 output features to a panel and
        per group: 8 blocks of 64 bytes (byte b of feature f in block j: weight 4j + b, plus 128),
        then the 16 scales (float16)."""
        rows, cols = self.shape
        shifted = (self.q.to(torch.int16) + 128).to(torch.uint8)
        q = shifted.reshape(rows // PANEL, PANEL, cols // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # [P, G, j, f, b]
        return _panels(q, [self.d])


Quantized = Union[Q41, Q80, KQuant]
QUANTIZED = (Q41, Q80, KQuant)  # for isinstance: a matrix kept in the file's blocks


def _halves(values: torch.Tensor) -> torch.Tensor:
    """float32 [N, G] as float16 bytes [N, G * 2] (the file's scales are float16: exact)."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def _panels(weights: torch.Tensor, scales: list[torch.Tensor]) -> torch.Tensor:
    """Weight bytes [P, G, ...] and float32 scales [N, G] as csrc/panels.h reads them: per panel and
    group, the weights, then each scale's 16 values (float16)."""
    panels, groups = weights.shape[:2]
    parts = [weights.reshape(panels, groups, -1)]
    parts += [_halves(s).view(panels, PANEL, groups, 2).transpose(1, 2).reshape(panels, groups, -1) for s in scales]
    return torch.cat(parts, dim=-1).reshape(panels, -1).contiguous()


def _chunked(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Byte matrices [N, G * b_i] (parts[-1] holds 2 bytes a group) interleaved chunk by chunk:
    `groups` groups of each part in turn (fewer in the last chunk)."""
    count = parts[-1].shape[1] // 2
    per_group = [p.shape[1] // count for p in parts]
    pieces = [p[:, g * b:(g + groups) * b] for g in range(0, count, groups) for p, b in zip(parts, per_group)]
    return torch.cat(pieces, dim=1).contiguous()


def fuse(parts: list) -> Union[torch.Tensor, Quantized, list]:
    """Weights stacked by output rows (QKV, gate and up): one matrix product instead of several.
    Quantized parts of more than one type (a Q4_K_M file's Q4_K queries and keys beside Q6_K
    values) stay a list of runs of one type each, every run on its own type's kernel; a float
    part among quantized ones makes the whole stack dense."""
    if all(isinstance(p, QUANTIZED) for p in parts):
        runs = [list(run) for _, run in groupby(parts, key=lambda p: (type(p), getattr(p, "ggml_type", None)))]
        stacked = [type(run[0]).cat(run) if len(run) > 1 else run[0] for run in runs]
        return stacked[0] if len(stacked) == 1 else stacked
    return torch.cat([dense_float(p) for p in parts])


def dense_float(weight: Union[torch.Tensor, Quantized]) -> torch.Tensor:
    """A weight as a float32 matrix, dequantized if the file keeps it quantized."""
    return weight.dequantize() if isinstance(weight, QUANTIZED) else weight.float()


def quantize_q4_1(weight: torch.Tensor) -> Q41:
    """Round a float matrix to Q4_1 (per 32 weights: a scale and a minimum), for the --int4-head flag."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q41(q=q.view(rows, cols), d=scale, m=low)


def read_gguf(path: str):
    """(config, tensors) of a GGUF file: gguf_reader.read_gguf, kept here for its older callers."""
    from worker.continuous.gguf_reader import read_gguf as read  # gguf_reader imports this module
    return read(path)


def decode(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor | Quantized:
    """One tensor's bytes (uint8, a row of the tensor per row) as a Q41, a Q80, a KQuant or a float32
    tensor of `shape` (torch order). A KQuant keeps `raw` (the file's mapping, until packed); the
    others are in memory of their own."""
    if ggml_type == _Q4_1:
        return _unpack_q4_1(raw, *shape)
    if ggml_type == _Q4_0:
        as_q4_1 = _unpack_q4_0(raw, *shape)
        if as_q4_1 is not None:
            return as_q4_1
    if ggml_type == _Q8_0:
        return _unpack_q8_0(raw, *shape)
    if ggml_type in (_F32, _F16):
        return torch.from_numpy(raw.view(_NUMPY_FLOAT[ggml_type]).astype(np.float32)).view(shape)
    if ggml_type == _BF16:  # numpy has no bfloat16: widen the bits to float32's by hand
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32)).view(shape)
    if packable(ggml_type, shape):  # the K-quants, Q5_0, Q5_1: their own kernel (kquants.py)
        return KQuant(raw, ggml_type, tuple(shape))
    # Every other type (Q2_K, IQ*, ...) is made dense by gguf's numpy reference, the same code
    # transformers' loader and the tests' references use.
    return torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(raw), ggml_type)).view(shape)


def _unpack_q4_1(raw: np.ndarray, rows: int, cols: int) -> Q41:
    blocks = raw.reshape(rows, cols // GROUP, _Q41_BLOCK)
    d = blocks[..., 0:2].view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [rows, blocks, 16]
    # Low nibbles are weights 0-15 of the block, high nibbles weights 16-31.
    q = np.empty((rows, cols // GROUP, 2, GROUP // 2), dtype=np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=q[:, :, 0])
    np.right_shift(nibbles, 4, out=q[:, :, 1])
    return Q41(q=torch.from_numpy(q).view(rows, cols), d=torch.from_numpy(d), m=torch.from_numpy(m))


def _unpack_q4_0(raw: np.ndarray, rows: int, cols: int) -> Q41 | None:
    """Q4_0 (w = d * (q - 8)) as the Q4_1 it is: d * q + m with m = -8 d. Exactly: -8 d is d with
    its exponent moved (a float16 still, which the Q4_1 kernels read), and d * q + m is exact in
    float32 (11 + 4 bits), so these weights are the file's own, bit for bit, on the Q4_1 kernels
    instead of rounded to bf16 in a dense copy (which measured 4x the Q4_K_M file's divergence from
    float32). None where -8 d would overflow float16: then it is made dense like other types."""
    blocks = raw.reshape(rows, cols // GROUP, _Q40_BLOCK)
    d = blocks[..., 0:2].view(np.float16)[..., 0].astype(np.float32)
    m = -8 * d
    if not np.isfinite(m.astype(np.float16)).all():
        return None
    q = np.empty((rows, cols // GROUP, 2, GROUP // 2), dtype=np.uint8)
    np.bitwise_and(blocks[..., 2:], 0x0F, out=q[:, :, 0])
    np.right_shift(blocks[..., 2:], 4, out=q[:, :, 1])
    return Q41(q=torch.from_numpy(q).view(rows, cols), d=torch.from_numpy(d), m=torch.from_numpy(m))


def _unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> Q80:
    blocks = raw.reshape(rows, cols // GROUP, _Q80_BLOCK)
    d = blocks[..., 0:2].view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return Q80(q=torch.from_numpy(q).view(rows, cols), d=torch.from_numpy(d))
