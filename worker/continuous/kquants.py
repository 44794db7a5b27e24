"""The K-quant and 5-bit blocks of llama.cpp's files (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), kept as the file
has them and packed once for csrc/kquants.h.

A Q4_K_M file is mostly Q4_K with Q6_K where llama.cpp wants more bits (the head, half the
attention values and MLP down projections), and Q5_0 where rows are no multiple of 256 (most of
SmolLM2-135M's); Q5_K_M is Q5_K, Q6_K and Q5_1. `KQuant` holds one such tensor's bytes (a view of
the file's mapping until packed); `panel_packed` lays them out as the kernel reads them, 16
output features a panel. Every type is read as unsigned integers u with w = S u - M per 32 (Q6_K:
16) weights, S and M the file's own float16 and 6-bit scales, so the packed form holds the file's
weights bit for bit, in the same bytes per weight (tests/test_kquants.py checks both against
gguf's dequantization).

The unpacking follows ggml's reference (ggml-quants.c, dequantize_row_*), vectorised in numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
# The kernel's codes (csrc/kquants.h, kquants::Type).
CODES = {T.Q4_K: 0, T.Q5_K: 1, T.Q6_K: 2, T.Q5_0: 3, T.Q5_1: 4}
PANEL = 16  # output features per panel
GROUP = 32


@dataclass
class KQuant:
    """One tensor of a type in CODES: its rows' bytes as the file stores them."""

    raw: np.ndarray  # uint8 [N, bytes per row]
    ggml_type: int
    shape: tuple[int, int]  # [N, K], torch order

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: gguf's reference dequantization (the float reference of this tensor)."""
        return torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(self.raw), self.ggml_type)).view(self.shape)

    def owned(self) -> KQuant:
        """The same tensor in memory of its own (not the file's mapping, which can then go)."""
        return KQuant(np.array(self.raw), self.ggml_type, self.shape)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: rows `ids` as `dequantize` gives them (an embedding lookup)."""
        raw = np.ascontiguousarray(self.raw[ids.cpu().numpy()])
        return torch.from_numpy(gguf.quants.dequantize(raw, self.ggml_type)).view(len(ids), self.shape[1])

    @staticmethod
    def cat(parts: list[KQuant]) -> KQuant:
        """Rows stacked (a fused QKV or gate-up projection): one type only."""
        assert len({p.ggml_type for p in parts}) == 1
        return KQuant(np.concatenate([p.raw for p in parts]), parts[0].ggml_type,
                      (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @property
    def code(self) -> int:
        return CODES[T(self.ggml_type)]

    @property
    def name(self) -> str:
        return T(self.ggml_type).name

    def panel_packed(self) -> torch.Tensor:
        """uint8 [N // 16, bytes per panel]: csrc/kquants.h's layout (its header comment)."""
        u, scales, header = unpack(self.raw, self.ggml_type, *self.shape)
        return pack_panels(u, scales, header, self.ggml_type)

    def weights(self) -> torch.Tensor:
        """float32 [N, K] from the unpacked integers and scales (S u - M), for the tests: equals
        `dequantize` where the unpacking is right."""
        u, scales, header = unpack(self.raw, self.ggml_type, *self.shape)
        return torch.from_numpy(_weights(u, scales, header, self.ggml_type))


def packable(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether csrc/kquants.h takes this tensor: a type of CODES, a matrix of whole panels."""
    return ggml_type in {int(t) for t in CODES} and len(shape) == 2 and shape[0] % PANEL == 0


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0]


def _scale_min_k4(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of scales per block as 8 6-bit scales and 8 6-bit minimums."""
    sc = np.empty(q.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    m[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    m[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, m


def unpack(raw: np.ndarray, ggml_type: int, rows: int, cols: int):
    """(u uint8 [N, K], per-group scales, per-superblock header) of one tensor's blocks:
    Q4_K, Q5_K: ({sc, m} uint8 [N, K // 32], {d, dmin} float16 [N, K // 256]);
    Q6_K: ({sc} int8 [N, K // 16], {d} float16 [N, K // 256]);
    Q5_0: ({d}, {}); Q5_1: ({d, mneg = -m}, {}), float16 [N, K // 32]."""
    kind = T(ggml_type)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    b = np.ascontiguousarray(raw).reshape(rows, cols // block, size)
    if kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, m = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 64 weights: lows, then highs
        u = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [N, blocks, chunk, half, 32]
        if kind == T.Q5_K:
            qh = b[..., 16:48]  # bit 2c (+1 for the highs) of byte l: weight 64c + l's fifth bit
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            u |= ((qh[:, :, None, None, :] >> shifts) & 1) << 4
        return u.reshape(rows, cols), {"sc": sc.reshape(rows, -1), "m": m.reshape(rows, -1)}, {"d": d, "dmin": dmin}
    if kind == T.Q6_K:
        ql, qh = b[..., 0:128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        d = _f16(b, 208)
        # Per 128 weights: four runs of 32, from the low/high nibbles of ql's two halves and
        # bit pairs 0, 2, 4, 6 of qh.
        low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        u = low | (high << 4)  # [N, blocks, 2, 4, 32]
        return u.reshape(rows, cols), {"sc": sc.reshape(rows, -1)}, {"d": d}
    if kind in (T.Q5_0, T.Q5_1):
        at = 2 if kind == T.Q5_0 else 4
        qh = np.ascontiguousarray(b[..., at:at + 4]).view(np.uint32)[..., 0]
        qs = b[..., at + 4:]
        bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (bits << 4)
        scales = {"d": _f16(b, 0)}
        if kind == T.Q5_1:
            scales["mneg"] = -_f16(b, 2)
        return u.reshape(rows, cols), scales, {}
    raise ValueError(f"no K-quant kernel for {kind.name}")


def _weights(u: np.ndarray, scales: dict, header: dict, ggml_type: int) -> np.ndarray:
    """w = S u - M in float32, as ggml's reference computes it (products rounded the same way)."""
    kind = T(ggml_type)
    rows, cols = u.shape
    uf = u.astype(np.float32)
    if kind in (T.Q4_K, T.Q5_K):
        d = np.repeat(header["d"].astype(np.float32), 8, axis=1) * scales["sc"].astype(np.float32)
        dm = np.repeat(header["dmin"].astype(np.float32), 8, axis=1) * scales["m"].astype(np.float32)
        w = d[..., None] * uf.reshape(rows, -1, GROUP) - dm[..., None]
    elif kind == T.Q6_K:
        s = np.repeat(header["d"].astype(np.float32), 16, axis=1) * scales["sc"].astype(np.float32)
        w = s[..., None] * (uf.reshape(rows, -1, 16) - 32)
    elif kind == T.Q5_0:
        w = scales["d"].astype(np.float32)[..., None] * (uf.reshape(rows, -1, GROUP) - 16)
    else:
        w = scales["d"].astype(np.float32)[..., None] * uf.reshape(rows, -1, GROUP) - scales["mneg"].astype(np.float32)[..., None]
    return w.reshape(rows, cols).astype(np.float32)


def _per_panel(values: np.ndarray, per_group: int) -> np.ndarray:
    """[N, G * per_group] -> bytes [P, G, per_group * 16 * itemsize]: each group's values for the
    panel's 16 features, value-major (all features' first value, then their second)."""
    rows, total = values.shape
    groups = total // per_group
    v = values.reshape(rows // PANEL, PANEL, groups, per_group).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(v).view(np.uint8).reshape(rows // PANEL, groups, -1)


def pack_panels(u: np.ndarray, scales: dict, header: dict, ggml_type: int) -> torch.Tensor:
    """The unpacked blocks in csrc/kquants.h's panel layout, uint8 [N // 16, bytes per panel]."""
    kind = T(ggml_type)
    rows, cols = u.shape
    panels, groups = rows // PANEL, cols // GROUP
    # [P, f, G, half, j, b] -> per group: block j, feature f, byte b: lows | highs << 4
    v = u.reshape(panels, PANEL, groups, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # [P, G, half, j, f, b]
    parts = [((v[:, :, 0] & 0x0F) | ((v[:, :, 1] & 0x0F) << 4)).reshape(panels, groups, 256)]
    vectors = v.transpose(0, 1, 3, 2, 4, 5).reshape(panels, groups, 8, 64)  # vector 2j + half
    if kind in (T.Q5_K, T.Q5_0, T.Q5_1):
        fifth = (vectors >> 4) & 1
        parts.append(np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[:, None], axis=2))
    elif kind == T.Q6_K:
        pair = (vectors >> 4) & 3
        shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
        parts += [np.bitwise_or.reduce(pair[:, :, 4 * k:4 * k + 4] << shifts, axis=2) for k in (0, 1)]
    if kind in (T.Q4_K, T.Q5_K):
        parts += [_per_panel(scales["sc"], 1), _per_panel(scales["m"], 1)]
    elif kind == T.Q6_K:
        parts.append(_per_panel(scales["sc"], 2))  # the two halves' scales, value-major: 16 then 16
    else:
        parts += [_per_panel(scales[name], 1) for name in ("d", "mneg") if name in scales]
    body = np.concatenate(parts, axis=-1)  # [P, G, group bytes]
    if header:
        heads = np.concatenate([_per_panel(header[n][:, :, None].reshape(rows, -1), 1) for n in ("d", "dmin")
                                if n in header], axis=-1)  # [P, S, header bytes]
        body = np.concatenate([heads, body.reshape(panels, heads.shape[1], -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(body).reshape(panels, -1))
