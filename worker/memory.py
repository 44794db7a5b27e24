"""The worker's resident memory: how much it is, and handing back what the heap holds but no longer uses.

glibc's malloc keeps freed memory for reuse instead of returning it: after a load, the unpacking's
temporaries (~150 MB for a 1.7B model's K-quant panels); while serving, what a step's temporaries
(logits, a prompt chunk's activations) left in the heap and the threads' arenas, ~50-90 MiB at 64
players on the 1.7B model, which the worker would report and hold as its own for good
(docs/serving.md, "The worker's memory"). malloc_trim returns the free pages of every arena
(~1 ms, at most ~8 ms measured there): the worker runs it once a heartbeat. Elsewhere than glibc
(musl, macOS) both are no-ops.
"""
from __future__ import annotations

import ctypes
import gc
import os


def resident_mb() -> int:
    """This process's resident memory, for the heartbeat (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, ValueError):
        return 0


def trim() -> None:
    """Hand the heap's free pages back to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_after_load() -> None:
    """Collect what the load left (cycles among its objects), then trim."""
    gc.collect()
    trim()
