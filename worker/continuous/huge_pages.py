"""The weights a step streams, in 2 MiB pages.

A decode step of a few rows reads every weight once, in order, and a lone player's token comes as
fast as that read. On 4 KiB pages it crosses a page every 64 cache lines, and past the few MiB the
TLB covers each new page costs a walk of the page tables. On a Zen 4 (docs/serving.md, "Huge
pages") the one-row products of a 1.7B Q4_K_M model ran 1.09x faster (1.05-1.13) with the same
bytes in 2 MiB pages, and a plain reduction over 1 GiB 1.1x (slow minutes) to 1.2x (fast ones).

Linux backs anonymous memory with huge pages only where it is asked (madvise(MADV_HUGEPAGE)) when
/sys/kernel/mm/transparent_hugepage/enabled is "madvise", a common default; torch's allocations do
not ask. So the weights the kernels read at every step are copied once, at load, into chunks of
memory that do (HugePages.place), each one's original freed as it goes. The bytes are the same, so
are the bits. Where the system gives no huge pages ("never", none free) the chunks are plain memory;
where madvise has no such advice (not Linux), weights stay where they are.
"""
from __future__ import annotations

import math
import mmap
from typing import Optional

import torch

HUGE = 2 << 20  # a huge page: chunks start on one
CHUNK = 256 << 20  # bytes a chunk holds (a larger weight gets one of its own size)
ALIGN = 64  # each weight starts on a cache line
ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def enabled_on_this_system() -> Optional[str]:
    """Linux's transparent huge page setting (always | madvise | never), or None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


class HugePages:
    """Places tensors in chunks of memory advised to be huge pages, one after another. A chunk's
    last touched huge page may be partly unused (at most 2 MiB of memory a chunk); the rest of a
    chunk a weight did not fit in stays untouched, so takes no memory."""

    def __init__(self, chunk_bytes: int = CHUNK):
        self.chunk_bytes = chunk_bytes
        self.free: Optional[torch.Tensor] = None  # the current chunk's unused bytes (uint8)
        self.placed = 0  # bytes placed
        self.chunks = 0

    def place(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A copy of t in huge pages (t itself where it is none, not on the CPU, or no advice exists)."""
        if t is None or ADVICE is None or t.device.type != "cpu" or t.numel() == 0:
            return t
        return self.empty(t.shape, t.dtype).copy_(t)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor in huge pages (bench.bandwidth reads one, as the kernels do the weights)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        taken = -(-nbytes // ALIGN) * ALIGN
        if self.free is None or self.free.numel() < taken:
            self.free = self._chunk(max(self.chunk_bytes, taken))
        out = self.free[:nbytes].view(dtype).view(shape)
        self.free = self.free[taken:]
        self.placed += nbytes
        return out

    def _chunk(self, nbytes: int) -> torch.Tensor:
        # The mapping lives as long as a tensor viewing it (torch.frombuffer keeps a reference).
        mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if ADVICE is not None:
            try:
                mapping.madvise(ADVICE)
            except OSError:  # a kernel built without transparent huge pages: plain memory
                pass
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE
        self.chunks += 1
        return whole[start:start + nbytes]
