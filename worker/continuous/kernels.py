"""The engine's C++ kernels (csrc/), one extension module built once by torch and cached on disk.

kernels.cpp includes every header but kquants.h (kquants.cpp's, which kernels.cpp reaches through
kquants_api.h) and binds what this CPU can run:
- attention.h: decode attention, each row reading its keys and values in place through its block
  table, over the whole context or a sliding window of its last positions (`paged_decode`);
- the linear layers' products (linear.py picks one per layer): panels.h, the GGUF's Q4_1 and Q8_0
  bytes against 8-bit activations, 16 output features a vector (`panel_linear`, AVX-512 VNNI);
  dense_panels.h, a dense weight in panels summed over k in order (`dense_panel_linear`, AVX-512;
  bf16 with AVX-512 BF16); int8.h, the same rounding with a weight row's groups along the lanes
  (`int8_linear`, AVX-512 VNNI or AVX2); kquants.h, llama.cpp's K-quant (and Q5_0, Q5_1) blocks
  against the same 8-bit activations (`kquant_linear`, AVX-512 VNNI or AVX2; kquants_activations.h
  rounds them), a step of 32 rows or more that fills its 16-row tiles well on AMX where the CPU and
  Linux have them (kquants_amx.h: the same bits; `kquant_tiles` turns them off for an A/B), a step
  of 8-32 rows on AVX2 8 rows a vector and a larger step's passes of two rows written for AVX2's
  registers (kquants_avx2.h: the same bits; `kquant_columns`); quantized.h, the blocks turned to
  floats (`quantized_linear`, any CPU);
- linear.h: a layer as the decoder holds it (`Linear`) and the one table of the kernel paths it can
  take, `PATHS` (name -> code, the paths this build runs), which linear.py hands layers over by;
- sampling.h: a token per row (`sample_rows`) and the grammar masks applied in place (`mask_rows`);
- decoder.h: the decoder (`Decoder`): every layer of a step whose tokens are rows of it, decodes
  and prompt tokens alike, norms, rotary, cache writes, attention and the layers' products in one
  call without the GIL, with the options of the families the engine runs (q/k/v biases, q/k head
  norms, partial rotary with tables per layer, sliding windows, post-attention and post-MLP norms,
  SiLU or GELU-tanh); `LlamaDecoder` is its Llama case (tables given at each call);
- rowwise.h, included by the others: each row's work a function of its own on aligned scratch, so
  that a row's bits do not depend on the rest of its step (tests/test_invariance.py).

Built with the compiler torch's extensions use (g++ and ninja), its two units side by side: ~40 s
on 2 cores, once per build key, logged before it starts; later starts load the cached library in
well under a second.
The key (`build_id`) is a hash of everything the library's bits depend on: the sources and headers,
the build flags, the compiler (its path and `--version`), torch's version and C++ ABI, Python's
version and what `-march=native` means on this CPU. The same hash is part of a worker's numerics
fingerprint. Each key builds in a directory of its own under the cache (`<build_id>-<where>`, the
second part a hash of the paths torch writes into the build file: this checkout's sources, torch's
and Python's headers, so two checkouts never rewrite each other's build and rebuild), and only
the few most recently used builds are kept. Where it cannot be built, the engine runs all of this
in torch instead and says so once; a request's text may then depend on what else shares its step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from functools import lru_cache
from typing import Optional

log = logging.getLogger(__name__)

SOURCES = os.path.join(os.path.dirname(__file__), "csrc")
NAME = "storyteller_kernels"  # the module's name; each key's directory has its own copy
# Its translation units, compiled side by side (ninja runs one a core): the K-quant products apart
# from the rest, the largest part of a build.
UNITS = ("kernels.cpp", "kquants.cpp")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# --kernel-isa: what the build may use of this CPU. "avx2" turns AVX-512 off (every AVX-512
# extension depends on AVX-512F), so this machine builds, runs and tests what a CPU with AVX2 alone
# would: its own module name, flags and so build key and fingerprint.
ISAS = {"native": [], "avx2": ["-mno-avx512f"]}
# A build takes about a minute, more on a busy machine (docs/serving.md, "Measurements behind the
# engine's choices"). torch's build lock is a bare file that a killed build leaves behind, and
# torch waits on it forever: older than this, it is a dead one's.
STALE_LOCK_S = 180
KEEP = 3  # builds kept in the cache, the most recently used ones (the one in use among them)
# A build used (or begun) this recently is left alone whatever its rank: another process may be
# loading or building it (torch's lock exists only while ninja runs).
PRUNE_AFTER_S = 3600
USED = "last-used"  # a file in each build's directory, touched at each load: its last use
# What torch's build wrote before builds had a directory per key (one fixed place, shared by all).
LEGACY_FILES = ("build.ninja", ".ninja_log", ".ninja_deps", "kernels.o", NAME + ".so", "lock")


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


def build(cache_dir: str = "", isa: str = "native") -> Optional[object]:
    """The compiled module (`.paged_decode`, `.Decoder`, `.PATHS`, ...), or None where it cannot be
    built. `cache_dir` holds one directory per build key; "" builds in torch's own default place.
    `isa`: a key of ISAS (one that is the native build here, `distinct_isas`, gives the native one)."""
    return _build(cache_dir, resolved(isa))


def distinct_isas() -> tuple:
    """The ISAS whose builds differ here: both where the CPU has AVX-512, only "native" where it has
    not, since there "avx2" turns off what -march=native never turned on (the same code, built
    twice). Tests that run every build run these."""
    return tuple(ISAS) if has_avx512() else ("native",)


def resolved(isa: str) -> str:
    """`isa`, or "native" where its build is the native one (`distinct_isas`)."""
    if isa not in ISAS:
        raise ValueError(f"unknown kernel ISA {isa!r}: expected one of {', '.join(ISAS)}")
    return isa if isa in distinct_isas() else "native"


@lru_cache(maxsize=None)
def has_avx512() -> bool:
    """Whether -march=native turns AVX-512 on here (the compiler's own expansion of it, else the
    CPU's flags)."""
    target = native_target().split()
    return "-mavx512f" in target or "avx512f" in target


@lru_cache(maxsize=None)
def _build(cache_dir: str, isa: str) -> Optional[object]:
    if os.environ.get("STORYTELLER_NO_KERNELS"):
        return None
    try:
        build_dir = ""
        if cache_dir:
            cache_dir = os.path.expanduser(cache_dir)
            build_dir = os.path.join(cache_dir, cache_key(isa))
            os.makedirs(build_dir, exist_ok=True)
            _touch(build_dir)  # before the build: a pruner elsewhere leaves a fresh one alone
            _clear_stale_lock(build_dir)
            with open(os.path.join(build_dir, "inputs.json"), "w") as f:  # what the key stands for
                json.dump(build_inputs(isa), f, indent=1)
        name = module_name(isa)
        library = os.path.join(build_dir, name + ".so")
        built = _mtime(library) if build_dir else None
        if built is None:
            log.info("building the C++ kernels (once per build key, ~40 s on 2 cores, more on older CPUs) "
                     "in %s...", build_dir or "torch's extension directory")
        start = time.monotonic()
        module = compile_units(name, SOURCES, build_dir, isa)
        if built is None or _mtime(library) != built:  # or a rebuild ninja chose (torch's headers changed)
            log.info("built the C++ kernels in %.0f s", time.monotonic() - start)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: torch's path still works
        log.warning("C++ kernels unavailable (%s): decode attention, the quantized and panel products, "
                    "the decoder, the sampler and the grammar masks run in torch instead (slower)", exc)
        return None
    if cache_dir:
        try:
            _touch(build_dir)
            prune(cache_dir, keep=KEEP, in_use=os.path.basename(build_dir))
        except OSError as exc:  # the build loaded: an untidy cache is no reason to go without it
            log.warning("could not prune the kernel cache %s (%s)", cache_dir, exc)
    return module


def compile_units(name: str, sources: str, build_dir: str, isa: str):
    """The translation units UNITS of the directory `sources` built by torch (ninja compiles only what
    changed) and loaded as the module `name`, in `build_dir` ("": torch's own default place):
    `build`'s, and a changed copy's beside it (bench.ab_kernels)."""
    from torch.utils.cpp_extension import load
    try:  # the ninja wheel's binary, for a virtualenv that is not on PATH
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    return load(name=name, sources=[os.path.join(sources, unit) for unit in UNITS], extra_include_paths=[sources],
                build_directory=build_dir or None, extra_cflags=CFLAGS + ISAS[isa], extra_ldflags=["-fopenmp"],
                verbose=False)


def module_name(isa: str = "native") -> str:
    return NAME if isa == "native" else f"{NAME}_{isa}"


@lru_cache(maxsize=None)
def build_id(isa: str = "native") -> str:
    """What the kernels' bits depend on, short (a hash of `build_inputs`). Part of a worker's
    numerics fingerprint (two workers with the same one compute the same bits for the same row)
    and the first part of the build's directory name."""
    return digest(build_inputs(resolved(isa)))


def cache_key(isa: str = "native") -> str:
    """The build's directory under the cache: `build_id` and where this checkout's build reads from
    (torch writes these paths into build.ninja, and ninja rebuilds when its commands change)."""
    return f"{build_id(isa)}-{digest(locations())[:6]}"


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]


