"""GGUF files as users bring them, made here by llama.cpp's own converter and quantizer
(tests/gguf_files.py), read by the engine's reader (worker/continuous/gguf_reader.py) and loader.

References are independent of the code under test: gguf's own GGUFReader and numpy dequantizer for
the blocks, gguf-py's tensor name map for the names, the directory's safetensors and config for what
the tensors and config must mean, transformers' GGUF config for the keys it maps, and
transformers' rope functions for the rotary frequencies.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.settings import Settings
from tests.gguf_files import TYPES
from tests.tiny_models import FAMILIES
from worker import gguf_derived
from worker.continuous.gguf_config import UnsupportedGGUF, _check_llama3, _llama3
from worker.continuous.gguf_reader import read_gguf
from worker.continuous.kquants import KQuant
from worker.continuous.weights import QUANTIZED, Q41, Q80, fuse, quantize_q4_1
from worker.model_loader import load

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
         "phi3": "phi3"}  # what llama.cpp's converter writes as general.architecture
_GGUF_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


class _TensorReader(gguf.GGUFReader):
    """gguf's own reader, stepping over the metadata's arrays (the vocabulary, its merges and token
    types: ~150k values it otherwise views one by one, most of its ~8 s a file here) instead of
    keeping them. Its tensor table and data, the reference here, are untouched."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        data = memoryview(self.data)  # one buffer, not one per value
        item_type, count = struct.unpack_from("<IQ", data, orig_offs)
        offs = orig_offs + 12
        if item_type == gguf.GGUFValueType.STRING:
            for _ in range(count):
                offs += 8 + struct.unpack_from("<Q", data, offs)[0]
        else:
            offs += count * np.dtype(self.gguf_scalar_to_np[gguf.GGUFValueType(item_type)]).itemsize
        return offs - orig_offs, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item_type)]


def _reference(path: str) -> dict[str, torch.Tensor]:
    """Each tensor of the file by its GGUF name, dequantized by gguf's numpy reference."""
    return {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            for t in _TensorReader(path).tensors}


def _hf_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' undoing of llama.cpp's q/k permutation (LlamaTensorProcessor), as it writes it."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _dense(t) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QUANTIZED) else t


