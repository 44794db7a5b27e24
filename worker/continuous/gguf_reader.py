"""Read a GGUF file of a common small family into Hugging Face-named tensors and a transformers config.

transformers can load these files itself, but it dequantizes every block through numpy, slowly,
and throws the 4-bit form away. This reads the same file in a fraction of a second, hands Q4_1, Q4_0,
Q8_0, the K-quants, Q5_0 and Q5_1 over still quantized (weights.py, kquants.py: the engine's
kernels run on those blocks), and makes every other type dense once, at load, saying so in one
log line.

What llama.cpp's converter (convert_hf_to_gguf.py, llama-cpp-python 0.3.36) did to each family is
undone here, so that every tensor means what the same name means in transformers' state_dict():
- names: llama.cpp's standard names per architecture (gguf-py's tensor_mapping), _LAYER_NAMES;
- arch "llama" (Llama and Mistral): LlamaModel.permute interleaved the two rotary halves of each
  q/k head (weights and biases); _unpermute_rope_rows puts them back;
- gemma3: Gemma3Model.norm_shift added 1 to every "*norm.weight" (Gemma's RMSNorm multiplies by
  1 + w); 1 is subtracted again, in float32, as transformers' Gemma2TensorProcessor does;
- phi3: attn_qkv and ffn_up are Phi-3's own fused qkv_proj and gate_up_proj, unchanged.
A tensor with no counterpart fails loudly: a weight silently dropped would change the model.

The header is parsed with transformers' GGUF reader, which skips over the vocabulary's strings
instead of building a numpy view per string as `gguf.GGUFReader` does (most of its time). Its
tensor table is read with the same module's functions but sized here from gguf's own block table,
since transformers' `GgufHeader` refuses types it cannot dequantize itself (Q5_0, which
llama.cpp's Q4_K_M uses where K-blocks do not fit). The config: gguf_config.py beside this file.
"""
from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from typing import NamedTuple

import gguf
import numpy as np
from transformers.integrations.gguf.reader import _read_metadata, _read_tensor_table

from worker.continuous.gguf_config import UnsupportedGGUF, build_config
from worker.continuous.weights import QUANTIZED, decode

