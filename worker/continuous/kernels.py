"""The engine's C++ kernels (csrc/): decode attention over the paged cache and a whole Llama
decode step, built once by torch and cached on disk.

Built with the compiler torch's extensions use (g++ and ninja); the first start of a worker on a
machine pays ~25 s for it, later starts load the cached library. Where it cannot be built, the
engine runs attention in torch instead and says so once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import lru_cache
from typing import Optional

log = logging.getLogger(__name__)

SOURCES = os.path.join(os.path.dirname(__file__), "csrc")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# A build takes ~25 s here (minutes on a busy machine). torch's build lock is a bare file that a
# killed build leaves behind, and torch waits on it forever: older than this, it is a dead one's.
STALE_LOCK_S = 180


def _clear_stale_lock(build_dir: str) -> None:
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_S:
        log.warning("removing a kernel build lock left %.0f s ago by a build that never finished", age)
        try:
            os.remove(lock)
        except OSError:
            pass


@lru_cache(maxsize=None)
def build(build_dir: str = "") -> Optional[object]:
    """The compiled module (`.paged_decode`, `.LlamaDecoder`), or None where it cannot be built."""
    if os.environ.get("STORYTELLER_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load
        try:  # the ninja wheel's binary, for a virtualenv that is not on PATH
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        if build_dir:
            build_dir = os.path.expanduser(build_dir)
            os.makedirs(build_dir, exist_ok=True)
            _clear_stale_lock(build_dir)
        return load(name="storyteller_kernels", sources=[os.path.join(SOURCES, "kernels.cpp")],
                    extra_include_paths=[SOURCES], build_directory=build_dir or None,
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: torch's path still works
        log.warning("decode-attention kernel unavailable (%s): attention runs in torch", exc)
        return None


@lru_cache(maxsize=None)
def build_id() -> str:
    """What the kernels' bits depend on, short: their sources, the flags, torch's version and this
    CPU's instruction sets (which -march=native compiles for). Part of a worker's numerics
    fingerprint: two workers with the same one compute the same bits for the same row."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(SOURCES)):
        with open(os.path.join(SOURCES, name), "rb") as f:
            digest.update(name.encode() + f.read())
    digest.update(" ".join(CFLAGS).encode() + torch_version().encode() + cpu_flags().encode())
    return digest.hexdigest()[:12]


def torch_version() -> str:
    import torch
    return torch.__version__


def cpu_flags() -> str:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