def _directory_tensors(directory: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# Names depend on the family, decoding on the type, and the two on nothing of each other: every type
# on llama (whose q/k rows are also unpermuted), and on each other family its names through the
# float, the Q8_0 (kept quantized) and the Q4_K_M (mixed types, made dense) file; 22 files, not 42.
_FILE_CASES = [("llama", qtype) for qtype in TYPES] + \
    [(kind, qtype) for kind in FAMILIES if kind != "llama" for qtype in ("F16", "Q8_0", "Q4_K_M")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, qtype", _FILE_CASES)
def test_every_tensor_equals_ggufs_dequantization(family_gguf, family_gguf_source, kind, qtype):
    """Every tensor the reader gives is the file's own tensor as gguf's numpy reference decodes it,
    exactly, after only the documented undoings: llama's q/k row order, Gemma's norm + 1."""
    path = family_gguf(kind, qtype)
    config, tensors = read_gguf(path)
    reference = _reference(path)
    architecture = _ARCH[kind]
    names = gguf.get_tensor_name_map(_GGUF_ARCH[architecture], config.num_hidden_layers)

    # the names are transformers' own: exactly the directory's state_dict
    assert set(tensors) == set(_directory_tensors(family_gguf_source(kind)))
    for name, tensor in tensors.items():
        base, suffix = name.rsplit(".", 1)
        expected = reference[f"{names.get_name(base)}.{suffix}"]
        if architecture == "llama" and ".self_attn.q_proj." in name:
            expected = _hf_rope_rows(expected, config.num_attention_heads)
        elif architecture == "llama" and ".self_attn.k_proj." in name:
            expected = _hf_rope_rows(expected, config.num_key_value_heads)
        elif architecture == "gemma3" and name.endswith("norm.weight"):
            expected = expected - 1
        if qtype == "Q8_0" and expected.ndim == 2:  # the engine's kernels take these blocks as they are
            assert isinstance(tensor, Q80), name
        if qtype == "Q4_0" and expected.ndim == 2 and name.startswith("model.layers."):
            assert isinstance(tensor, Q41), name  # d * (q - 8) as Q4_1's d * q + m, exactly (below)
        dense = _dense(tensor)
        assert dense.dtype == torch.float32 and dense.shape == expected.shape, name
        assert torch.equal(dense, expected.reshape(dense.shape)), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_f16_file_is_the_directorys_model_within_f16_rounding(family_gguf, family_gguf_source, kind):
    """The F16 file read back is the directory's float32 model with its matrices rounded to float16
    (the converter keeps norms and biases float32), and Gemma's norms through the converter's + 1
    and the reader's - 1 in float32: the reader undoes what the converter did, and nothing else."""
    _, tensors = read_gguf(family_gguf(kind, "F16"))
    for name, original in _directory_tensors(family_gguf_source(kind)).items():
        ours = tensors[name]
        if original.ndim == 2:
            expected = original.half().float()
        elif kind == "gemma3" and name.endswith("norm.weight"):
            expected = (original + 1) - 1
        else:
            expected = original
        assert torch.equal(ours, expected), name
    if kind == "llama":  # the unpermuting is not a no-op: the file's rows are in another order
        q = _reference(family_gguf(kind, "F16"))["blk.0.attn_q.weight"]
        assert not torch.equal(q, tensors["model.layers.0.self_attn.q_proj.weight"])


# What the model code needs from the config, beyond the shapes.
_NEEDED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_parameters",
           "eos_token_id", "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping",
           "attention_bias", "hidden_activation", "hidden_act", "original_max_position_embeddings")
# What no GGUF of this family says, lost for llama.cpp too (gguf_config.py's docstring).
_LOST = {"mistral": {"sliding_window"}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_config_is_the_directorys_and_transformers_where_it_maps_the_key(family_gguf, family_gguf_source, kind):
    path = family_gguf(kind, "F16")
    ours, _ = read_gguf(path)
    directory = AutoConfig.from_pretrained(family_gguf_source(kind))
    transformers_gguf = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    differs_from_transformers = set()
    for key in _NEEDED:
        if not hasattr(directory, key) or key in _LOST.get(kind, ()):
            continue
        assert getattr(ours, key) == getattr(directory, key), key
        if getattr(transformers_gguf, key, None) != getattr(ours, key):
            differs_from_transformers.add(key)
    assert ours.rms_norm_eps == pytest.approx(directory.rms_norm_eps, rel=1e-6)  # stored as float32
    assert ours.rms_norm_eps == transformers_gguf.rms_norm_eps
    assert ours.model_type == transformers_gguf.model_type
    # exactly the keys gguf_config.py fills in because transformers' mapping loses them
    assert differs_from_transformers == {
        "llama": {"rope_parameters"}, "mistral": set(), "qwen2": set(), "qwen3": {"head_dim"},
        "gemma3": {"query_pre_attn_scalar"}, "phi3": {"rope_parameters"}}[kind]
    if kind == "mistral":  # arch "llama": llama.cpp has no sliding window for it either
        assert ours.model_type == "llama" and getattr(ours, "sliding_window", None) is None
    if kind == "gemma3":  # llama.cpp's pattern, every 6th layer global, which is Gemma 3's own
        assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert ours.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_config_made_in_a_child_holds_every_value_of_the_family_class(family_gguf, kind, tmp_path):
    """The worker reads a GGUF's config as the child made it (worker/gguf_derived.py: transformers'
    base PreTrainedConfig given the family class's to_dict), not by importing the family class: every
    value is the one read_gguf's family config holds, and the tokenizer kept beside it gives the ids
    transformers' own build from the file gives (the converter wrote each family's pre-tokenizer:
    qwen2's splits blank lines unlike SmolLM2's, whose vocabulary these files borrow)."""
    path = family_gguf(kind, "Q4_K_M")
    family, _ = read_gguf(path)
    derived = gguf_derived.read(path, str(tmp_path))
    assert type(derived.config).__mro__[1] is PreTrainedConfig and not derived.refusal
    ours, theirs = derived.config.to_dict(), family.to_dict()
    del ours["transformers_version"], theirs["transformers_version"]
    assert ours == theirs and len(ours) > 20
    for key in _NEEDED:  # what the model code reads, as attributes: the class's computed ones too
        assert getattr(derived.config, key, None) == getattr(family, key, None), key
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ("Once upon a time, a fox <|im_end|> met 42 owls.", "  two spaces\n\nand ünïcödé 🦊"):
        assert derived.tokenizer(text).input_ids == reference(text).input_ids, text


@pytest.mark.slow
def test_a_workers_start_imports_no_family_config_class_nor_torch_compile(family_gguf, tmp_path):
    """A fresh process that does what a worker's start does (the load for the continuous engine, the
    engine, llguidance's tokenizer) has imported no family config class, nor what they import
    (torch.distributed, dynamo, sympy: the reason for gguf_derived's child), nor llguidance's
    torch.compile function, which imports the same (the C++ kernels mask instead): ~90 MiB held for
    good otherwise (docs/serving.md, "The worker's memory")."""
    path = family_gguf("llama", "Q4_K_M")
    probe = ("import sys; from worker import __main__ as w, model_loader; from shared.settings import Settings; "
             "from worker.constraint import Grammars; "
             f"m = model_loader.load({path!r}, transformers_model=False, cache_dir={str(tmp_path)!r}); "
             f"engine, m = w.make_engine(Settings.parse(['--model', {path!r}], w.FLAGS, ''), m); "
             "Grammars(m.tokenizer, m.vocab_size, lambda digest: None).warm(); "
             "print(type(m.config).__mro__[1].__name__, sorted(k for k in sys.modules if k.startswith('transformers.models.')"
             " and k.rsplit('.', 1)[-1].startswith('configuration_') and 'auto' not in k and 'encoder_decoder' not in k),"
             " [k for k in ('torch.distributed.tensor', 'torch._dynamo', 'sympy') if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split("\n")[-2]
    assert out == "PreTrainedConfig [] []", out


@pytest.mark.parametrize("factor, context", [(8.0, 64), (32.0, 8192), (8.0, 8192)])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(factor, context):
    """Llama 3.1 (8, 8192) and 3.2 (32, 8192): the divisors transformers' own llama3 rotary implies
    give back its parameters, and a vector that is not llama3 scaling is refused."""
    from transformers import LlamaConfig
    params = dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=context)
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    divisors = (plain / ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))[0]).numpy()
    assert _llama3("f.gguf", 500000.0, 64, divisors) == {k: v for k, v in params.items() if k != "rope_theta"}
    _check_llama3("f.gguf", config, divisors)
    with pytest.raises(UnsupportedGGUF, match="f.gguf: its rope_freqs"):
        _check_llama3("f.gguf", config, divisors[::-1].copy())


