"""The kernel cache (worker/continuous/kernels.py): one build directory per build key, the key
changing with each thing the build depends on and with nothing else, old builds pruned, and a real
build that loads, works, and is reused by the next start."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from worker.continuous import kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fake_compiler(path: pathlib.Path, version: str, cpu: str) -> str:
    """A `c++` that answers `--version` and `-v` as g++ does, with the given version and CPU."""
    path.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in
          *--version*) echo "c++ (Fake) {version}" ;;
          *) echo " /fake/cc1plus -E -quiet -v /dev/null -march={cpu} -mavx2 -mtune=generic" >&2 ;;
        esac
        """))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A copy of csrc/ that the test may change, standing for the kernels' sources."""
    copy = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCES, copy)
    monkeypatch.setattr(kernels, "SOURCES", str(copy))
    return copy


def _key() -> str:
    return kernels.digest(kernels.build_inputs())


def test_the_key_is_stable_and_is_the_fingerprint_s_build_id():
    assert _key() == _key() == kernels.build_id()
    assert kernels.cache_key().startswith(kernels.build_id() + "-")


def test_a_byte_of_a_source_or_a_header_changes_the_key(sources):
    base = _key()
    for name in ("kernels.cpp", "rowwise.h"):
        path = sources / name
        text = path.read_bytes()
        path.write_bytes(text[:-1] + bytes([text[-1] ^ 1]))
        assert _key() != base, name
        path.write_bytes(text)
        assert _key() == base, name


@pytest.mark.parametrize("change", ["cflags", "torch", "abi", "python"])
def test_the_flags_torch_its_abi_and_python_change_the_key(monkeypatch, change):
    base = _key()
    if change == "cflags":
        monkeypatch.setattr(kernels, "CFLAGS", kernels.CFLAGS + ["-DSOMETHING"])
    elif change == "torch":
        monkeypatch.setattr(kernels, "torch_version", lambda: "99.0.0+cpu")
    elif change == "abi":
        monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    else:
        monkeypatch.setattr(sys, "version", "3.99.0 (elsewhere)")
    assert _key() != base


def test_the_compiler_and_what_march_native_means_change_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "c++", "12.2.0", "cooperlake"))
    base = _key()
    assert kernels.native_target().endswith("-march=cooperlake -mavx2 -mtune=generic")
    assert _key() == base
    _fake_compiler(tmp_path / "c++", "13.1.0", "cooperlake")  # another version of the compiler
    assert _key() != base
    _fake_compiler(tmp_path / "c++", "12.2.0", "icelake-server")  # the same compiler, another CPU
    assert _key() != base
    _fake_compiler(tmp_path / "c++", "12.2.0", "cooperlake")
    assert _key() == base
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("CXX", _fake_compiler(other / "c++", "12.2.0", "cooperlake"))  # another path
    assert _key() != base


def test_without_a_compiler_the_cpu_s_flags_stand_for_the_target(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    base = _key()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "fpu sse avx")
    assert kernels.native_target() == "fpu sse avx"
    assert _key() != base


@pytest.mark.parametrize("target, distinct", [
    (" /usr/lib/gcc/cc1plus -march=znver3 -mavx2 -mno-avx512f -mfma", ("native",)),
    (" /usr/lib/gcc/cc1plus -march=cooperlake -mavx2 -mavx512f -mfma", ("native", "avx2")),
    ("fpu sse avx avx2 fma", ("native",)),  # no compiler: the CPU's flags
    ("fpu sse avx avx2 fma avx512f avx512bw", ("native", "avx2"))])
def test_the_avx2_build_is_the_native_one_where_the_cpu_has_no_avx512(monkeypatch, target, distinct):
    """-mno-avx512f changes nothing where -march=native never turned AVX-512 on: there "avx2" is the
    native build (one build, one fingerprint), and the tests that run every build run it once."""
    monkeypatch.setattr(kernels, "native_target", lambda: target)
    kernels.has_avx512.cache_clear()
    try:
        assert kernels.distinct_isas() == distinct
        assert kernels.resolved("avx2") == distinct[-1] and kernels.resolved("native") == "native"
        with pytest.raises(ValueError, match="unknown kernel ISA 'avx512'"):
            kernels.resolved("avx512")
    finally:
        kernels.has_avx512.cache_clear()


def test_here_the_avx2_build_id_is_the_native_one_exactly_when_there_is_no_avx512():
    assert (kernels.build_id("avx2") == kernels.build_id()) == (not kernels.has_avx512())