def build_inputs(isa: str = "native") -> dict:
    """Everything the compiled library depends on, by name."""
    import torch
    return {"sources": sources_digest(), "cflags": " ".join(CFLAGS + ISAS[isa]), "compiler": compiler(),
            "torch": torch_version(), "cxx11_abi": str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
            "python": sys.version, "native": native_target()}


def locations() -> dict:
    import torch
    return {"sources": os.path.abspath(SOURCES), "torch": os.path.dirname(os.path.abspath(torch.__file__)),
            "python": sysconfig.get_paths()["include"]}


def sources_digest() -> str:
    """The kernels' sources and headers (every file in csrc/, by name and bytes)."""
    sha = hashlib.sha256()
    for name in sorted(os.listdir(SOURCES)):
        with open(os.path.join(SOURCES, name), "rb") as f:
            sha.update(name.encode() + b"\0" + f.read() + b"\0")
    return sha.hexdigest()


def compiler_command() -> str:
    """The C++ compiler torch's extensions build with (`$CXX`, else `c++`)."""
    from torch.utils.cpp_extension import get_cxx_compiler
    return get_cxx_compiler()


def compiler() -> str:
    """The compiler's resolved path and its `--version` ("none" where there is none)."""
    path = shutil.which(compiler_command())
    if path is None:
        return "none"
    return os.path.realpath(path) + "\n" + _run([path, "--version"])