def test_fuse_keeps_one_quantized_type_stacked_runs_of_types_apart_and_a_float_part_dense():
    a, b = quantize_q4_1(torch.randn(32, 64)), quantize_q4_1(torch.randn(16, 64))
    q80 = Q80(q=torch.randint(-128, 128, (16, 64), dtype=torch.int8), d=torch.rand(16, 2))
    q80b = Q80(q=torch.randint(-128, 128, (32, 64), dtype=torch.int8), d=torch.rand(32, 2))
    dense = torch.randn(16, 64)
    assert isinstance(fuse([a, b]), Q41) and torch.equal(fuse([a, b]).dequantize(),
                                                         torch.cat([a.dequantize(), b.dequantize()]))
    # a Q8_0 file's q/k/v and gate/up stay Q8_0, for the integer kernel, not made dense
    assert isinstance(fuse([q80, q80b]), Q80) and torch.equal(fuse([q80, q80b]).dequantize(),
                                                             torch.cat([q80.dequantize(), q80b.dequantize()]))
    # quantized types side by side: runs of one type each, each for its own kernel (linear.py stacks them)
    runs = fuse([a, b, q80, q80b])
    assert [type(r) for r in runs] == [Q41, Q80] and [r.shape[0] for r in runs] == [48, 48]
    mixed = fuse([a, q80, dense])  # a float part: the whole stack dense
    assert torch.equal(mixed, torch.cat([a.dequantize(), q80.dequantize(), dense]))


@pytest.mark.slow
def test_a_requantized_smollm2_keeps_every_matrix_in_its_blocks(smollm2_gguf, caplog):
    """Q8_0, the K-quant files' Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1, and Q4_0 (as Q4_1): nothing made dense."""
    _, tensors = read_gguf(smollm2_gguf("Q8_0"))
    assert all(isinstance(t, Q80) for t in tensors.values() if len(t.shape) == 2)
    for qtype, kinds in (("Q4_K_M", {"Q4_K": 16, "Q5_0": 166, "Q6_K": 14}),
                         ("Q5_K_M", {"Q5_K": 16, "Q5_1": 166, "Q6_K": 14})):
        with caplog.at_level("WARNING", logger="worker.continuous.gguf_reader"):
            _, tensors = read_gguf(smollm2_gguf(qtype))
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        # llama-quantize's K-quant files of SmolLM2: Q5_0 / Q5_1 where rows of 576 are no multiple of 256
        found = {}
        for t in tensors.values():
            if isinstance(t, KQuant):
                found[t.name] = found.get(t.name, 0) + 1
        assert found == kinds, (qtype, found)
        assert all(isinstance(t, QUANTIZED) for t in tensors.values() if len(t.shape) == 2)
        caplog.clear()
    with caplog.at_level("WARNING", logger="worker.continuous.gguf_reader"):
        _, tensors = read_gguf(smollm2_gguf("Q4_0"))  # Q4_0 is Q4_1 with m = -8 d: nothing made dense
    assert not caplog.records and all(isinstance(t, (Q41, Q80)) for t in tensors.values() if len(t.shape) == 2)