def test_another_checkout_of_the_same_sources_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    here = kernels.cache_key()
    copy = tmp_path / "checkout" / "csrc"
    shutil.copytree(kernels.SOURCES, copy)
    monkeypatch.setattr(kernels, "SOURCES", str(copy))
    assert _key() == here.split("-")[0]  # the same bits: the same fingerprint
    assert kernels.cache_key() != here  # but build.ninja names the copy's paths: no rebuilding each other's


def _build(cache: pathlib.Path, name: str, used_ago_s: float, lock: bool = False) -> None:
    path = cache / name
    path.mkdir()
    (path / kernels.USED).touch()
    if lock:
        (path / "lock").touch()
    when = time.time() - used_ago_s
    for item in (path / kernels.USED, path / "lock", path):
        if item.exists():
            os.utime(item, (when, when))


def test_pruning_keeps_the_newest_the_one_in_use_one_being_built_and_recent_ones(tmp_path):
    hour = kernels.PRUNE_AFTER_S
    for age, name in enumerate(["a", "b", "c", "d", "e", "f", "g"]):
        _build(tmp_path, name, used_ago_s=(age + 2) * hour, lock=name == "e")
    _build(tmp_path, "fresh", used_ago_s=10)  # the newest: someone is on its way into it
    (tmp_path / "not-a-build").mkdir()  # no stamp: not ours to remove
    (tmp_path / "tokenizer.json").touch()
    removed = kernels.prune(str(tmp_path), keep=3, in_use="g")
    assert sorted(removed) == ["c", "d", "f"]
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "e", "fresh", "g", "not-a-build", "tokenizer.json"]
    assert kernels.prune(str(tmp_path), keep=3, in_use="g") == []  # nothing more to do


def test_pruning_removes_the_old_shared_build_s_files_once_unused(tmp_path):
    for name in kernels.LEGACY_FILES[:-1]:
        (tmp_path / name).touch()
    (tmp_path / "tokenizer.json").touch()
    assert kernels.prune(str(tmp_path)) == []  # just written: maybe an older worker's build
    old = time.time() - kernels.PRUNE_AFTER_S - 1
    os.utime(tmp_path / (kernels.NAME + ".so"), (old, old))
    assert kernels.prune(str(tmp_path)) == [kernels.NAME + ".so"]
    assert os.listdir(tmp_path) == ["tokenizer.json"]


LOAD = """
import json, logging, sys, time, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from worker.continuous import kernels
start = time.monotonic()
module = kernels.build(sys.argv[1])
took = time.monotonic() - start
x, w = torch.randn(3, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
print(json.dumps({"file": module.__file__, "key": kernels.cache_key(), "s": took,
                  "works": torch.allclose(module.rms_norm_rows(x, w, 1e-6), expected)}))
"""


def _start(cache: pathlib.Path) -> tuple[dict, str]:
    """A worker's start, as far as the kernels go: a fresh process builds or loads them."""
    env = {k: v for k, v in os.environ.items() if k != "STORYTELLER_NO_KERNELS"}
    done = subprocess.run([sys.executable, "-c", LOAD, str(cache)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@pytest.mark.slow
def test_a_real_build_loads_works_is_reused_and_prunes_old_builds(tmp_path):
    for age, name in enumerate(["old1", "old2", "old3"]):
        _build(tmp_path, name, used_ago_s=(age + 2) * kernels.PRUNE_AFTER_S)
    first, log = _start(tmp_path)
    assert "building the C++ kernels (once per build key, ~40 s on 2 cores, more on older CPUs)" in log
    assert "built the C++ kernels in" in log
    build = tmp_path / first["key"]
    assert first["works"] and pathlib.Path(first["file"]).parent == build
    assert json.loads((build / "inputs.json").read_text()) == kernels.build_inputs()
    assert sorted(os.listdir(tmp_path)) == sorted([first["key"], "old1", "old2"])  # the newest 3
    ninja_log = (build / ".ninja_log").read_text()
    library = (build / (kernels.NAME + ".so")).stat().st_mtime_ns

    second, log = _start(tmp_path)
    assert second["works"] and second["file"] == first["file"]
    assert "building" not in log and "built" not in log
    assert (build / ".ninja_log").read_text() == ninja_log  # ninja ran nothing
    assert (build / (kernels.NAME + ".so")).stat().st_mtime_ns == library
    # Loaded, not built: the ninja log and the library's time above say so; the time only has to
    # stay under a build's (~40 s on 2 quiet cores), with room for a loaded machine.
    assert second["s"] < 30, second