def native_target() -> str:
    """What `-march=native` compiles for here: the compiler's own expansion of it (the line of its
    `-v` output that runs the compiler proper: `-march=<cpu>`, every `-m` instruction set on or off,
    the cache sizes it tunes for). It is exactly what the build's code depends on, which the
    kernel's /proc/cpuinfo flags are not (they list features the compiler never uses, and change
    with the kernel's version); those are the fallback where the compiler says nothing usable."""
    path = shutil.which(compiler_command())
    if path is not None:
        # From "/", with no input file of ours: nothing in the line depends on where we run.
        out = _run([path, "-march=native", "-E", "-v", "-x", "c++", os.devnull, "-o", os.devnull], cwd="/")
        for line in out.splitlines():
            if "-march=" in line and "COLLECT_GCC_OPTIONS" not in line or "-target-cpu" in line:
                return line.strip()
    return cpu_flags()


def _run(command: list, cwd: Optional[str] = None) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed: {exc}"
    return done.stdout + done.stderr


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


def _mtime(path: str) -> Optional[float]:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _touch(build_dir: str) -> None:
    with open(os.path.join(build_dir, USED), "a"):
        pass
    os.utime(os.path.join(build_dir, USED))
    os.utime(build_dir)


def _last_use(path: str) -> float:
    """When a build was last used or begun: its stamp, its directory or torch's lock, the newest."""
    times = []
    for name in (USED, "", "lock"):
        try:
            times.append(os.path.getmtime(os.path.join(path, name)))
        except OSError:
            pass
    return max(times, default=0.0)


def prune(cache_dir: str, keep: int = KEEP, in_use: str = "", older_than_s: float = PRUNE_AFTER_S) -> list:
    """Remove all but the `keep` most recently used builds under `cache_dir` (the names removed).
    Never the one in use, one being built (torch's lock in it), or one used in the last
    `older_than_s`: another process may be on its way into it. Only directories with a build's
    stamp are builds; the files of the single shared build of old are removed the same way."""
    now = time.time()
    builds = [name for name in os.listdir(cache_dir) if os.path.isfile(os.path.join(cache_dir, name, USED))]
    builds.sort(key=lambda name: _last_use(os.path.join(cache_dir, name)), reverse=True)
    removed = []
    for name in builds[keep:]:
        path = os.path.join(cache_dir, name)
        if name == in_use or os.path.exists(os.path.join(path, "lock")) or now - _last_use(path) < older_than_s:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    legacy = os.path.join(cache_dir, NAME + ".so")
    if os.path.exists(legacy) and not os.path.exists(os.path.join(cache_dir, "lock")) \
            and now - os.path.getmtime(legacy) >= older_than_s:
        for name in LEGACY_FILES:
            try:
                os.remove(os.path.join(cache_dir, name))
            except OSError:
                pass
        removed.append(NAME + ".so")
    return removed