# --- the loader ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_gguf_path_loads_with_the_files_name_tokenizer_and_template(family_gguf, tmp_path):
    path, cache = family_gguf("qwen3", "Q4_K_M"), str(tmp_path / "cache")
    loaded = load(path, dtype="float32", device="cpu", transformers_model=False, cache_dir=cache)
    assert loaded.name == "qwen3.Q4_K_M" and loaded.model is None
    assert loaded.config.model_type == "qwen3" and "model.layers.1.self_attn.k_norm.weight" in loaded.tensors
    text = "Once upon a time, a knight walked to the castle."
    ids = loaded.tokenizer(text)["input_ids"]
    assert loaded.tokenizer.decode(ids) == text and len(ids) < len(text) // 2  # real merges, not bytes
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                  add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert loaded.eos_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}

    # a directory holding exactly one GGUF: the same, named after the file; MODEL_NAME overrides
    os.mkdir(tmp_path / "models")
    os.symlink(path, tmp_path / "models" / "story.gguf")
    again = load(str(tmp_path / "models"), device="cpu", transformers_model=False, cache_dir=cache)
    assert again.name == "story" and again.tokenizer(text)["input_ids"] == ids
    assert len(os.listdir(cache)) == 1  # the tokenizer built once, for the file the link points at
    assert load(str(tmp_path / "models"), name="teller", device="cpu", transformers_model=False,
                cache_dir=cache).name == "teller"


@pytest.mark.slow
def test_the_static_engine_gets_transformers_model_of_a_gguf(family_gguf):
    loaded = load(family_gguf("gemma3", "F16"), dtype="float32", device="cpu", transformers_model=True,
                  cache_dir=Settings().cache_dir)
    assert loaded.model is not None and loaded.name == "gemma3.F16"
    assert loaded.model.config.model_type == "gemma3_text"


# --- bad input: one line, naming the file and what is wrong ------------------------------------------

