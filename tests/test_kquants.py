"""The K-quant kernels (csrc/kquants.h, worker/continuous/kquants.py) on tensors of files llama.cpp's
quantizer made: the packaged SmolLM2 requantized to Q4_K_M (Q4_K, Q6_K, Q5_0 tensors) and Q5_K_M
(Q5_K, Q5_1).

For each type: the unpacked integers and scales are the file's weights bit for bit (gguf's
dequantization), the packing costs at most a few percent more bytes than the file, the product
equals the float product of the weights with the rounded activations to float32's rounding and the
float reference within the activations' rounding, one row's bits are the same at every step size
and place, and all of it on the AVX2 build too (--kernel-isa avx2, built on this machine), whose
bits equal the native build's (on a CPU without AVX-512 the native build is the AVX2 build, and
runs once: kernels.distinct_isas).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from bench.activation_grouping import per, shared
from shared.settings import Settings
from worker.continuous import kernels
from worker.continuous.gguf_reader import _read_header
from worker.continuous.kquants import CODES, KQuant
from worker.continuous.linear import EVERY_STEP, Linear
from worker.continuous.weights import Q80, fuse

pytestmark = pytest.mark.slow

TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q5_1")
FILE_OF = {"Q4_K": "Q4_K_M", "Q6_K": "Q4_K_M", "Q5_0": "Q4_K_M", "Q5_K": "Q5_K_M", "Q5_1": "Q5_K_M"}
ISAS = kernels.distinct_isas()  # both builds where this CPU has AVX-512; on AVX2 alone the native one is the AVX2 build


@pytest.fixture(scope="module")
def tensors(smollm2_gguf):
    """type name -> (the first KQuant of that type in its file, the file's Q8_0 attn_v of a layer
    beside a Q5_0 attn_q, or None)."""
    found = {}
    for qtype in sorted(set(FILE_OF.values())):
        blob, _, entries = _read_header(smollm2_gguf(qtype))
        for e in entries:
            kind = next((t.name for t in CODES if int(t) == e.ggml_type), None)
            if kind in TYPES and kind not in found and len(e.shape) == 2:
                found[kind] = KQuant(blob[e.start:e.start + e.nbytes].reshape(e.shape[0], -1), e.ggml_type, tuple(e.shape))
    assert set(found) == set(TYPES), sorted(found)
    return found


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    module = kernels.build(os.path.join(os.path.expanduser(Settings().cache_dir), "kernels"), request.param)
    assert module is not None and hasattr(module, "kquant_linear"), f"the {request.param} kernels did not build"
    return module


@pytest.mark.parametrize("kind", TYPES)
def test_the_unpacked_blocks_are_the_files_weights_in_as_many_bytes(tensors, kind):
    w = tensors[kind]
    assert torch.equal(w.weights(), w.dequantize())  # S u - M, exactly gguf's reference
    packed = w.panel_packed()
    assert w.raw.nbytes <= packed.numel() <= 1.03 * w.raw.nbytes, (packed.numel(), w.raw.nbytes)


@pytest.mark.parametrize("kind", TYPES)
def test_rows_read_from_the_panels_are_the_files_rows(tensors, kernel, kind):
    """A tied head's panels serve as the embedding table (decoder.HeadRows): rows looked up in them
    are gguf's dequantized rows bit for bit, any rows, any order, repeated."""
    w = tensors[kind]
    packed, rows = w.panel_packed(), w.dequantize()
    ids = torch.tensor([0, w.shape[0] - 1, 17, 17, 5, w.shape[0] // 2])
    assert torch.equal(kernel.kquant_rows(packed, w.code, w.shape[1], ids), rows[ids])
    assert kernel.kquant_rows(packed, w.code, w.shape[1], ids[:0]).shape == (0, w.shape[1])
    with pytest.raises(RuntimeError, match="out of"):
        kernel.kquant_rows(packed, w.code, w.shape[1], torch.tensor([w.shape[0]]))


def test_a_tied_k_quant_head_is_also_the_embedding_table(family_gguf):
    """A model whose head is its embedding (SmolLM2-1.7B, Qwen2.5-1.5B) and whose table is a K-quant
    holds the table once, as the head's panels, and looks the step's rows up in them: the file's
    rows, bit for bit."""
    from worker.continuous import models
    from worker.continuous.config import EngineConfig
    from worker.continuous.gguf_reader import read_gguf
    from worker.continuous.models.decoder import HeadRows
    config, tensors = read_gguf(family_gguf("llama", "Q6_K"))  # the tiny llama: its table is Q6_K
    table = tensors["model.embed_tokens.weight"]
    assert isinstance(table, KQuant) and table.name == "Q6_K"
    del tensors["lm_head.weight"]  # tied, as the file would be without its own head
    config.tie_word_embeddings = True
    module = kernels.build(os.path.join(os.path.expanduser(Settings().cache_dir), "kernels"))
    model = models.build(config, tensors, torch.bfloat16, torch.device("cpu"),
                         EngineConfig.from_settings(Settings()), module)
    assert isinstance(model.embed_rows, HeadRows) and model.embed is None
    ids = torch.tensor([3, 49151, 3, 1000])
    assert torch.equal(model.embed_rows.dequantize_rows(ids), table.dequantize()[ids])


@pytest.mark.parametrize("kind", TYPES)
def test_the_product_is_the_float_one_of_the_rounded_activations(tensors, kernel, kind):
    """Against float64 products of the file's weights: with x rounded as the kernel rounds it (per 32:
    a K-quant's steps halved from the row's, bench.activation_grouping's "pow2row", Q5_0's and Q5_1's
    a float step each, its "per32"; this holds both to the kernel's), equal but for float32's
    rounding; with x itself, within that rounding."""
    w = tensors[kind]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, w.shape[1], generator=g)
    y = kernel.kquant_linear(x, w.panel_packed(), w.code).double()
    ref = w.dequantize().double()
    rounded = shared(x, None) if kind.endswith("_K") else per(x, 32)
    exact = rounded.double() @ ref.T
    assert ((y - exact).norm() / exact.norm()).item() < 1e-5
    float_ref = x.double() @ ref.T
    assert ((y - float_ref).norm() / float_ref.norm()).item() < 0.01


@pytest.mark.parametrize("kind", TYPES)
def test_one_rows_product_has_the_same_bits_at_every_step_size_and_place(tensors, kernel, kind):
    """As the model holds it (bf16 activations, a Linear at every step), 1-512 rows: a few rows
    read the panels straight, more meet them two panels at a time; the weight's first 48 rows too,
    whose third panel has no pair."""
    w = tensors[kind]
    odd = KQuant(w.raw[:48], w.ggml_type, (48, w.shape[1]))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, w.shape[1], generator=g).bfloat16()
    for weight in (w, odd):
        layer = Linear(weight, None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel)
        assert layer.invariant and layer.path.endswith("-kquants"), layer.path
        each = torch.cat([layer(x[i:i + 1]) for i in range(512)])  # every row alone
        for size in list(range(1, 20)) + [31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 300, 511, 512]:
            for start in (0, 512 - size, (512 - size) // 2):  # the same rows at other places in the step
                assert torch.equal(layer(x[start:start + size]), each[start:start + size]), (weight.shape, size, start)


def test_the_avx2_build_writes_the_native_builds_bits(tensors):
    """The same integer sums and float operations in the same order on either instruction set: a
    K-quant layer's bits do not depend on whether the CPU has AVX-512."""
    cache = os.path.join(os.path.expanduser(Settings().cache_dir), "kernels")
    native, avx2 = kernels.build(cache), kernels.build(cache, "avx2")
    assert "int8-avx2-kquants" in avx2.PATHS and "int8-vnni-panels" not in avx2.PATHS, sorted(avx2.PATHS)
    g = torch.Generator().manual_seed(3)
    for kind in TYPES:
        w = tensors[kind]
        packed = w.panel_packed()
        x = torch.randn(37, w.shape[1], generator=g).bfloat16()
        assert torch.equal(native.kquant_linear(x, packed, w.code), avx2.kquant_linear(x, packed, w.code)), kind


def _same_bits_on_and_off(switch, module, tensors, sizes, seed):
    """Each type's product at each size with a kernel `switch` (kquant_tiles, kquant_columns,
    kquant_few_rows_fetch) on equals it with the switch off; the switch is left as it was."""
    g = torch.Generator().manual_seed(seed)
    before = switch()
    try:
        for kind in TYPES:
            w = tensors[kind]
            packed = w.panel_packed()
            x = torch.randn(max(sizes), w.shape[1], generator=g).bfloat16()
            for size in sizes:
                assert switch(True)
                on = module.kquant_linear(x[:size], packed, w.code)
                switch(False)
                assert torch.equal(on, module.kquant_linear(x[:size], packed, w.code)), (kind, size)
    finally:
        switch(before)


def test_a_few_rows_prefetches_write_the_same_bits(tensors, kernel):
    """A pass of 1-4 rows asks for its weights further ahead where that pays, by default on every
    CPU but a Zen 4 (AMD family 19h with AVX-512: kquants.h's FewRowsFetch): prefetches only, so
    every type's product writes the same bits with them on and off, on either build: a lone row, a
    few, and steps whose last rows are met apart (9 and 17 rows)."""
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    zen4 = "AuthenticAMD" in cpuinfo and re.search(r"^cpu family\s*:\s*25$", cpuinfo, re.M) and " avx512f" in cpuinfo
    pays = not zen4
    assert kernel.kquant_few_rows_fetch() is pays
    _same_bits_on_and_off(kernel.kquant_few_rows_fetch, kernel, tensors, (1, 2, 3, 4, 6, 9, 17), seed=8)
    assert kernel.kquant_few_rows_fetch() is pays


def test_the_amx_tiles_write_the_vnni_kernels_bits(tensors):
    """A step of 32 rows or more whose rows fill the 16-row tiles to within a sixteenth takes AMX
    tiles where the CPU and Linux have them (kquants_amx.h), and a step they would pad more keeps
    the VNNI kernel: the same integer sums and float operations, so the same bits as the VNNI
    kernel, at every size and for every type (Q6_K keeps the VNNI kernel). Where there are no
    tiles, the switch stays off."""
    native = kernels.build(os.path.join(os.path.expanduser(Settings().cache_dir), "kernels"))
    if "amx_int8" not in kernels.cpu_flags().split():
        assert native.kquant_tiles(True) is False  # nothing to turn on: every step on the VNNI kernel
        return
    assert native.kquant_tiles(), "this CPU lists AMX, and the kernels did not take the tiles"
    sizes = (32, 47, 48, 64, 257, 300)
    assert all(native.kquant_tiles(rows=size) for size in sizes)
    assert not any(native.kquant_tiles(rows=size) for size in (1, 16, 31, 33, 44, 56, 72, 100))
    _same_bits_on_and_off(native.kquant_tiles, native, tensors, sizes, seed=5)


def test_the_avx2_columns_write_the_kernels_bits(tensors):
    """On AVX2 a step of 8-32 rows takes the kernel of 8 rows a vector (kquants_avx2.h), its rows
    past the last whole 8 kquants.h's tiles: the same integer sums and float operations, so the same
    bits with it on and off, for every type. The AVX-512 build has no such kernel."""
    cache = os.path.join(os.path.expanduser(Settings().cache_dir), "kernels")
    avx2 = kernels.build(cache, "avx2")
    if "avx512f" in kernels.cpu_flags().split():
        assert kernels.build(cache).kquant_columns(True) is False
    sizes = (8, 9, 15, 16, 17, 24, 31, 32)
    assert avx2.kquant_columns() and all(avx2.kquant_columns(rows=size) for size in sizes)
    assert not any(avx2.kquant_columns(rows=size) for size in (1, 4, 7, 33, 64, 512))
    _same_bits_on_and_off(avx2.kquant_columns, avx2, tensors, sizes, seed=7)


def test_a_stack_of_types_is_its_parts_side_by_side(tensors, kernel):
    """A fused projection whose parts the file stores in different types (Q4_K_M's Q5_0 queries beside
    Q8_0 values): each part on its own kernel, in Python and in the decoder's C++ Linear alike."""
    q = tensors["Q5_0"]
    rows, cols = q.shape
    g = torch.Generator().manual_seed(4)
    v = Q80(q=torch.randint(-128, 128, (64, cols), dtype=torch.int8, generator=g),
            d=torch.rand(64, cols // 32, generator=g).half().float() / 50)
    stacked = fuse([q, q, v])
    assert isinstance(stacked, list) and len(stacked) == 2 and stacked[0].shape == (2 * rows, cols)
    layer = Linear(stacked, None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel)
    parts = [Linear(p, None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel) for p in (q, q, v)]
    assert layer.invariant and layer.weight is None and len(layer.paths) == 2, layer.paths
    x = torch.randn(5, cols, generator=g).bfloat16()
    expected = torch.cat([p(x) for p in parts], dim=1)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.for_kernel()(x), expected)


def test_a_k_quant_stack_is_one_call_with_its_parts_bits(tensors, kernel):
    """A stack of K-quant parts (a Q4_K_M layer's Q4_K queries and keys beside Q6_K values) takes a
    step of a few rows in one call, its parts' panels in one parallel region (kquant_stack), and a
    larger step a product a part: either way each part's outputs are its own product's bits, in
    Python and in the decoder's C++ Linear alike."""
    parts = [tensors["Q4_K"], tensors["Q6_K"], tensors["Q4_K"]]
    cols = parts[0].shape[1]
    layer = Linear(fuse(parts), None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel)
    alone = [Linear(p, None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel) for p in fuse(parts)]
    assert len(alone) == 3 and layer.paths == {p.path for p in alone} and len(layer.paths) == 1, layer.paths
    few = kernel.kquant_stack_rows()
    assert few in (4, 8), few
    g = torch.Generator().manual_seed(5)
    for rows in list(range(1, few + 2)) + [64]:
        x = torch.randn(rows, cols, generator=g).bfloat16()
        expected = torch.cat([p(x) for p in alone], dim=1)
        assert torch.equal(layer(x), expected), rows
        assert torch.equal(layer.for_kernel()(x), expected), rows
        assert torch.equal(kernel.kquant_stack(x.float(), [p.packed for p in alone], [p.code for p in alone]),
                           torch.cat([p(x.float()) for p in alone], dim=1)), rows
    with pytest.raises(RuntimeError, match="as many types as weights"):
        kernel.kquant_stack(x, [alone[0].packed], [alone[0].code, alone[1].code])


def test_fetching_the_next_product_ahead_changes_no_bits(tensors, kernel):
    """A product's threads with no piece left fetch the next product's first bytes (rowwise.h's
    upcoming hint, set by a stack for its next part and by the decoder for its next layer), and a
    pass over two panels fetches its thread's next pair (from 9 rows, kquants.h's Slice), as the
    AMX tiles' passes fetch the next panel (up to 128 rows): prefetches only, so a stack of K-quant
    parts writes the same bits with them on and off, at a lone decode's row, a few rows (each pair
    met straight from its bytes) and a chunk's many (unpacked; on tiles where the CPU has them)."""
    parts = [tensors["Q4_K"], tensors["Q6_K"], tensors["Q4_K"]]
    cols = parts[0].shape[1]
    assert all(p.shape[1] == cols for p in parts), [p.shape for p in parts]
    layer = Linear(fuse(parts), None, torch.bfloat16, torch.device("cpu"), EVERY_STEP, kernel).for_kernel()
    g = torch.Generator().manual_seed(6)
    assert kernel.fetch_ahead(), "fetching ahead is on by default"
    try:
        for rows in (1, 7, 13, 64):
            x = torch.randn(rows, cols, generator=g).bfloat16()
            ahead = layer(x)
            assert kernel.fetch_ahead(False) is False
            assert torch.equal(ahead, layer(x)), rows
            assert kernel.fetch_ahead(True)
    finally:
        kernel.fetch_ahead(True)
