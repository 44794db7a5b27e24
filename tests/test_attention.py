"""Decode attention over the paged cache: the C++ kernel, torch's path and plain softmax agree.

Head sizes 64 and 128 take the kernel's AVX-512 steps where the CPU has them (attention_avx512.h:
16 positions scored at a time, so a block of 32 holds two such runs); 16 the portable ones."""
from __future__ import annotations

import os
import time

import pytest
import torch

from worker.continuous import attention, kernels
from worker.continuous.attention import KVCache, StepLayout

KV_HEADS, HEADS, DIM, BLOCKS, SIZE = 2, 6, 16, 40, 4
SHAPES = [(16, 4), (64, 4), (128, 32)]  # (head size, block size)


def reference(q, cache, tables, lengths, scale, window=0):
    """Each row on its own: its tokens' keys and values in order (its last `window`, if > 0),
    softmax, weighted sum."""
    size = cache.k.shape[3]
    out = []
    for row, length in enumerate(lengths.tolist()):
        first = max(0, length - window) if window else 0
        slots = [tables[row, t // size] * size + t % size for t in range(first, length)]
        k = cache.k[0].flatten(1, 2)[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        v = cache.v[0].flatten(1, 2)[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        weights = torch.softmax((q[row].float()[:, None, :] * k).sum(-1) * scale, dim=-1)
        out.append((weights[..., None] * v).sum(1))
    return torch.stack(out)


def make_step(dtype, rows=5, seed=0, dim=DIM, size=SIZE):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, KV_HEADS, dim, BLOCKS, size, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    lengths = torch.randint(1, 6 * size, (rows,), generator=gen)
    width = -(-int(lengths.max()) // size)
    tables = torch.stack([torch.randperm(BLOCKS, generator=gen)[:width] for _ in range(rows)])
    q = torch.randn(rows, HEADS, dim, generator=gen).to(dtype)
    step = StepLayout(slots=torch.empty(0, dtype=torch.long), decodes=rows, decode_tables=tables,
                      decode_lengths=lengths)
    return q, cache, step


@pytest.mark.parametrize("rows", [1, 3, 9])  # float32 below 4 rows and bf16 matmuls above, in torch
def test_torch_path_matches_plain_softmax(rows):
    q, cache, step = make_step(torch.float32, rows)
    out = attention.attend(q, cache, 0, step, scale=0.25)
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("dim,size", SHAPES)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_plain_softmax(kernel, dtype, tolerance, dim, size):
    q, cache, step = make_step(dtype, rows=7, seed=1, dim=dim, size=size)
    step.kernel = kernel
    out = attention.attend(q, cache, 0, step, scale=0.25)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    assert torch.allclose(out.float(), expected, atol=tolerance)


@pytest.mark.parametrize("dim,size", SHAPES)
def test_padding_past_a_rows_length_is_never_read(kernel, dim, size):
    """Blocks past a row's length may hold anything, even NaN: they must not leak in."""
    q, cache, step = make_step(torch.float32, rows=4, seed=2, dim=dim, size=size)
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    for row, length in enumerate(step.decode_lengths.tolist()):
        for t in range(length, step.decode_tables.shape[1] * size):
            block = step.decode_tables[row, t // size]
            # Only slots no row reads: a shared block may hold another row's real tokens.
            if not any(b == block and t2 < l for r2, l in enumerate(step.decode_lengths.tolist())
                       for t2 in range(l) for b in [step.decode_tables[r2, t2 // size]]
                       if t2 % size == t % size):
                cache.k[0, :, block, t % size] = float("nan")
                cache.v[0, :, block, t % size] = float("nan")
    for use_kernel in (False, True):
        step.kernel = kernel if use_kernel else None
        out = attention.attend(q, cache, 0, step, scale=0.25)
        assert torch.allclose(out, expected, atol=1e-5), f"kernel={use_kernel}"


def _windowed_step(dtype, seed=3, dim=DIM, size=SIZE):
    """Decodes shorter and longer than the window, and a prompt chunk's rows (consecutive positions
    through one table: the kernel's tiles) whose first rows fit in the window and later ones not."""
    q, cache, step = make_step(dtype, rows=1, seed=seed, dim=dim, size=size)
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 23, 7, 1] + list(range(2, 16)) + ([45, 70] if size > 16 else [])
    width = -(-max(lengths) // size)
    own = [torch.randperm(BLOCKS, generator=gen)[:width] for _ in range(5 + (size > 16))]
    tables = torch.stack(own[:4] + [own[4]] * 14 + ([own[4], own[5]] if size > 16 else []))
    q = torch.randn(len(lengths), HEADS, dim, generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize("dim,size", SHAPES)
@pytest.mark.parametrize("window", [1, 5, 20, 80])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_with_a_sliding_window_matches_plain_softmax(kernel, window, dtype, tolerance, dim, size):
    q, cache, tables, lengths = _windowed_step(dtype, dim=dim, size=size)
    out = kernel.paged_decode(q, cache.k[0], cache.v[0], tables, lengths, 0.25, window)
    expected = reference(q, cache, tables, lengths, 0.25, window)
    assert torch.allclose(out.float(), expected, atol=tolerance)
    # a window as long as every row's context is no window
    if window == 80:
        assert torch.equal(out, kernel.paged_decode(q, cache.k[0], cache.v[0], tables, lengths, 0.25))


@pytest.mark.parametrize("dim,size", SHAPES)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_half_cache_beside_float32_reads_as_its_values_in_float32(kernel, half, dim, size):
    """engine.cache_dtype's float16 (or bfloat16) cache beside float32 steps: the kernel widens each
    stored value exactly, so its answer is bit for bit that of a float32 cache holding the same
    rounded values; and torch's path (a worker without the kernels) reads the same cache too, its
    writes rounded to the cache's type."""
    q, cache, tables, lengths = _windowed_step(torch.float32, dim=dim, size=size)
    stored = KVCache(1, KV_HEADS, dim, BLOCKS, size, half, torch.device("cpu"))
    stored.k.copy_(cache.k), stored.v.copy_(cache.v)
    widened = KVCache(1, KV_HEADS, dim, BLOCKS, size, torch.float32, torch.device("cpu"))
    widened.k.copy_(stored.k), widened.v.copy_(stored.v)
    assert not torch.equal(widened.k, cache.k)  # the rounding is real
    for window in (0, 5):
        out = kernel.paged_decode(q, stored.k[0], stored.v[0], tables, lengths, 0.25, window)
        assert out.dtype == torch.float32
        assert torch.equal(out, kernel.paged_decode(q, widened.k[0], widened.v[0], tables, lengths, 0.25, window))
    step = StepLayout(slots=torch.empty(0, dtype=torch.long), decodes=len(lengths), decode_tables=tables,
                      decode_lengths=lengths)
    expected = reference(q, widened, tables, lengths, 0.25)
    assert torch.allclose(attention.attend(q, stored, 0, step, scale=0.25), expected, atol=1e-5)
    keys = torch.randn(3, KV_HEADS, dim)
    attention.write(stored, 0, keys, keys, torch.tensor([0, 1, 2]))
    assert torch.equal(stored.k[0, :, 0, :3], keys.to(half).transpose(0, 1))
    with pytest.raises(RuntimeError, match="float16 / bfloat16 beside float32"):
        kernel.paged_decode(q.to(torch.bfloat16), stored.k[0].to(torch.float16), stored.v[0].to(torch.float16),
                            tables, lengths, 0.25, 0)


@pytest.mark.parametrize("dim,size", SHAPES)
def test_blocks_before_a_rows_window_are_never_read(kernel, dim, size):
    """A sliding-window layer may free a request's blocks behind the window: their table entries then
    name another request's block (here: one full of NaN), and nothing of it may leak in."""
    q, cache, tables, lengths = _windowed_step(torch.float32, dim=dim, size=size)
    window = 5
    expected = reference(q, cache, tables, lengths, 0.25, window)
    poisoned = next(b for b in range(BLOCKS) if not (tables == b).any())  # no row's own
    cache.k[0, :, poisoned] = float("nan")
    cache.v[0, :, poisoned] = float("nan")
    tables = tables.clone()
    for row, length in enumerate(lengths.tolist()):
        for b in range(max(0, length - window) // size):  # blocks wholly behind the window
            tables[row, b] = poisoned
    assert (tables == poisoned).any()
    out = kernel.paged_decode(q, cache.k[0], cache.v[0], tables, lengths, 0.25, window)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("dim,size", SHAPES)
@pytest.mark.parametrize("window", [0, 5, 20])
def test_a_rows_bits_are_the_same_alone_and_in_a_tile(kernel, dim, size, window):
    """A prompt row attends the same whether its chunk's rows share a pass over the blocks or not,
    with a window that starts inside a block or none."""
    q, cache, tables, lengths = _windowed_step(torch.bfloat16, dim=dim, size=size)
    together = kernel.paged_decode(q, cache.k[0], cache.v[0], tables, lengths, 0.25, window)
    for row in range(len(lengths)):
        alone = kernel.paged_decode(q[row:row + 1].contiguous(), cache.k[0], cache.v[0], tables[row:row + 1].contiguous(),
                                    lengths[row:row + 1].contiguous(), 0.25, window)
        assert torch.equal(alone[0], together[row]), row


def test_a_build_lock_left_by_a_killed_build_is_cleared_a_live_one_is_not(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build may be running right now: wait for it as torch does
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(str(tmp_path))
    assert not lock.exists()
