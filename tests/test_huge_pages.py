"""The weights in 2 MiB pages (worker/continuous/huge_pages.py): the same bytes, so the same text.

A placed tensor keeps its values, dtype and shape, starts on a cache line, and (where Linux's
transparent huge pages are asked for by madvise or always on) lies in huge pages; a weight larger
than a chunk gets one of its own. On the packaged SmolLM2 with the defaults, the layers' panels
are placed (the engine says so), and a worker without huge pages writes the same tokens.
"""
from __future__ import annotations

import re

import pytest
import torch

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from tests.engines import write
from worker.continuous import engine as continuous
from worker.continuous.huge_pages import HugePages, enabled_on_this_system
from worker.model_loader import PACKAGED, load


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_placed_tensors_keep_their_bytes_and_lie_in_huge_pages():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (96, 1 << 16), dtype=torch.uint8, generator=g),  # 6 MiB
               torch.randn(33, 7, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),
               torch.randint(-9, 9, (3, 3), dtype=torch.int64, generator=g),
               torch.randn(1 << 20, generator=g).half()[::2]]  # not contiguous
    pages = HugePages(chunk_bytes=4 << 20)
    placed = [pages.place(t) for t in tensors]
    for t, p in zip(tensors, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        assert p.data_ptr() != t.data_ptr() and p.data_ptr() % 64 == 0
    # The 6 MiB weight did not fit a 4 MiB chunk: one of its own, then one for the rest.
    assert pages.chunks == 2 and pages.placed == sum(t.numel() * t.element_size() for t in tensors)
    tensors[0].zero_()
    assert placed[0].sum() > 0  # a copy, not a view of the original
    if enabled_on_this_system() in ("madvise", "always"):
        assert _anon_huge_kb(placed[0].data_ptr()) >= 4096, "the 6 MiB weight is not in huge pages"


@pytest.mark.slow
def test_the_packaged_worker_places_its_weights_and_writes_the_same_tokens_without():
    loaded = load(PACKAGED, dtype="auto", device="cpu", transformers_model=False, cache_dir=Settings().cache_dir)
    engines = {on: continuous.build(loaded, Settings(huge_pages=on, prefix_caching=False), loaded.weights(),
                                    loaded.config) for on in (True, False)}
    notes = {on: " ".join(e.runner.model.notes) for on, e in engines.items()}
    assert "MiB of weights in memory asked to be 2 MiB pages" in notes[True]
    assert "2 MiB pages" not in notes[False]
    layer = engines[True].runner.model.linears()[0]
    if enabled_on_this_system() in ("madvise", "always"):
        assert _anon_huge_kb(layer.packed.data_ptr()) > 0
    prompt = loaded.tokenizer.encode("The knight rode to the castle and")
    jobs = [Job(id=f"j{i}", model="m", prompt_ids=prompt, timeout_s=60,
                params=SamplingParams(max_tokens=24, temperature=t, seed=7, ignore_eos=True))
            for i, t in enumerate((0.0, 0.9))]
    written = {on: [seq.output_ids for seq in write(engine, jobs)] for on, engine in engines.items()}
    assert all(len(ids) == 24 for ids in written[True])
    assert written[True] == written[False]
