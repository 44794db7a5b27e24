"""llama.cpp, built here, and the GGUF files the side-by-side benchmarks run it and Storyteller on.

A speed or accuracy comparison with llama.cpp is only fair against llama.cpp as its users run it:
built native for this CPU (`-DGGML_NATIVE=ON`, Release) and fed the Q4_K_M files model hubs serve.
Nothing is downloaded but PyPI (project rule), so:

- `llama-server` and `llama-perplexity` are built from the vendor/llama.cpp of the same
  llama-cpp-python 0.3.36 source distribution that tests/gguf_files.py converts with, once per
  machine into ~/.cache/storyteller/llama-cpp-native-<hash of the CPU's flags and the version>/
  (about 7 minutes on 2 cores; the CPU's flags are in the key because a native build may use
  instructions another CPU lacks). Where the CPU lists AMX, a probe runs the build's products
  once; if they die there (a VM that keeps AMX from its guests), a second build without AMX
  (`-noamx`) is what the benchmarks run;
- the model files are random models of the real models' shapes (a random model runs exactly as
  fast as a trained one of its shape), converted and quantized by llama.cpp's own converter and
  quantizer (tests/gguf_files.py's functions), plus the packaged SmolLM2-135M requantized;
- each Q4_K_M file has a "float reference": the same file dequantized to F32 by llama-quantize,
  so that an accuracy comparison measures what the engine does to the file's weights, not what the
  quantizer did to a model neither side has.

`python -m bench.llama_cpp` builds everything once and prints the paths.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests import gguf_files
from worker.continuous.kernels import cpu_flags

CACHE = Path("~/.cache/storyteller").expanduser()
TARGETS = ("llama-server", "llama-perplexity")


# A CPU that lists AMX may still not run it: in a virtual machine whose host keeps the tiles'
# state from its guests, ggml's AMX products die on their first instruction (SIGILL, or SIGSEGV
# in ggml_backend_amx_mul_mat; seen on a 2-core Xeon VM). A native build is then made again with
# AMX switched off (gcc: an -mno- flag holds against -march=native), the rest of the CPU kept.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_dir(amx: bool = True) -> Path:
    """Where this CPU's native build lives: a new CPU (or sdist version) gets a build of its own."""
    key = hashlib.sha256(f"{cpu_flags()}\0{gguf_files.CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return CACHE / f"llama-cpp-native-{key}{'' if amx else '-noamx'}"


def _binary(name: str) -> Path:
    return _usable_build() / "build" / "bin" / name


def _usable_build() -> Path:
    """The native build, or, where its AMX products cannot run here, the build without them."""
    native = build()
    if "amx_int8" not in cpu_flags().split() or (native / "amx-runs").is_file():
        return native
    if (native / "amx-fails").is_file() or not _amx_runs(native):
        return build(amx=False)
    return native


def _amx_runs(root: Path) -> bool:
    """Whether the build's products run on a prompt big enough for ggml's AMX path (128 tokens of
    the packaged SmolLM2 in Q4_K_M through llama-perplexity); the answer is kept in the build."""
    text = root / "amx-probe.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 40))
    command = [str(root / "build" / "bin" / "llama-perplexity"), "-m", str(gguf_files.smollm2_gguf("Q4_K_M")),
               "-f", str(text), "-c", "128", "--chunks", "1", "-t", "2"]
    code = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    runs = code >= 0  # killed by a signal: the products cannot run here
    (root / ("amx-runs" if runs else "amx-fails")).write_text(f"{' '.join(command)}\nexit {code}\n")
    if not runs:
        print(f"llama.cpp's AMX products die here (signal {-code}): building it again without AMX", flush=True)
    return runs


def build(amx: bool = True) -> Path:
    """llama-server and llama-perplexity built native (without AMX if `amx` is false), once per
    machine; the build's directory.

    The sources are unpacked inside the build's own directory (not tests/gguf_files.py's portable
    source tree), so that a native and a portable build never share a CMake cache. "complete" is
    written last: a build cut short is taken up again by the next call (cmake is incremental)."""
    root = build_dir(amx)
    if (root / "complete").is_file() and all(os.access(root / "build" / "bin" / t, os.X_OK) for t in TARGETS):
        return root
    root.mkdir(parents=True, exist_ok=True)
    source = root / "source"
    if not (source / "CMakeLists.txt").is_file():
        gguf_files.CACHE.mkdir(parents=True, exist_ok=True)
        gguf_files._unpack(source, ("",))
    print(f"building llama.cpp {' and '.join(TARGETS)} native{'' if amx else ' without AMX'} from "
          f"llama-cpp-python {gguf_files.CONVERTER_VERSION} into {root} (once per machine, ~7 min on 2 cores)...",
          flush=True)
    started = time.monotonic()
    log = root / "build.log"
    flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    with open(log, "w") as out:
        for command in (
            ["cmake", "-S", str(source), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *flags],
            # -j2: the machines this runs on have 2 cores, shared with whatever else they build
            ["cmake", "--build", str(root / "build"), "--target", *TARGETS, "-j", "2"],
        ):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"{command[:2]} failed; see {log}")
    (root / "complete").write_text("")
    print(f"built in {time.monotonic() - started:.0f} s (log: {log})", flush=True)
    return root


def build_name() -> str:
    """The build the benchmarks run: its directory's name (`-noamx` where AMX could not run)."""
    return _usable_build().name


def llama_server() -> Path:
    return _binary("llama-server")


def llama_perplexity() -> Path:
    return _binary("llama-perplexity")