def _tiny_llama(path, architecture="llama", tokenizer="gpt2", extra=None, q8_row=None):
    """A minimal GGUF file written with gguf's writer: 1 layer of a llama, F32."""
    writer = gguf.GGUFWriter(str(path), architecture)
    hidden, ff, vocab = 32, 64, 8
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", ff), ("attention.head_count", 2), ("attention.head_count_kv", 1)):
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (16, hidden),
              "blk.0.attn_v.weight": (16, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
              "blk.0.ffn_down.weight": (hidden, ff), **(extra or {})}
    for name, shape in shapes.items():
        if name == q8_row:  # one Q8_0 block a row, for now
            writer.add_tensor(name, np.zeros((shape[0], 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if q8_row:  # gguf's writer refuses to write it: rows of 40 weights, which Q8_0's blocks of 32 do not divide
        data = bytearray(open(path, "rb").read())
        name = q8_row.encode()
        at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4  # past the name and dim count
        assert int.from_bytes(data[at:at + 8], "little") == 32
        data[at:at + 8] = (40).to_bytes(8, "little")
        open(path, "wb").write(bytes(data))
    return str(path)


def _refused(path: str) -> str:
    """load()'s one line for `path`."""
    with pytest.raises(SystemExit) as stopped:
        load(path, device="cpu", transformers_model=False)
    message = str(stopped.value.code)
    assert "\n" not in message and path in message, message
    return message


def test_a_valid_minimal_file_loads_so_the_refusals_below_are_about_their_one_fault(tmp_path):
    config, tensors = read_gguf(_tiny_llama(tmp_path / "ok.gguf"))
    assert config.num_hidden_layers == 1 and len(tensors) == 11


def test_an_unknown_architecture_is_refused_naming_it_and_whether_the_static_engine_may_run_it(tmp_path):
    message = _refused(_tiny_llama(tmp_path / "falcon.gguf", architecture="falcon"))
    assert "architecture 'falcon'" in message and "`--engine static` may run it" in message
    message = _refused(_tiny_llama(tmp_path / "odd.gguf", architecture="madeup"))
    assert "architecture 'madeup'" in message and "nor does transformers" in message


def test_a_tensor_layout_the_blocks_do_not_divide_is_refused(tmp_path):
    message = _refused(_tiny_llama(tmp_path / "rows.gguf", q8_row="blk.0.ffn_down.weight"))
    assert "'blk.0.ffn_down.weight'" in message and "Q8_0" in message and "do not divide" in message


def test_a_tensor_with_no_counterpart_is_refused_not_dropped(tmp_path):
    message = _refused(_tiny_llama(tmp_path / "extra.gguf", extra={"blk.0.mystery.weight": (4,)}))
    assert "'blk.0.mystery.weight' has no Hugging Face llama counterpart" in message


@pytest.mark.parametrize("cut", [0.5, 0.001])  # in the tensors; in the header
def test_a_truncated_file_is_refused(tmp_path, cut):
    whole = _tiny_llama(tmp_path / "whole.gguf")
    data = open(whole, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * cut)])
    message = _refused(str(path))
    assert "truncated" in message or "not a readable GGUF file" in message


def test_a_corrupt_file_is_refused(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert "not a readable GGUF file" in _refused(str(path))
    path = tmp_path / "zeros.gguf"
    path.write_bytes(bytes(4096))
    assert "not a readable GGUF file" in _refused(str(path))


def test_a_tokenizer_that_cannot_be_built_is_refused(tmp_path):
    message = _refused(_tiny_llama(tmp_path / "vocab.gguf", tokenizer="nonsense"))
    assert "cannot build its tokenizer" in message and "nonsense" in message


def test_paths_that_are_not_a_model_are_refused(tmp_path):
    assert "no such file or directory" in _refused(str(tmp_path / "absent.gguf"))
    assert "neither a config.json nor a .gguf" in _refused(str(tmp_path))
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(_tiny_llama(tmp_path / "one.gguf"), tmp_path / name)
    os.remove(tmp_path / "one.gguf")
    assert "a directory of 2 GGUF files (a.gguf, b.gguf)" in _refused(str(tmp_path))


def test_a_worker_given_a_bad_file_stops_at_start_with_one_line_and_leaves_nothing_in_redis(
        tmp_path, real_redis, redis_server):
    from tests.processes import start
    whole = open(_tiny_llama(tmp_path / "whole.gguf"), "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:len(whole) // 2])
    worker = start(["worker", "--model", str(path)], tmp_path, "worker", REDIS_URL=redis_server.url)
    assert worker.wait(120) == 1
    lines = (tmp_path / "worker.err").read_text().strip().splitlines()
    assert lines[-1].startswith(f"{path}: truncated: tensor "), lines[-3:]
    assert not any("Traceback" in line for line in lines)
    assert real_redis.keys("*") == []  # no heartbeat, no queue, no tokenizer: nothing half-started


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_f16_files_greedy_text_is_the_directorys(family_gguf, family_gguf_source, kind, kernel):
    """On the continuous engine (float32, the C++ decoder), the F16 file writes what its directory
    writes, greedy, for prompts of several lengths together. Every prompt and its reply stay inside
    the tiny models' sliding windows (mistral's 24, gemma3's 16): the converter writes Mistral
    without its window (_LOST), as llama.cpp runs it."""
    from shared.protocol import Job, SamplingParams
    from tests.engines import write
    from worker.continuous import engine as continuous

    written = []
    for source in (family_gguf_source(kind), family_gguf(kind, "F16")):
        loaded = load(source, dtype="float32", device="cpu", transformers_model=False, cache_dir=Settings().cache_dir)
        engine = continuous.build(loaded, Settings(block_size=4, prefill_chunk=8), loaded.weights(), loaded.config)
        assert engine is not None and engine.numerics.endswith("+invariant"), source
        prompts = ["Once upon a time", "The dragon slept in the forest, dreaming of gold", "A knight"]
        jobs = [Job(id=f"j{i}", model=loaded.name, prompt_ids=loaded.tokenizer(p, add_special_tokens=False).input_ids,
                    params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), timeout_s=60)
                for i, p in enumerate(prompts)]
        assert max(len(j.prompt_ids) for j in jobs) + 5 <= 16
        written.append([seq.output_ids for seq in write(engine, jobs)])
    assert written[0] == written[1] and all(len(ids) == 5 for ids in written[0])
