"""The whole-step C++ decoder (csrc/kernels.cpp) computes what the Python layers compute.

A tiny random Llama in float32, requests decoding at different context lengths: one step's hidden
states through `LlamaDecoder.forward` against the same step through the Python layers (torch's
operations plus the decode-attention kernel), and the cache each writes. The engine-level tests
(test_continuous_engine.py) then check whole texts with the fused path on.
"""
from __future__ import annotations

import pytest
import torch

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.continuous.linear import Linear
from worker.model_loader import load


# "onednn": float32 weights packed for oneDNN, as bf16 ones are on CPUs with native bf16, so the
# C++ decoder's call of oneDNN's product through torch's dispatcher is checked on any CPU.
@pytest.fixture(scope="module", params=["float32", "bfloat16", "onednn"])
def engine(request, tiny_model_dirs):
    dtype = "bfloat16" if request.param == "bfloat16" else "float32"
    loaded = load(tiny_model_dirs["llama"], dtype=dtype, device="cpu")
    # (onednn: the dense product at every step, --int4-rows 0, instead of csrc/dense_panels.h)
    rows = 0 if request.param == "onednn" else Settings.int4_rows
    engine = continuous.build(loaded, Settings(block_size=4, kv_blocks=256, max_batch_tokens=64, batch=0, int4_rows=rows),
                              loaded.model.state_dict(), loaded.model.config)
    if engine.runner.kernel is None:
        pytest.fail("the C++ kernels did not build (g++ and ninja come with the test setup)")
    if request.param == "onednn":
        model = engine.runner.model
        for linear in [model.head] + [lin for b in model.blocks for lin in b.values() if isinstance(lin, Linear)]:
            linear.weight, linear.onednn = torch.ops.mkldnn._reorder_linear_weight(linear.weight, 64), True
    for i, length in enumerate([1, 5, 13, 30, 2, 17]):  # contexts spanning one to eight blocks
        engine.add(Job(id=f"r{i}", model="m", prompt_ids=[10 + (7 * i + t) % 50 for t in range(length)],
                       params=SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), timeout_s=60))
    for _ in range(100):  # until every prompt is in the cache: each request then decodes one token a step
        running = engine.scheduler.running
        if len(running) == 6 and all(r.computed == len(r.tokens) - 1 for r in running):
            return engine
        engine.step()
    pytest.fail("the prompts were never all prefilled")


def test_a_decode_step_in_cpp_equals_the_python_layers(engine):
    runner, model = engine.runner, engine.runner.model
    plan = engine.scheduler.schedule()
    assert len(plan) == 6 and all(count == 1 for _, count in plan)
    ids, positions, step, _, _ = runner._layout(plan)
    assert not step.chunks and step.kernel is not None
    cache = runner.cache
    before_k, before_v = cache.k.clone(), cache.v.clone()
    with torch.inference_mode():
        fused = model.forward(ids, positions, cache, step).clone()
        assert model.decoder is not None, "an all-decode step takes the C++ decoder"
        fused_k, fused_v = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before_k)
        cache.v.copy_(before_v)
        decoder, model.decoder = model.decoder, None
        model._fused = lambda kernel: None  # the Python layers, for this step only
        try:
            python = model.forward(ids, positions, cache, step)
        finally:
            del model._fused
            model.decoder = decoder
    assert fused.shape == python.shape and fused.dtype == python.dtype
    # float32: summation order only. bf16: the C++ loops round once where torch rounds after each
    # operation, a few bf16 steps (2^-8 each) over the layers.
    tolerance = 1e-4 if fused.dtype == torch.float32 else 5e-2
    assert torch.allclose(fused.float(), python.float(), atol=tolerance, rtol=tolerance)
    written = step.slots
    for layer in range(cache.k.shape[0]):
        flat = lambda c: c[layer].flatten(1, 2)[:, written].float()  # noqa: E731 - the step's slots only
        assert torch.allclose(flat(fused_k), flat(cache.k), atol=tolerance, rtol=tolerance)
        assert torch.allclose(flat(fused_v), flat(cache.v), atol=tolerance, rtol=tolerance)
    if fused.dtype == torch.float32:
        assert torch.equal(model.logits(fused).argmax(-1), model.logits(python).argmax(-1))


def _newcomer(engine, name: str, length: int):
    engine.add(Job(id=name, model="m", prompt_ids=[10 + t % 40 for t in range(length)],
                   params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), timeout_s=60))
    return engine.scheduler.schedule()


def test_a_short_prompt_beside_the_decodes_runs_as_rows_of_the_cpp_decoder(engine, monkeypatch):
    """The newcomer's prompt tokens become rows (each its own position, attending through its
    request's blocks): the whole step stays in C++, and computes what the Python layers compute
    with torch's causal attention over the chunk."""
    runner, model = engine.runner, engine.runner.model
    plan = _newcomer(engine, "short", 11)
    ids, positions, rows_step, _, _ = runner._layout(plan)
    assert not rows_step.chunks and rows_step.decodes == len(ids) == 6 + 11
    assert rows_step.decode_lengths[6:].tolist() == list(range(1, 12))  # causal: position + 1
    monkeypatch.setattr(runner, "kernel", None)  # without the C++ kernels, the chunk goes through torch
    _, _, chunk_step, _, _ = runner._layout(plan)
    monkeypatch.undo()
    assert len(chunk_step.chunks) == 1 and chunk_step.decodes == 6
    cache = runner.cache
    before_k, before_v = cache.k.clone(), cache.v.clone()
    with torch.inference_mode():
        as_rows = model.forward(ids, positions, cache, rows_step).clone()
        rows_k = cache.k.clone()
        cache.k.copy_(before_k)
        cache.v.copy_(before_v)
        layers = model.forward(ids, positions, cache, chunk_step)
    tolerance = 1e-4 if as_rows.dtype == torch.float32 else 5e-2
    assert torch.allclose(as_rows.float(), layers.float(), atol=tolerance, rtol=tolerance)
    written = rows_step.slots
    assert torch.allclose(rows_k[:, :, :].flatten(2, 3)[:, :, written].float(),
                          cache.k.flatten(2, 3)[:, :, written].float(), atol=tolerance, rtol=tolerance)
    calls = []
    decoder = model.decoder
    model.decoder = type("Spy", (), {"forward": lambda self, *a: calls.append(a) or a[0]})()
    try:
        with torch.inference_mode():
            model.forward(ids, positions, cache, rows_step)
    finally:
        model.decoder = decoder
    assert len(calls) == 1


def test_a_long_prompt_chunk_runs_as_rows_of_the_cpp_decoder_too(engine):
    """Every prompt token is a row, whatever its chunk's size or context: one numeric path."""
    plan = _newcomer(engine, "late", 120)  # most of the tiny model's context, chunked by the budget
    _, _, step, _, _ = engine.runner._layout(plan)
    assert not step.chunks and step.decodes == sum(count for _, count in plan)
    calls = []
    decoder = engine.runner.model.decoder
    engine.runner.model.decoder = type("Spy", (), {"forward": lambda self, *a: calls.append(a) or a[0]})()
    try:
        engine.runner.logits(plan)
    finally:
        engine.runner.model.decoder = decoder
    assert len(calls) == 1