log = logging.getLogger(__name__)

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_COMMON = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Per architecture (general.architecture), a layer's tensors as gguf-py's tensor_mapping names them.
_LAYER_NAMES = {
    "llama": _COMMON,
    "qwen2": _COMMON,
    "qwen3": {**_COMMON, **_QK_NORMS},
    # Gemma 3 norms around both blocks: llama.cpp's ffn_norm is the pre-feed-forward one.
    "gemma3": {**_COMMON, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3 keeps its fused projections: ffn_up is gate_up_proj (gate rows first), attn_qkv qkv_proj.
    "phi3": {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Tensors llama.cpp generates from the config rather than converts, read into the config instead
# (gguf_config.py checks them against what transformers computes from it).
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Values, not blocks: read as float32 without counting as "made dense".
_FLOATS = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


class TensorEntry(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    start: int  # absolute offset in the file
    nbytes: int


def read_gguf(path: str, config=None):
    """(config, tensors): transformers' config (`config` when given: the one worker/gguf_derived.py
    kept for this file), and the weights by Hugging Face name as float32 tensors, Q41, Q80 or
    KQuant. Raises UnsupportedGGUF, naming the file and what is wrong, for a file this cannot read
    faithfully."""
    blob, metadata, entries = _read_header(path)
    architecture = metadata["general.architecture"]
    if config is None:
        config = _config(path, blob, metadata, entries)

    permuted = architecture == "llama"  # the only family LlamaModel.undo_permute applies to
    q_rows = _unpermute_rope_rows(config.num_attention_heads, config.head_dim) if permuted else None
    k_rows = _unpermute_rope_rows(config.num_key_value_heads, config.head_dim) if permuted else None
    # The decoding is numpy's, single-threaded on purpose: torch's thread pool spends most of its time
    # waiting at barriers when other processes want the same cores (many times slower on two busy
    # cores), and this is hundreds of small operations.
    tensors, dense, file_bytes, dense_bytes = {}, Counter(), 0, 0
    for entry in entries:
        if entry.name in CONFIG_TENSORS:
            continue
        name = _hf_name(path, architecture, entry.name)
        order = q_rows if ".self_attn.q_proj." in name else k_rows if ".self_attn.k_proj." in name else None
        tensor = _decode(blob, entry, path, order)
        if architecture == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1  # Gemma3Model.norm_shift
        if not isinstance(tensor, QUANTIZED) and entry.ggml_type not in _FLOATS:
            dense[gguf.GGMLQuantizationType(entry.ggml_type).name] += 1
            file_bytes += entry.nbytes
            dense_bytes += tensor.numel() * tensor.element_size()
        tensors[name] = tensor
    if dense:
        types = ", ".join(f"{count} {kind}" for kind, count in sorted(dense.items()))
        log.warning("%s: %s tensors made dense float32 at load (the engine has no kernels for these types): "
                    "%.1f MiB in memory for their %.1f MiB in the file", os.path.basename(path), types,
                    dense_bytes / 2**20, file_bytes / 2**20)
    return config, tensors


def read_config(path: str):
    """The file's transformers config alone (gguf_config.py); UnsupportedGGUF as read_gguf."""
    return _config(path, *_read_header(path))


def _config(path: str, blob, metadata: dict, entries):
    architecture = metadata["general.architecture"]
    config_tensors = {e.name: _decode(blob, e, path).numpy() for e in entries if e.name in CONFIG_TENSORS}
    try:
        return build_config(path, metadata, tuple(e.name for e in entries), config_tensors)
    except UnsupportedGGUF:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # a key missing, or of the wrong kind
        raise UnsupportedGGUF(f"{path}: its metadata does not describe a {architecture} model "
                              f"({type(exc).__name__}: {exc})") from exc


def _read_header(path: str):
    """(the file as bytes, its metadata, its tensors' entries), every entry checked against the file."""
    try:
        blob = np.memmap(path, dtype=np.uint8, mode="r")
        metadata, count, pos = _read_metadata(blob, path)
        table, pos = _read_tensor_table(blob, count, pos)
    except (struct.error, ValueError, UnicodeDecodeError, IndexError, OSError) as exc:
        # struct.error and IndexError: the header runs past the end of the file
        raise UnsupportedGGUF(f"{path}: not a readable GGUF file ({exc})") from exc
    alignment = metadata.get("general.alignment", 32)
    data_start = (pos + alignment - 1) // alignment * alignment
    entries = []
    for name, shape, ggml_type, offset in table:
        try:
            kind = gguf.GGMLQuantizationType(ggml_type)
        except ValueError:
            raise UnsupportedGGUF(f"{path}: tensor {name!r} has ggml type {ggml_type}, which gguf does not know")
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if shape[-1] % block:  # a row's blocks must be its own for rows to be read (and permuted)
            raise UnsupportedGGUF(f"{path}: tensor {name!r} of shape {shape} is {kind.name}, whose blocks of "
                                  f"{block} do not divide its rows of {shape[-1]}")
        nbytes = int(np.prod(shape)) // block * block_bytes
        if data_start + offset + nbytes > len(blob):
            raise UnsupportedGGUF(f"{path}: truncated: tensor {name!r} ends at byte {data_start + offset + nbytes:,}"
                                  f" of a file of {len(blob):,}")
        entries.append(TensorEntry(name, shape, ggml_type, data_start + offset, nbytes))
    return blob, metadata, entries


def _decode(blob: np.ndarray, entry: TensorEntry, path: str, rows: np.ndarray | None = None):
    raw = blob[entry.start:entry.start + entry.nbytes].reshape(entry.shape[0], -1)  # a row per row
    if rows is not None:
        raw = raw[rows]
    try:
        return decode(raw, entry.ggml_type, entry.shape)
    except (NotImplementedError, ValueError) as exc:  # a type gguf's numpy reference cannot decode
        raise UnsupportedGGUF(f"{path}: tensor {entry.name!r} of type "
                              f"{gguf.GGMLQuantizationType(entry.ggml_type).name} cannot be decoded ({exc})") from exc


def _hf_name(path: str, architecture: str, name: str) -> str:
    parts = name.split(".")  # "token_embd.weight" or "blk.3.attn_q.weight"
    layer_names = _LAYER_NAMES[architecture]
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise UnsupportedGGUF(f"{path}: tensor {name!r} has no Hugging Face {architecture} counterpart here")


def _unpermute_rope_rows(heads: int, head_dim: int) -> np.ndarray:
    """The row order that turns llama.cpp's q/k rows back into Hugging Face's (LlamaModel.permute
    reversed). Within a head, llama.cpp's row 2i + a is Hugging Face's row a * head_dim / 2 + i."""
    return np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
