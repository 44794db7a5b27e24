"""A GGUF file's transformers config, with what transformers' GGUF mapping loses filled back in.

The base is the key mapping transformers' own GGUF loader applies (GGUF_CONFIG_MAPPING), so the
config equals `AutoConfig.from_pretrained(directory, gguf_file=...)` wherever that is right. Where
it is not, the model code would run a different model than llama.cpp does, so the file's metadata
(and the tensors llama.cpp generated from the original config) fill it in, each fact checked
against llama.cpp 0.3.36's converter and loader:

- head_dim from attention.key_length (qwen3's 128 default otherwise, whatever the file says);
- rope scaling (linear, yarn) from rope.scaling.*, which transformers maps for no family here;
- llama3 rope scaling: the converter writes no keys, only a rope_freqs tensor of per-frequency
  divisors (LlamaModel.generate_extra_tensors); the parameters are recovered from it and then
  checked: transformers' own llama3 rotary from this config must give exactly those divisors;
- gemma3: query_pre_attn_scalar as llama.cpp scales queries (head_dim; hidden / heads for the
  62-layer 27B), the local layers' rope base (rope.freq_base_swa), the local/global layer pattern
  (every 6th layer global unless the file says otherwise, as llama.cpp's load_swa_pattern), and
  final_logit_softcapping;
- phi3: partial_rotary_factor from rope.dimension_count, the sliding window, the original context,
  and LongRoPE's factors from the rope_factors_long/short tensors;
- attention_bias / mlp_bias for llama-architecture files that carry biases.
What no GGUF says is lost for llama.cpp too: Mistral's sliding window (arch "llama" has none).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3", "phi3")


class UnsupportedGGUF(ValueError):
    """A GGUF file this reader cannot read faithfully; the message names the file and why."""


def build_config(path: str, metadata: dict, tensor_names: tuple[str, ...],
                 tensors: dict[str, np.ndarray]) -> transformers.PretrainedConfig:
    """The config of the model in `path` (metadata and tensor names as read from it; `tensors`:
    the generated rope tensors, as float32 arrays)."""
    architecture = metadata["general.architecture"]
    if architecture not in SUPPORTED:
        static = architecture in GGUF_CONFIG_MAPPING or architecture in GGUF_CONFIG_ARCHS
        raise UnsupportedGGUF(
            f"{path}: architecture {architecture!r} is not one the continuous engine reads "
            f"({', '.join(SUPPORTED)}); " + ("`--engine static` may run it (transformers reads this architecture)"
                                             if static else "nor does transformers read it"))
    values = _mapped(metadata, tensor_names)
    key = lambda name, default=None: metadata.get(f"{architecture}.{name}", default)  # noqa: E731
    if key("attention.key_length") is not None:
        values["head_dim"] = key("attention.key_length")
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": values.pop("rope_theta", 10000.0)}
    rope.update(_scaling(metadata, architecture))

    if architecture == "llama":
        values["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        values["mlp_bias"] = "blk.0.ffn_down.bias" in tensor_names
        if "rope_freqs.weight" in tensors:
            rope.update(_llama3(path, rope["rope_theta"], head_dim, tensors["rope_freqs.weight"]))
        values["rope_parameters"] = rope
    elif architecture == "gemma3":
        layers = values["num_hidden_layers"]
        # llama.cpp's scale of the queries (models/gemma3.cpp, f_attention_scale)
        values["query_pre_attn_scalar"] = values["hidden_size"] // values["num_attention_heads"] \
            if layers == 62 else head_dim
        values["layer_types"] = _gemma3_layers(metadata, layers)
        local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10000.0)}
        values["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        if key("final_logit_softcapping"):
            values["final_logit_softcapping"] = key("final_logit_softcapping")
    elif architecture == "phi3":
        rope["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
        if key("rope.scaling.original_context_length"):
            values["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        if key("attention.sliding_window"):  # 0: none (the converter's mark of Phi-4)
            values["sliding_window"] = key("attention.sliding_window")
        if "rope_factors_long.weight" in tensors:
            rope.update(rope_type="longrope", long_factor=tensors["rope_factors_long.weight"].tolist(),
                        short_factor=tensors["rope_factors_short.weight"].tolist(),
                        original_max_position_embeddings=values["original_max_position_embeddings"])
            if key("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = key("rope.scaling.attn_factor")
        values["rope_parameters"] = rope
    else:
        values["rope_parameters"] = rope
    config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    if architecture == "llama" and rope["rope_type"] == "llama3":
        _check_llama3(path, config, tensors["rope_freqs.weight"])
    return config


def _mapped(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config dict transformers' GGUF loader builds (load_gguf_checkpoint), from the metadata."""
    architecture = metadata["general.architecture"]
    # transformers' loader calls a llama file Mistral only when its general.name is exactly "mistral"
    updated = "mistral" if architecture == "llama" and metadata.get("general.name") == "mistral" else architecture
    values = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        if prefix == architecture:
            prefix = updated
        if prefix in ("general", "tokenizer", updated):
            target = GGUF_CONFIG_MAPPING[prefix].get(rest)
            if target is not None and target != -1:  # None and -1: keys transformers knowingly skips
                values[target] = value.replace(architecture, updated) if isinstance(value, str) else value
    values["model_type"] = "gemma3_text" if updated == "gemma3" else updated
    # llama.cpp writes the output projection only when it is not the embedding matrix.
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    if "vocab_size" not in values:
        values["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader leaves string arrays as counts
    return values


def _scaling(metadata: dict, architecture: str) -> dict:
    """rope.scaling.* as transformers' rope parameters (the converter's set_gguf_parameters)."""
    key = lambda name: metadata.get(f"{architecture}.rope.scaling.{name}")  # noqa: E731
    kind = key("type")
    if kind == "linear" and key("factor"):
        return {"rope_type": "linear", "factor": key("factor")}
    if kind == "yarn" and key("factor"):
        yarn = {"rope_type": "yarn", "factor": key("factor"),
                "original_max_position_embeddings": key("original_context_length")}
        for gguf_name, name in (("yarn_ext_factor", "extrapolation_factor"), ("yarn_attn_factor", "attention_factor"),
                                ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if key(gguf_name) is not None:
                yarn[name] = key(gguf_name)
        return yarn
    return {}


_LOW_FREQ_FACTOR, _HIGH_FREQ_FACTOR = 1.0, 4.0  # every Llama 3.x release's


def _llama3(path: str, theta: float, head_dim: int, divisors: np.ndarray) -> dict:
    """llama3 rope parameters that give these per-frequency divisors (rope_freqs).

    The converter computed divisor 1 for wavelengths under L / high_freq_factor, `factor` for those
    over L / low_freq_factor, and 1 / ((1 - s) / factor + s) between, s = (L / wavelength - low) /
    (high - low). So factor is the largest divisor, and each divisor between gives L; only s's line
    matters, so low and high are taken as Llama 3's and L solved for (checked after: _check_llama3).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelength = 2 * math.pi / inv_freq.astype(np.float64)
    divisors = divisors.astype(np.float64)
    factor = float(divisors.max())
    if factor == 1.0:
        return {}
    between = (divisors > 1.0) & (divisors < factor)
    low, high = _LOW_FREQ_FACTOR, _HIGH_FREQ_FACTOR
    if between.any():
        s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        context = float(np.median(wavelength[between] * (low + (high - low) * s)))
    else:  # no wavelength in between: any L with the same split does, the middle one
        unscaled, scaled = wavelength[divisors == 1.0], wavelength[divisors == factor]
        lowest = unscaled.max() * high if unscaled.size else 0.0
        context = math.sqrt(max(lowest, 1.0) * scaled.min() * low)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(round(context))}


def _check_llama3(path: str, config, divisors: np.ndarray) -> None:
    """transformers' llama3 rotary on this config must divide the plain frequencies by the file's
    rope_freqs, or the model code (which computes its rotary from the config) would run another model."""
    head_dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    if not torch.allclose(plain / scaled, torch.from_numpy(divisors).float(), rtol=1e-4, atol=0):
        raise UnsupportedGGUF(f"{path}: its rope_freqs tensor is not llama3 rope scaling with low/high "
                              f"frequency factors {_LOW_FREQ_FACTOR}/{_HIGH_FREQ_FACTOR}: cannot express it as a config")


def _gemma3_layers(metadata: dict, layers: int) -> list[str]:
    """Which Gemma 3 layers are local (sliding) and which global, as llama.cpp decides: none local
    without a sliding window; else the file's pattern (a list of flags, or a period), or every 6th."""
    if not metadata.get("gemma3.attention.sliding_window"):
        return ["full_attention"] * layers
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        local = [bool(flag) for flag in pattern]
    else:  # hparams.set_swa_pattern(n): layer i is local unless i % n == n - 1
        local = [i % pattern < pattern - 1 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in local]
