"""worker/continuous/weights.py, the Q4_1 and Q8_0 forms the engine keeps, read from the packaged
SmolLM2 file by worker/continuous/gguf_reader.py (the other families and types: test_gguf_files.py).

References are independent of the code under test: gguf's own reader and numpy dequantizer for the
blocks, transformers' GGUF loader for names, row order and config, and x @ W.T for the int4 kernel.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from worker.continuous.weights import Q41, Q80, _unpack_q4_1, read_gguf
from worker.model_loader import PACKAGED_FILE, packaged_model_dir

Q4_1 = gguf.GGMLQuantizationType.Q4_1
BF16_HALF_ULP = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding moves a value by <= 2^-8 of it


def _random_q41(rows: int, cols: int, seed: int = 0) -> Q41:
    g = torch.Generator().manual_seed(seed)
    # scales and minimums like a real layer's: d > 0 and small, m about -8 d, both float16 values
    d = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 0.001).half().float()
    m = (-8 * d * (0.5 + torch.rand(rows, cols // 32, generator=g))).half().float()
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g)
    return Q41(q=q, d=d, m=m)


def _reference_dequantize(w: Q41) -> torch.Tensor:
    """d * q + m written out the long way, one scale per 32 columns."""
    return w.q.float() * w.d.repeat_interleave(32, dim=1) + w.m.repeat_interleave(32, dim=1)


# --- Q41 on its own: no file needed ---------------------------------------------------------------

def test_unpack_follows_the_q4_1_block_layout():
    # One block by hand: d = 0.5, m = -1, byte i holds weight i in its low nibble and 16 + i in its high.
    low, high = np.arange(16, dtype=np.uint8), (15 - np.arange(16)).astype(np.uint8)
    block = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8), low | (high << 4)])
    w = _unpack_q4_1(block.reshape(1, 20), 1, 32)
    assert w.q.dtype == torch.uint8 and w.d.dtype == torch.float32 and w.shape == (1, 32)
    assert w.q[0].tolist() == low.tolist() + high.tolist()
    assert w.dequantize()[0].tolist() == [0.5 * q - 1 for q in low.tolist() + high.tolist()]


def test_synthetic_q41_cat_rows_and_dequantize_agree_with_float_matrices():
    a, b = _random_q41(48, 96, seed=1), _random_q41(16, 96, seed=2)
    dense_a, dense_b = _reference_dequantize(a), _reference_dequantize(b)
    assert torch.equal(a.dequantize(), dense_a)
    assert a.shape == (48, 96)

    fused = Q41.cat([a, b])
    assert fused.shape == (64, 96)
    assert torch.equal(fused.dequantize(), torch.cat([dense_a, dense_b]))

    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fused.rows(order).dequantize(), torch.cat([dense_a, dense_b])[order])
    assert torch.equal(fused.rows(torch.tensor([5, 50])).dequantize(), torch.cat([dense_a, dense_b])[[5, 50]])


def test_int4_kernel_in_float32_computes_exactly_q4_1():
    # In float32 nothing is rounded to a narrower type, so this pins the scale/zero formula: an error of
    # one d in the zero (m + 7 d, say) would be thousands of times the tolerance.
    w = _random_q41(64, 96, seed=4)
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(5))
    reference = x @ w.dequantize().T
    tolerance = 1e-5 * (x.abs() @ w.dequantize().abs().T)

    packed, scales_and_zeros = w.pack_int4(torch.float32)
    assert scales_and_zeros.shape == (96 // 32, 64, 2) and scales_and_zeros.dtype == torch.float32
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    assert ((out - reference).abs() <= tolerance).all()

    # the same check catches a zero without llama.cpp's offset of 8: the test can fail
    wrong = scales_and_zeros.clone()
    wrong[..., 1] = w.m.T
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, wrong)
    assert not ((out - reference).abs() <= tolerance).all()


# --- the packaged SmolLM2 file ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_path() -> str:
    return os.path.join(packaged_model_dir(), PACKAGED_FILE)


@pytest.fixture(scope="module")
def gguf_tensors(gguf_path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}


@pytest.fixture(scope="module")
def ours(gguf_path):
    return read_gguf(gguf_path)


def _hf_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' undoing of llama.cpp's q/k permutation (LlamaTensorProcessor), as it writes it."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.slow
def test_q4_1_unpacking_equals_gguf_dequantize(gguf_tensors, ours):
    config, tensors = ours
    raw = gguf_tensors["blk.0.ffn_down.weight"]
    assert raw.tensor_type == Q4_1
    reference = torch.from_numpy(gguf.quants.dequantize(raw.data, Q4_1))
    rows, cols = reference.shape

    unpacked = _unpack_q4_1(np.asarray(raw.data), rows, cols)  # straight from gguf's own view of the bytes
    assert unpacked.q.max() <= 15 and unpacked.d.shape == (rows, cols // 32)
    assert torch.equal(unpacked.dequantize(), reference)
    assert torch.equal(tensors["model.layers.0.mlp.down_proj.weight"].dequantize(), reference)
    # Packed again for the C++ kernel: exactly the file's nibble bytes (each 20-byte block: d, m, 16)
    file_nibbles = np.asarray(raw.data).reshape(rows, cols // 32, 20)[..., 4:].reshape(rows, cols // 2)
    assert torch.equal(unpacked.nibbles(), torch.from_numpy(np.ascontiguousarray(file_nibbles)))

    # q and k: read_gguf returns them in Hugging Face's row order, still exactly the file's values
    for gguf_name, hf_name, heads in (
            ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight", config.num_attention_heads),
            ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", config.num_key_value_heads)):
        in_file_order = gguf.quants.dequantize(gguf_tensors[gguf_name].data, Q4_1)
        reference = torch.from_numpy(_hf_rope_rows(in_file_order, heads))
        assert not torch.equal(reference, torch.from_numpy(in_file_order))  # the permutation is not a no-op
        assert torch.equal(tensors[hf_name].dequantize(), reference)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 8])
def test_int4_kernel_matches_dequantized_matmul_in_bf16(ours, rows):
    _, tensors = ours
    layer = "model.layers.3."
    fused_qkv = Q41.cat([tensors[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"])  # 960 rows
    for w in (fused_qkv, tensors[layer + "mlp.down_proj.weight"]):
        n, k = w.shape
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        packed, scales_and_zeros = w.pack_int4(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros).float()
        assert out.shape == (rows, n) and out.dtype == torch.float32
        xf = x.float()

        # Exactly what the kernel is meant to compute: (q - 8) * scale + zero with the bf16 scales,
        # summed in float32, rounded once to bf16 on the way out.
        scale = scales_and_zeros[..., 0].float().T.repeat_interleave(32, dim=1)
        zero = scales_and_zeros[..., 1].float().T.repeat_interleave(32, dim=1)
        kernel_weight = (w.q.float() - 8) * scale + zero
        reference = xf @ kernel_weight.T
        summing = 1e-5 * (xf.abs() @ kernel_weight.abs().T)  # float32 summation in another order
        assert ((out - reference).abs() <= BF16_HALF_ULP * reference.abs() + summing).all()

        # Against the file's exact weights: rounding d and m + 8 d to bf16 moves each weight by at most
        # half an ulp of each term, 2^-9 (|q - 8| d + |m + 8 d|), on top of the output's rounding.
        exact = xf @ w.dequantize().T
        d = w.d.repeat_interleave(32, dim=1)
        zero_exact = (w.m + 8 * w.d).repeat_interleave(32, dim=1)
        weight_error = 2.0 ** -9 * ((w.q.float() - 8).abs() * d + zero_exact.abs())
        bound = BF16_HALF_ULP * exact.abs() + xf.abs() @ weight_error.T + summing
        assert ((out - exact).abs() <= bound).all()


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 8, 11])  # 11: more rows than the kernel does at once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_kernel_matches_the_files_exact_weights(ours, kernel, rows, dtype):
    """The C++ kernel (csrc/quantized.h) on the file's Q4_1 layers and Q8_0 head, against a float64
    product with the exactly dequantized weights: only float32 summation order (and, in bf16, the
    input's and output's rounding) may differ."""
    _, tensors = ours
    layer = "model.layers.3."
    fused_qkv = Q41.cat([tensors[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    head = tensors["model.embed_tokens.weight"]
    down = tensors[layer + "mlp.down_proj.weight"]
    # Q4_1 as the file packs it (two weights a byte) and a byte per weight; Q8_0 a byte per weight.
    for w, q in ((fused_qkv, fused_qkv.nibbles()), (down, down.nibbles()), (down, down.q), (head, head.q)):
        n, k = w.shape
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = kernel.quantized_linear(x, q, w.d, w.m)
        assert out.shape == (rows, n) and out.dtype == dtype
        exact = x.double() @ w.dequantize().double().T
        summing = 1e-5 * (x.double().abs() @ w.dequantize().double().abs().T)
        rounding = BF16_HALF_ULP * exact.abs() if dtype == torch.bfloat16 else 0
        assert ((out.double() - exact).abs() <= summing + rounding).all()


def _head_rows(head: Q80, count: int) -> Q80:
    return Q80(q=head.q[:count].contiguous(), d=head.d[:count].contiguous())


def _rounded_per_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as csrc/int8.h rounds it, to 8 bits per group of 32: q = round(x * (127 / max|x|)) and
    scale max|x| / 127, in float32 as the kernel computes them; returned as q * scale in float64,
    with the step each value may also have taken: the scale where x * 127 / max|x| lies within
    1e-3 of half-way between two integers (common in bf16), which float32's last bit decides, else 0."""
    rows, k = x.shape
    groups = x.float().view(rows, k // 32, 32)
    top = groups.abs().amax(-1, keepdim=True)
    scaled = groups * torch.where(top > 0, 127 / top, 0)
    scale = (top / 127).double().expand(-1, -1, 32)
    near_half = ((scaled - scaled.floor() - 0.5).abs() < 1e-3)
    return ((scaled.round().double() * scale).view(rows, k),
            torch.where(near_half, scale, 0).reshape(rows, k))


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 8, 11])  # 11: more rows than the kernel does at once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_is_the_files_weights_times_activations_rounded_per_group(ours, kernel, rows, dtype):
    """The integer kernel (csrc/int8.h) on the file's Q4_1 layers and Q8_0 head, and on shapes whose
    last chunk is partial, against a float64 product of the exactly dequantized weights with the
    activations rounded as the kernel rounds them (the whole weight, Q4_1's minimum too, meets the
    rounded x, as llama.cpp's Q8_1 has it).
    Only float32 summation (and bf16's rounding of input and output) may differ; and the rounding
    of x keeps the result within half a step of each group's scale of the exact product."""
    if not hasattr(kernel, "int8_linear"):
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: the kernels' integer product (csrc/int8.h) "
                    "is not built, and is not checked")
    _, tensors = ours
    layer = "model.layers.3."
    cases = [Q41.cat([tensors[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]),  # 18 groups: 4 chunks + 2
             tensors[layer + "mlp.down_proj.weight"], _head_rows(tensors["model.embed_tokens.weight"], 4096),
             _random_q41(40, 96, seed=1), _random_q41(24, 608, seed=2)]  # 3 groups; 19 groups
    g = torch.Generator().manual_seed(3)
    cases.append(Q80(q=torch.randint(-128, 128, (24, 608), dtype=torch.int8, generator=g),  # 19: 9 chunks + 1
                     d=(torch.rand(24, 19, generator=g) * 0.01).half().float()))
    for w in cases:
        n, k = w.shape
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
        out = kernel.int8_linear(x, w.int8_packed(), isinstance(w, Q41))
        assert out.shape == (rows, n) and out.dtype == dtype
        weights = w.dequantize().double()
        rounded, either_way = _rounded_per_group(x)
        expected = rounded @ weights.T
        scaled = weights  # what meets the rounded x: the whole weight
        summing = 1e-5 * (rounded.abs() @ scaled.abs().T) + either_way @ scaled.abs().T
        rounding = BF16_HALF_ULP * expected.abs() if dtype == torch.bfloat16 else 0
        assert ((out.double() - expected).abs() <= summing + rounding).all()
        exact = x.double() @ weights.T
        step = (x.double().view(rows, k // 32, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
        assert ((out.double() - exact).abs() <= (step / 2) @ weights.abs().T + summing + rounding).all()


def test_int8_packing_keeps_the_files_bytes_chunk_by_chunk():
    """Q4_1: per chunk of 4 groups, 64 bytes of nibbles, 4 float16 scales, 4 minimums; Q8_0: per
    chunk of 2 groups, 64 weights and 2 scales; a row's last chunk holds what is left."""
    w = _random_q41(3, 32 * 6)  # 6 groups: a chunk of 4, then one of 2
    packed = w.int8_packed()
    assert packed.shape == (3, 6 * 20) and packed.dtype == torch.uint8
    nib, halves = w.nibbles(), lambda v: v.half().view(torch.uint8)
    assert torch.equal(packed[:, :64], nib[:, :64])
    assert torch.equal(packed[:, 64:72], halves(w.d[:, :4])) and torch.equal(packed[:, 72:80], halves(w.m[:, :4]))
    assert torch.equal(packed[:, 80:112], nib[:, 64:96])
    assert torch.equal(packed[:, 112:116], halves(w.d[:, 4:])) and torch.equal(packed[:, 116:120], halves(w.m[:, 4:]))
    q = Q80(q=torch.arange(-96, 96, dtype=torch.int8).repeat(2, 1), d=torch.rand(2, 6).half().float())
    packed = q.int8_packed()
    assert packed.shape == (2, 6 * 34)
    for chunk in range(3):
        at = chunk * 68
        assert torch.equal(packed[:, at:at + 64], q.q[:, chunk * 64:(chunk + 1) * 64].view(torch.uint8))
        assert torch.equal(packed[:, at + 64:at + 68], halves(q.d[:, chunk * 2:chunk * 2 + 2]))


@pytest.fixture(scope="module")
def transformers_model():
    # transformers' own GGUF path: gguf's numpy dequantizer and its own q/k un-permutation (~17 s)
    model = AutoModelForCausalLM.from_pretrained(packaged_model_dir(), gguf_file=PACKAGED_FILE, dtype=torch.float32)
    return model.eval()


@pytest.mark.slow
def test_state_dict_equals_transformers_gguf_load(ours, transformers_model):
    config, tensors = ours
    expected = transformers_model.state_dict()

    assert config.tie_word_embeddings
    assert "lm_head.weight" not in tensors  # tied: the file has no output tensor, nor do we
    assert set(tensors) == set(expected) - {"lm_head.weight"}
    assert sum(isinstance(t, Q41) for t in tensors.values()) == 7 * config.num_hidden_layers
    assert isinstance(tensors["model.embed_tokens.weight"], Q80)  # the head's blocks, kept for small steps

    for name, tensor in tensors.items():
        if isinstance(tensor, (Q41, Q80)):
            tensor = tensor.dequantize()
        assert tensor.dtype == torch.float32, name
        # The same float32 operations as gguf's dequantizer, so the values are identical, not close.
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.slow
def test_config_equals_transformers_gguf_config(ours, transformers_model):
    config, _ = ours
    expected = transformers_model.config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
                  "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.num_key_value_heads == 3

    # and nothing else differs: the model's config only adds how and from where it was loaded
    ignored = {"_name_or_path", "dtype", "quantization_config"}
    ours_dict = {k: v for k, v in config.to_dict().items() if k not in ignored}
    expected_dict = {k: v for k, v in expected.to_dict().items() if k not in ignored}
    assert ours_dict == expected_dict


def test_a_small_kernel_this_process_cannot_run_is_refused_with_the_reason(kernel):
    from worker.__main__ import check
    from worker.continuous.linear import check_small_kernel
    from shared.settings import Settings
    with pytest.raises(SystemExit, match="--small-kernel 'fast'"):
        check(Settings(small_kernel="fast"))
    with pytest.raises(ValueError, match="not built"):
        check_small_kernel("int8", None)
    with pytest.raises(ValueError, match="not built"):
        check_small_kernel("bytes", None)
    check_small_kernel("dense", None)
    check_small_kernel("auto", None)
    check_small_kernel("bytes", kernel)
    if hasattr(kernel, "int8_linear"):
        check_small_kernel("int8", kernel)
    else:
        with pytest.raises(ValueError, match="AVX-512 VNNI nor AVX2"):
            check_small_kernel("int8", kernel)


class _Kernels:
    """A stand-in for the C++ module with the given products."""

    def __init__(self, *names: str):
        for name in names:
            setattr(self, name, lambda *args: None)


def test_the_quantized_kernel_is_chosen_by_what_the_cpu_has_never_by_a_timing():
    from worker.continuous.linear import EVERY_STEP, Linear, pick_kernel
    from worker.continuous.weights import quantize_q4_1
    vnni, avx2, plain = _Kernels("panel_linear", "int8_linear", "quantized_linear"), \
        _Kernels("int8_linear", "quantized_linear"), _Kernels("quantized_linear")
    assert [pick_kernel("auto", k) for k in (vnni, avx2, plain, None)] == ["int8", "int8", "bytes", None]
    assert pick_kernel("dense", vnni) is None and pick_kernel("int4", vnni) == "int4"
    w, cpu = quantize_q4_1(torch.randn(32, 64)), torch.device("cpu")
    for kernels, rows, small, path, invariant in [
            (vnni, EVERY_STEP, "auto", "int8-vnni-panels", True), (avx2, EVERY_STEP, "auto", "int8-avx2", True),
            (vnni, 64, "auto", "int8-vnni-panels-to-64-rows+dense", False), (vnni, 0, "auto", "dense", False),
            (vnni, EVERY_STEP, "dense", "dense", False), (None, EVERY_STEP, "auto", "dense", False)]:
        layer = Linear(w, None, torch.float32, cpu, rows, kernels, small=small)
        assert (layer.path, layer.invariant) == (path, invariant), (rows, small)


def test_a_quantized_layer_run_at_every_step_keeps_no_dense_copy(kernel):
    from worker.continuous.linear import EVERY_STEP, Linear
    from worker.continuous.weights import quantize_q4_1
    w = quantize_q4_1(torch.randn(64, 96))
    every = Linear(w, None, torch.float32, torch.device("cpu"), EVERY_STEP, kernel)
    bounded = Linear(w, None, torch.float32, torch.device("cpu"), 8, kernel)
    assert every.weight is None and bounded.weight is not None
    x = torch.randn(300, 96)
    exact = x @ w.dequantize().T
    assert torch.equal(bounded(x), F.linear(x, w.dequantize()))  # past 8 rows: the dense product
    assert (every(x) - exact).abs().max() < 0.02 * exact.abs().max()  # the activations' 8-bit rounding