# --- the model files -----------------------------------------------------------------------------

# The real models' shapes, as their config.json files give them, with random weights. Qwen2.5's
# vocabulary (151,936) needs Qwen's tokenizer, which nothing here ships: the Qwen-shaped model
# takes SmolLM2's tokenizer and its 49,152 entries instead, so its embedding and head are ~3x
# smaller than Qwen2.5-1.5B's (its 28 layers, the bulk of the work per token, are Qwen's own).
SHAPES = {
    "smollm2-1.7b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters=dict(rope_type="default", rope_theta=130000.0))),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                   rms_norm_eps=1e-6, tie_word_embeddings=True,  # q/k/v biases: Qwen2's own
                                   rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
}
PACKAGED_SHAPE = "smollm2-135m"  # the packaged SmolLM2-135M-Instruct, requantized (tests/gguf_files.py)
SHAPE_NAMES = (PACKAGED_SHAPE, *SHAPES)
SEED = 0
BENCH_FILES = CACHE / "bench-gguf"


def smollm2_tokenizer():
    """The packaged SmolLM2's tokenizer, as its worker builds it from the GGUF file (cached)."""
    from shared.settings import Settings
    from worker.model_loader import PACKAGED_FILE, _tokenizer, packaged_model_dir
    return _tokenizer(packaged_model_dir(), {"gguf_file": PACKAGED_FILE}, Settings().cache_dir)


def _config(shape: str, tokenizer):
    from transformers import LlamaConfig, Qwen2Config
    family, dims = SHAPES[shape]
    eos = tokenizer.eos_token_id
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id or eos, eos_token_id=eos,
               pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    return (LlamaConfig if family == "llama" else Qwen2Config)(**dims, **ids)


def _shape_key(shape: str, tokenizer) -> str:
    """What a file is made from: the shape, the seed, the tokenizer's size and the tools' versions
    (not this file's bytes: remaking 7 GB of files for an edit of a comment would be a waste)."""
    import transformers
    parts = (shape, repr(SHAPES[shape]), SEED, len(tokenizer), gguf_files.CONVERTER_VERSION,
             transformers.__version__, os.path.getsize(gguf_files.quantizer()))
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:12]


def _save_random(shape: str, directory: Path, tokenizer) -> None:
    """A random model of `shape` as a Hugging Face directory (bf16 safetensors, as the real ones
    are published). transformers' own init: normal(0, 0.02) matrices, ones for the norms, zero
    biases; torch.manual_seed makes it the same model on every machine."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(_config(shape, tokenizer), dtype=torch.bfloat16).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def model_file(shape: str) -> Path:
    """The Q4_K_M GGUF file of `shape` (one of SHAPE_NAMES), made once per machine: a random model
    saved, converted to F16 by llama.cpp's converter, quantized by llama-quantize. Its stem names
    the model the worker serves (smollm2-1.7b-random.Q4_K_M)."""
    if shape == PACKAGED_SHAPE:
        return gguf_files.smollm2_gguf("Q4_K_M")
    tokenizer = smollm2_tokenizer()
    root = BENCH_FILES / f"{shape}-{_shape_key(shape, tokenizer)}"
    out = root / f"{shape}-random.Q4_K_M.gguf"
    if out.is_file():
        return out
    name = f"{shape}-random"
    directory = root / name  # the converter names the model after its directory
    f16 = root / f"{name}.F16.gguf"
    if not f16.is_file():
        if not (root / "saved").is_file():
            print(f"making the random {shape} model (once per machine; minutes)...", flush=True)
            shutil.rmtree(directory, ignore_errors=True)
            _save_random(shape, directory, tokenizer)
            (root / "saved").write_text("")
        print(f"converting {shape} to F16 with llama.cpp's converter...", flush=True)
        gguf_files.convert(directory, f16)
    print(f"quantizing {shape} to Q4_K_M...", flush=True)
    gguf_files.quantize(f16, out, "Q4_K_M")
    # The F16 file and the directory are only steps on the way: ~7 GB for the 1.7B shape.
    f16.unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    (root / "saved").unlink(missing_ok=True)
    return out


def float_reference(path: Path) -> Path:
    """`path`'s own weights dequantized to F32 by llama-quantize, beside it (X.f32-of-<type>.gguf):
    the reference an accuracy measure compares the quantized file's outputs with, so that it
    measures the engine's arithmetic, not the quantization both sides share."""
    stem, _, qtype = Path(path).stem.rpartition(".")
    out = Path(path).with_name(f"{stem}.f32-of-{qtype.lower()}.gguf")
    # Beside a packaged file (inside the venv) nothing is written: its reference goes to the cache.
    if "site-packages" in str(out) or not os.access(out.parent, os.W_OK):
        out = BENCH_FILES / "references" / out.name
    if not out.is_file():
        print(f"dequantizing {Path(path).name} to F32 (its float reference)...", flush=True)
    return gguf_files.quantize(Path(path), out, "F32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build llama.cpp native and make the benchmarks' GGUF files (once).")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPE_NAMES), choices=SHAPE_NAMES,
                    help="the model files to make (none: only build llama.cpp)")
    ap.add_argument("--no-build", action="store_true", help="make the files only")
    args = ap.parse_args(argv)
    if not args.no_build:
        print(f"llama-server: {llama_server()}\nllama-perplexity: {llama_perplexity()}", flush=True)
    for shape in args.shapes:
        path = model_file(shape)
        print(f"{shape}: {path}\n{shape} float reference: {float_reference(path)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
