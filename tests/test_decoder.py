"""The C++ decoder of every family (csrc/decoder.h: `Decoder`) on random weights.

Each of a layer's options on (a q/k/v bias, q/k head norms, partial rotary with tables of the
layer's own, a sliding window, norms after attention and after the MLP, GELU-tanh): one step's
hidden states and cache writes against plain torch in float32; a row's bits the same alone or among
other rows, at several step sizes and orders; the Llama case bit for bit today's `LlamaDecoder`;
and the table of kernel paths (csrc/linear.h) that linear.py's layers are handed to C++ by.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from worker.continuous.linear import EVERY_STEP, INVARIANT, Linear
from worker.continuous.weights import Q41, Q80

EPS = 1e-6
BLOCK = 4
BLOCKS = 96
# (tokens before this step, tokens in it) per request: decodes of contexts shorter than, as long
# as and longer than the window, a one-token context, and two prompt chunks whose rows cross the
# window's length inside one tile.
REQUESTS = [(29, 1), (2, 1), (5, 1), (1, 12), (0, 1), (20, 5), (9, 1)]
WINDOW = 6


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    dim: int
    inner: int
    rot: int


# "regular": head size 64 (the attention's unrolled instance), every row a whole number of 64-byte
# lines; "odd": head size 16 (the run-time one), and rows that are not (bf16: 160 and 96 bytes),
# so each row's input goes through an aligned copy.
SHAPES = {"regular": Shape(hidden=128, heads=4, kv_heads=2, dim=64, inner=256, rot=32),
          "odd": Shape(hidden=80, heads=6, kv_heads=3, dim=16, inner=48, rot=8)}


@dataclass
class Model:
    shape: Shape
    activation: str
    layers: list = field(default_factory=list)  # dicts: tensors and Linear layers, add_layer's arguments


def _linear(rows, cols, dtype, kernel, weights, gen):
    if weights == "dense":
        w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
    elif weights == "q4_1":
        w = Q41(q=torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen),
                d=(torch.rand(rows, cols // 32, generator=gen) / 4 / math.sqrt(cols)).half().float(),
                m=(-torch.rand(rows, cols // 32, generator=gen) * 2 / math.sqrt(cols)).half().float())
    else:
        w = Q80(q=torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen),
                d=(torch.rand(rows, cols // 32, generator=gen) / 64 / math.sqrt(cols)).half().float())
    return Linear(w, None, dtype, torch.device("cpu"), EVERY_STEP, kernel)


def _rotary(rot, base, dtype, positions=64):
    inv = 1.0 / base ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(torch.arange(positions).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_model(kernel, dtype, shape: Shape, *, every_option=True, weights="dense", layers=2, seed=0) -> Model:
    """Layer 0 local (window, its own rope base), layer 1 global; every option on, or Llama's none."""
    gen = torch.Generator().manual_seed(seed)
    s = shape
    width = (s.heads + 2 * s.kv_heads) * s.dim
    norm = lambda n: (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)  # noqa: E731
    model = Model(shape, "gelu_tanh" if every_option else "silu")
    for layer in range(layers):
        cos, sin = _rotary(s.rot if every_option else s.dim, 10000.0 if layer % 2 else 500.0, dtype)
        model.layers.append(dict(
            norm1=norm(s.hidden), qkv=_linear(width, s.hidden, dtype, kernel, weights, gen),
            qkv_bias=(0.5 * torch.randn(width, generator=gen)).to(dtype) if every_option else None,
            q_norm=norm(s.dim) if every_option else None, k_norm=norm(s.dim) if every_option else None,
            o=_linear(s.hidden, s.heads * s.dim, dtype, kernel, weights, gen),
            post_attn_norm=norm(s.hidden) if every_option else None, norm2=norm(s.hidden),
            gate_up=_linear(2 * s.inner, s.hidden, dtype, kernel, weights, gen),
            down=_linear(s.hidden, s.inner, dtype, kernel, weights, gen),
            post_ffn_norm=norm(s.hidden) if every_option else None,
            cos=cos, sin=sin, window=WINDOW if every_option and layer % 2 == 0 else 0))
    return model


