"""Decode attention over the paged cache: the C++ kernel, torch's path and plain softmax agree."""
from __future__ import annotations

import os
import time

import pytest
import torch

from worker.continuous import attention, kernels
from worker.continuous.attention import KVCache, StepLayout

KV_HEADS, HEADS, DIM, BLOCKS, SIZE = 2, 6, 16, 40, 4


def reference(q, cache, tables, lengths, scale):
    """Each row on its own: its tokens' keys and values in order, softmax, weighted sum."""
    out = []
    for row, length in enumerate(lengths.tolist()):
        slots = [tables[row, t // SIZE] * SIZE + t % SIZE for t in range(length)]
        k = cache.k[0].flatten(1, 2)[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        v = cache.v[0].flatten(1, 2)[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        weights = torch.softmax((q[row].float()[:, None, :] * k).sum(-1) * scale, dim=-1)
        out.append((weights[..., None] * v).sum(1))
    return torch.stack(out)


def make_step(dtype, rows=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, KV_HEADS, DIM, BLOCKS, SIZE, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    lengths = torch.randint(1, 6 * SIZE, (rows,), generator=gen)
    width = -(-int(lengths.max()) // SIZE)
    tables = torch.stack([torch.randperm(BLOCKS, generator=gen)[:width] for _ in range(rows)])
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    step = StepLayout(slots=torch.empty(0, dtype=torch.long), decodes=rows, decode_tables=tables,
                      decode_lengths=lengths)
    return q, cache, step


@pytest.mark.parametrize("rows", [1, 3, 9])  # float32 below 4 rows and bf16 matmuls above, in torch
def test_torch_path_matches_plain_softmax(rows):
    q, cache, step = make_step(torch.float32, rows)
    out = attention.attend(q, cache, 0, step, scale=0.25)
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_plain_softmax(kernel, dtype, tolerance):
    q, cache, step = make_step(dtype, rows=7, seed=1)
    step.kernel = kernel
    out = attention.attend(q, cache, 0, step, scale=0.25)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    assert torch.allclose(out.float(), expected, atol=tolerance)


def test_padding_past_a_rows_length_is_never_read(kernel):
    """Blocks past a row's length may hold anything, even NaN: they must not leak in."""
    q, cache, step = make_step(torch.float32, rows=4, seed=2)
    expected = reference(q, cache, step.decode_tables, step.decode_lengths, 0.25)
    for row, length in enumerate(step.decode_lengths.tolist()):
        for t in range(length, step.decode_tables.shape[1] * SIZE):
            block = step.decode_tables[row, t // SIZE]
            # Only slots no row reads: a shared block may hold another row's real tokens.
            if not any(b == block and t2 < l for r2, l in enumerate(step.decode_lengths.tolist())
                       for t2 in range(l) for b in [step.decode_tables[r2, t2 // SIZE]]
                       if t2 % SIZE == t % SIZE):
                cache.k[0, :, block, t % SIZE] = float("nan")
                cache.v[0, :, block, t % SIZE] = float("nan")
    for use_kernel in (False, True):
        step.kernel = kernel if use_kernel else None
        out = attention.attend(q, cache, 0, step, scale=0.25)
        assert torch.allclose(out, expected, atol=1e-5), f"kernel={use_kernel}"


def test_a_build_lock_left_by_a_killed_build_is_cleared_a_live_one_is_not(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build may be running right now: wait for it as torch does
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(str(tmp_path))
    assert not lock.exists()
