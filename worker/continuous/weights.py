"""Read a llama-architecture GGUF file into Hugging Face-named tensors, keeping Q4_1 weights quantized.

transformers can load the packaged SmolLM2 GGUF itself, but it dequantizes every block through numpy,
slowly, and throws the 4-bit form away. This module reads the same file in a fraction of a
second and hands the Q4_1 and Q8_0 matrices over still quantized, so the model can run small steps
on the file's own blocks (linear.py). The few transforms the models make before their layers take
the weights live here too: projections stacked into one matrix (`fuse`), a weight made float
(`dense_float`), a float head rounded to Q4_1 for --int4-head (`quantize_q4_1`).

The header is parsed with transformers' own GGUF reader, which skips over the 98k tokenizer strings
instead of building a numpy view per string the way `gguf.GGUFReader` does (most of its time). The
config is built from the metadata with the same key mapping transformers' GGUF loader uses, so it
equals what `AutoConfig.from_pretrained(directory, gguf_file=...)` returns (tests/test_weights.py
checks it). The timings behind these choices: docs/serving.md, "Measurements behind the engine's
choices".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import gguf
import numpy as np
import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

GROUP = 32  # Q4_1 and Q8_0 blocks: 32 weights along the input dimension share a scale
PANEL = 16  # output features csrc/panels.h takes together (one int32 lane each)

_Q41_BLOCK = 20  # float16 d, float16 m, 16 bytes of nibbles
_Q80_BLOCK = 34  # float16 d, 32 int8

_F32, _F16, _BF16 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                     gguf.GGMLQuantizationType.BF16)
_Q4_1, _Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
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


Quantized = Union[Q41, Q80]


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


def fuse(parts: list) -> Union[torch.Tensor, Q41]:
    """Weights stacked by output rows (QKV, gate and up): one matrix product instead of several."""
    if all(isinstance(p, Q41) for p in parts):
        return Q41.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, (Q41, Q80)) else p for p in parts])


def dense_float(weight: Union[torch.Tensor, Quantized]) -> torch.Tensor:
    """A weight as a float32 matrix, dequantized if the file keeps it quantized."""
    return weight.dequantize() if isinstance(weight, (Q41, Q80)) else weight.float()


def quantize_q4_1(weight: torch.Tensor) -> Q41:
    """Round a float matrix to Q4_1 (per 32 weights: a scale and a minimum), for the --int4-head flag."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q41(q=q.view(rows, cols), d=scale, m=low)


def read_gguf(path: str) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor | Q41]]:
    """The model's config and its tensors under Hugging Face names (model.embed_tokens.weight,
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight, model.norm.weight;
    lm_head.weight only if the file has a separate output tensor). Q4_1 tensors come as Q41 (q/k rows already in HF order),
    everything else dequantized to float32 tensors."""
    metadata, names = read_gguf_metadata(path)
    if metadata["general.architecture"] != "llama":
        raise ValueError(f"{path}: architecture {metadata['general.architecture']!r}; only llama is supported")
    config = _config(metadata, names)

    header = GgufHeader.from_file(path)
    blob = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))  # pages are read as tensors are decoded

    # llama.cpp interleaves the two rotary halves of each q/k head; these orders undo it.
    q_rows = _unpermute_rope_rows(config.num_attention_heads, config.head_dim)
    k_rows = _unpermute_rope_rows(config.num_key_value_heads, config.head_dim)

    # The decoding is numpy's, single-threaded on purpose: torch's thread pool spends most of its time
    # waiting at barriers when other processes want the same cores (many times slower on two busy
    # cores), and this is hundreds of small operations.
    tensors = {}
    for info in header.tensors:
        name = _hf_name(info.name)
        start = header.data_start + info.offset
        rows = blob[start:start + info.nbytes].reshape(info.shape[0], -1)  # a row's blocks are its own
        if name.endswith("self_attn.q_proj.weight"):
            rows = rows[q_rows]
        elif name.endswith("self_attn.k_proj.weight"):
            rows = rows[k_rows]
        tensors[name] = _decode(rows, info.ggml_type, info.shape)
    return config, tensors


def _config(metadata: dict, tensor_names: tuple[str, ...]) -> transformers.PretrainedConfig:
    """The config transformers' GGUF loader builds, from the metadata alone.

    `AutoConfig.from_pretrained(directory, gguf_file=...)` gets there through `gguf.GGUFReader`, which
    is slow on this file; this is the same key mapping applied to the cheaply read metadata.
    """
    architecture = metadata["general.architecture"]
    values = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        if prefix in ("general", "tokenizer", architecture):
            target = GGUF_CONFIG_MAPPING[prefix].get(rest)
            if target is not None and target != -1:  # None and -1: keys transformers knowingly skips
                values[target] = value
    # llama.cpp writes the output projection only when it is not the embedding matrix.
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    if "vocab_size" not in values:
        values["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader leaves string arrays as counts
    return CONFIG_MAPPING[values["model_type"]].from_dict(values)


_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _hf_name(name: str) -> str:
    parts = name.split(".")  # "token_embd.weight" or "blk.3.attn_q.weight"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    # Fail loudly: a tensor we do not place (llama3's rope_freqs, say) would silently change the model.
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face llama counterpart here")


def _unpermute_rope_rows(heads: int, head_dim: int) -> np.ndarray:
    """The row order that turns llama.cpp's q/k rows back into Hugging Face's.

    Within a head, llama.cpp's row 2i + a is Hugging Face's row a * head_dim / 2 + i.
    """
    return np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _decode(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor | Quantized:
    """One tensor's bytes (uint8, a row of the tensor per row) as a Q41, a Q80 or a float32 tensor of
    `shape` (torch order), in memory of its own rather than the file's mapping."""
    if ggml_type == _Q4_1:
        return _unpack_q4_1(raw, *shape)
    if ggml_type == _Q8_0:
        return _unpack_q8_0(raw, *shape)
    if ggml_type in (_F32, _F16):
        return torch.from_numpy(raw.view(_NUMPY_FLOAT[ggml_type]).astype(np.float32)).view(shape)
    if ggml_type == _BF16:  # numpy has no bfloat16: widen the bits to float32's by hand
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32)).view(shape)
    # Anything else is rare enough for gguf's numpy reference to do.
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


def _unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> Q80:
    blocks = raw.reshape(rows, cols // GROUP, _Q80_BLOCK)
    d = blocks[..., 0:2].view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return Q80(q=torch.from_numpy(q).view(rows, cols), d=torch.from_numpy(d))