def decoder(kernel, model: Model):
    s = model.shape
    d = kernel.Decoder(s.heads, s.kv_heads, s.dim, EPS, model.activation)
    for layer in model.layers:
        d.add_layer(**{k: v.for_kernel() if isinstance(v, Linear) else v for k, v in layer.items()})
    return d


@dataclass
class Step:
    x: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    k: torch.Tensor  # the cache before the step: [layers, kv_heads, blocks, block, dim]
    v: torch.Tensor

    def rows(self, index):
        """These rows of the step (a list of row numbers), on a cache of their own (`k`, `v`)."""
        index = torch.tensor(index)
        return Step(self.x[index].clone(), self.positions[index], self.slots[index], self.tables[index].contiguous(),
                    self.lengths[index], self.k.clone(), self.v.clone())


def make_step(model: Model, dtype, seed=1) -> Step:
    gen = torch.Generator().manual_seed(seed)
    s = model.shape
    width = -(-max(before + new for before, new in REQUESTS) // BLOCK)
    order = torch.randperm(BLOCKS, generator=gen).tolist()  # blocks anywhere in the pool, never shared
    positions, tables = [], []
    for i, (before, new) in enumerate(REQUESTS):
        own = order[i * width:(i + 1) * width]
        for p in range(before, before + new):
            positions.append(p)
            tables.append(own)
    positions = torch.tensor(positions)
    tables = torch.tensor(tables)
    slots = tables[torch.arange(len(positions)), positions // BLOCK] * BLOCK + positions % BLOCK
    shape = (len(model.layers), s.kv_heads, BLOCKS, BLOCK, s.dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    x = torch.randn(len(positions), s.hidden, generator=gen).to(dtype)
    return Step(x, positions, slots, tables, positions + 1, k, v)


def run(dec, step: Step, scale):
    """The step through the C++ decoder: its hidden states (and the step's cache, written in place)."""
    return dec.forward(step.x.clone(), step.positions, step.k, step.v, step.slots, step.tables, step.lengths, scale)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rotate(x, cos, sin):
    """transformers' rotary on the first cos.shape[-1] dimensions of each head, the rest as it is."""
    rot = cos.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], -1)
    return torch.cat([r * cos + half * sin, rest], -1)


def reference(model: Model, step: Step, scale):
    """The same step in plain torch, float32, row by row for attention."""
    s = model.shape
    x = step.x.float()
    k_cache, v_cache = step.k.float(), step.v.float()
    rows = x.shape[0]
    group = s.heads // s.kv_heads
    for l, layer in enumerate(model.layers):
        qkv = layer["qkv"](_rms(x, layer["norm1"].float()))
        if layer["qkv_bias"] is not None:
            qkv = qkv + layer["qkv_bias"].float()
        q = qkv[:, :s.heads * s.dim].view(rows, s.heads, s.dim)
        k = qkv[:, s.heads * s.dim:(s.heads + s.kv_heads) * s.dim].view(rows, s.kv_heads, s.dim)
        v = qkv[:, (s.heads + s.kv_heads) * s.dim:].view(rows, s.kv_heads, s.dim)
        if layer["q_norm"] is not None:
            q, k = _rms(q, layer["q_norm"].float()), _rms(k, layer["k_norm"].float())
        cos, sin = layer["cos"].float()[step.positions][:, None], layer["sin"].float()[step.positions][:, None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache[l].flatten(1, 2)[:, step.slots] = k.transpose(0, 1)
        v_cache[l].flatten(1, 2)[:, step.slots] = v.transpose(0, 1)
        out = []
        for r, length in enumerate(step.lengths.tolist()):
            first = max(0, length - layer["window"]) if layer["window"] else 0
            slots = [int(step.tables[r, t // BLOCK]) * BLOCK + t % BLOCK for t in range(first, length)]
            keys = k_cache[l].flatten(1, 2)[:, slots].repeat_interleave(group, 0)  # [heads, n, dim]
            values = v_cache[l].flatten(1, 2)[:, slots].repeat_interleave(group, 0)
            weights = torch.softmax((q[r][:, None, :] * keys).sum(-1) * scale, -1)
            out.append((weights[..., None] * values).sum(1).flatten())
        a = layer["o"](torch.stack(out))
        if layer["post_attn_norm"] is not None:
            a = _rms(a, layer["post_attn_norm"].float())
        x = x + a
        gate, up = layer["gate_up"](_rms(x, layer["norm2"].float())).chunk(2, -1)
        act = F.silu(gate) if model.activation == "silu" else F.gelu(gate, approximate="tanh")
        d = layer["down"](act * up)
        if layer["post_ffn_norm"] is not None:
            d = _rms(d, layer["post_ffn_norm"].float())
        x = x + d
    return x, k_cache, v_cache


@pytest.mark.parametrize("shape", SHAPES)
def test_every_option_on_computes_what_plain_torch_computes(kernel, shape):
    model = make_model(kernel, torch.float32, SHAPES[shape])
    step = make_step(model, torch.float32)
    scale = 1 / math.sqrt(model.shape.dim)
    expected, k, v = reference(model, step, scale)
    got = run(decoder(kernel, model), step, scale)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert torch.allclose(step.k, k, atol=1e-5, rtol=1e-5) and torch.allclose(step.v, v, atol=1e-5, rtol=1e-5)


def test_each_option_on_its_own_computes_what_plain_torch_computes(kernel):
    """One option at a time over Llama's plain layers, so that none of them hides another's mistake."""
    shape = SHAPES["regular"]
    base = make_model(kernel, torch.float32, shape, every_option=False)
    full = make_model(kernel, torch.float32, shape, every_option=True)
    scale = 1 / math.sqrt(shape.dim)
    options = [("qkv_bias",), ("q_norm", "k_norm"), ("post_attn_norm",), ("post_ffn_norm",), ("cos", "sin"),
               ("window",), ("activation",)]
    for names in options:
        model = Model(shape, full.activation if names == ("activation",) else "silu",
                      [dict(layer) for layer in base.layers])
        for layer, other in zip(model.layers, full.layers):
            for name in names:
                if name != "activation":
                    layer[name] = other[name]
        step = make_step(model, torch.float32)
        expected, _, _ = reference(model, step, scale)
        got = run(decoder(kernel, model), step, scale)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (names, (got - expected).abs().max())


def _invariant_or_skip(model: Model):
    paths = {lin.path for layer in model.layers for lin in layer.values() if isinstance(lin, Linear)}
    if not all(lin.invariant for layer in model.layers for lin in layer.values() if isinstance(lin, Linear)):
        pytest.skip(f"no batch-invariant product for these weights on this CPU: its layers run {sorted(paths)}, "
                    f"not all of them one of {INVARIANT}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,weights", [("regular", "q4_1"), ("regular", "q8_0"), ("regular", "dense"),
                                           ("odd", "dense")])
def test_a_rows_bits_are_its_own_whatever_shares_its_step(kernel, dtype, shape, weights):
    """Every option on: each row alone, the rows in steps of 2, 3, 5 and 8, reversed (no prompt
    tiles then) and shuffled give every row, and the cache, the bits of the whole step at once."""
    model = make_model(kernel, dtype, SHAPES[shape], weights=weights)
    _invariant_or_skip(model)
    dec = decoder(kernel, model)
    step = make_step(model, dtype)
    scale = 1 / math.sqrt(model.shape.dim)
    whole = step.rows(list(range(len(step.x))))
    expected = run(dec, whole, scale)
    after = Step(step.x, step.positions, step.slots, step.tables, step.lengths, whole.k, whole.v)
    n = len(step.x)
    shuffled = list(range(n))
    random.Random(0).shuffle(shuffled)
    groupings = [[[r] for r in range(n)]] + [[list(range(i, min(n, i + size))) for i in range(0, n, size)]
                                             for size in (2, 3, 5, 8)]
    groupings += [[list(reversed(range(n)))], [shuffled]]
    for grouping in groupings:
        for rows in grouping:
            # On the cache as the whole step left it: the rows before a prompt row's in its chunk are
            # there, and a row rewrites its own slots (with the same bits, if it is invariant).
            part = after.rows(rows)
            got = run(dec, part, scale)
            assert torch.equal(got, expected[rows]), (grouping, rows)
            assert torch.equal(part.k, whole.k) and torch.equal(part.v, whole.v), (grouping, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["dense", "q4_1", "q8_0"])
def test_the_llama_case_has_the_bits_of_the_llama_decoder(kernel, dtype, weights):
    """No bias, no q/k norms, no post norms, full rotary, no window, SiLU: today's numbers exactly."""
    model = make_model(kernel, dtype, SHAPES["regular"], every_option=False, weights=weights)
    for layer in model.layers[1:]:  # LlamaDecoder takes one pair of tables for every layer
        layer["cos"], layer["sin"] = model.layers[0]["cos"], model.layers[0]["sin"]
    s = model.shape
    llama = kernel.LlamaDecoder(s.heads, s.kv_heads, s.dim, EPS)
    for layer in model.layers:
        llama.add_layer(layer["norm1"], layer["qkv"].for_kernel(), layer["o"].for_kernel(), layer["norm2"],
                        layer["gate_up"].for_kernel(), layer["down"].for_kernel())
    step = make_step(model, dtype)
    a, b = step.rows(list(range(len(step.x)))), step.rows(list(range(len(step.x))))
    cos, sin = model.layers[0]["cos"], model.layers[0]["sin"]
    old = llama.forward(a.x.clone(), a.positions, cos, sin, a.k, a.v, a.slots, a.tables, a.lengths, 0.125)
    new = run(decoder(kernel, model), b, 0.125)
    assert torch.equal(old, new)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_bad_arguments_are_refused_with_the_reason(kernel):
    with pytest.raises(RuntimeError, match="activation"):
        kernel.Decoder(4, 2, 64, EPS, "relu")
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel.Decoder(5, 2, 64, EPS, "silu")
    model = make_model(kernel, torch.float32, SHAPES["regular"])
    layer = {k: v.for_kernel() if isinstance(v, Linear) else v for k, v in model.layers[0].items()}
    d = kernel.Decoder(4, 2, 64, EPS, "silu")
    with pytest.raises(RuntimeError, match="qkv_bias"):
        d.add_layer(**{**layer, "qkv_bias": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="rotary_dim"):
        d.add_layer(**{**layer, "cos": torch.zeros(64, 66), "sin": torch.zeros(64, 66)})
    d.add_layer(**layer)
    step = make_step(Model(model.shape, "silu", model.layers[:1]), torch.float32)
    with pytest.raises(RuntimeError, match="past the rotary tables"):
        d.forward(step.x, step.positions + 100, step.k, step.v, step.slots, step.tables, step.lengths, 0.1)


def test_the_kernel_paths_are_one_table_that_linear_reads(kernel):
    """Each of linear.py's paths this build runs has its C++ code, and a layer handed to C++ on it
    computes what the Python layer computes, at a row and at many."""
    assert kernel.PATHS["dense"] == 0 and len(set(kernel.PATHS.values())) == len(kernel.PATHS)
    assert {"int4", "bytes"} <= set(kernel.PATHS)
    gen = torch.Generator().manual_seed(3)
    w = Q41(q=torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=gen),
            d=torch.rand(64, 4, generator=gen).half().float() / 50, m=-torch.rand(64, 4, generator=gen).half().float() / 10)
    from worker.continuous.linear import pick_kernel
    layers = [Linear(w, None, torch.float32, torch.device("cpu"), EVERY_STEP, kernel, small=small)
              for small in ("auto", "bytes", "int4", "dense")]
    layers.append(Linear(w.dequantize(), None, torch.float32, torch.device("cpu"), EVERY_STEP, kernel))
    assert pick_kernel("auto", kernel) in ("int8", "bytes")
    for layer in layers:
        assert layer.small is None or layer.small in kernel.PATHS, layer.small
        native = layer.for_kernel()
        for rows in (1, 7, 40):
            x = torch.randn(rows, 128, generator=gen)
            assert torch.equal(native(x), layer(x)), (layer.path, rows)
    with pytest.raises(RuntimeError, match="not one this build runs"):
        kernel.Linear(torch.empty(0), False, 99, False, None, None, None, 0)
