"""GGUF files made here, with llama.cpp's own tools, for the tests: nothing is downloaded but PyPI.

Users bring GGUF files that llama.cpp's converter and quantizer made; the reader must take those,
not files written by a writer of our own. So the tests make theirs the same way:

- the tiny random model of each family (tests/tiny_models.py, SmolLM2's tokenizer) is saved as a
  Hugging Face directory and converted to F16 with `convert_hf_to_gguf.py`, from the
  llama-cpp-python 0.3.36 source distribution (only the converter and its gguf-py are unpacked,
  once per machine, into ~/.cache/storyteller);
- the F16 file is quantized with llama.cpp's portable `llama-quantize` (../shared/bin, or
  $LLAMA_QUANTIZE) to the types model hubs serve;
- the packaged SmolLM2-135M Q4_1 file is requantized the same way (`--allow-requantize`).

Every file is made once into the cache, under a key of everything it is made from (tiny_models.py
and this file's bytes, the versions of transformers and the converter, the quantizer's size), and
written aside then renamed, so concurrent or interrupted runs never see half a file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONVERTER_VERSION = "0.3.36"  # llama-cpp-python's sdist, which vendors llama.cpp's converter
CACHE = Path(os.environ.get("STORYTELLER_GGUF_CACHE", "~/.cache/storyteller/gguf-test-files")).expanduser()
# What model hubs serve: Q4_K_M mixes Q4_K and Q6_K tensors (and Q5_0/Q8_0 where K-blocks don't fit).
TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
SMOLLM2_TYPES = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0")


def quantizer() -> Path:
    """llama.cpp's llama-quantize: $LLAMA_QUANTIZE, or the portable build beside the repository
    (../shared/bin), or else one built here from the same source distribution, once per machine
    (cmake, a few minutes on 2 cores): a clone with nothing beside it still makes its files."""
    given = os.environ.get("LLAMA_QUANTIZE")
    path = Path(given) if given else REPO.parent / "shared" / "bin" / "llama-quantize"
    if os.access(path, os.X_OK):
        return path
    if given:
        raise FileNotFoundError(f"LLAMA_QUANTIZE={given}: not an executable")
    return _built_quantizer()


def _sdist() -> Path:
    """llama-cpp-python's source distribution (76 MB), fetched with the venv's pip once per machine."""
    target = CACHE / f"llama_cpp_python-{CONVERTER_VERSION}.tar.gz"
    if target.is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={CONVERTER_VERSION}", "-d", tmp], check=True)
        os.replace(next(Path(tmp).glob("llama_cpp_python-*.tar.gz")), target)
    return target


def _unpack(target: Path, wanted: tuple[str, ...]) -> Path:
    """The sdist's vendor/llama.cpp paths starting with `wanted` (all of it for ""), as `target`."""
    prefix = f"llama_cpp_python-{CONVERTER_VERSION}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(_sdist()) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(tuple(prefix + w for w in wanted))]
            archive.extractall(unpacked, members=members, filter="data")
        try:
            os.replace(unpacked / prefix, target)
        except OSError:  # another run was first
            if not target.is_dir():
                raise
    return target


def _built_quantizer() -> Path:
    """llama-quantize built from the sdist as ../shared/bin's was (portable, static)."""
    source = CACHE / f"llama.cpp-source-{CONVERTER_VERSION}"
    binary = source / "build" / "bin" / "llama-quantize"
    if os.access(binary, os.X_OK):
        return binary
    if not (source / "CMakeLists.txt").is_file():
        _unpack(source, ("",))
    print(f"building llama-quantize from llama-cpp-python {CONVERTER_VERSION}'s source (once)...", flush=True)
    _run(["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"])
    _run(["cmake", "--build", str(source / "build"), "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)])
    return binary


def converter() -> Path:
    """The directory holding convert_hf_to_gguf.py, its conversion/ package and gguf-py."""
    target = CACHE / f"llama.cpp-converter-{CONVERTER_VERSION}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    return _unpack(target, ("convert_hf_to_gguf.py", "conversion/", "gguf-py/"))


# The converter run in a wrapper for one reason: transformers tokenizes a qwen2 directory with Qwen's
# own split regex whatever its tokenizer.json says (qwen2 is in tokenization_auto's
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), so the converter's fingerprint of SmolLM2's vocabulary
# split Qwen's way is one it does not know. Naming that split "qwen2" is what the directory does.
_CONVERT = """
import os, runpy, sys
script = sys.argv[1]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if self.hf_arch.startswith("Qwen2"):
            return "qwen2"
        raise
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def convert(directory: Path, out: Path) -> Path:
    """A Hugging Face directory as an F16 GGUF, by llama.cpp's converter."""
    script = converter() / "convert_hf_to_gguf.py"
    env = dict(os.environ, PYTHONPATH=str(converter() / "gguf-py"), NO_LOCAL_GGUF="1")
    _made(out, lambda tmp: _run([sys.executable, "-c", _CONVERT, str(script), "--outtype", "f16",
                                 "--outfile", str(tmp), str(directory)], env))
    return out


def quantize(source: Path, out: Path, qtype: str) -> Path:
    """`source` requantized to `qtype` by llama-quantize (F16 too: the type names are its own)."""
    _made(out, lambda tmp: _run([str(quantizer()), "--allow-requantize", str(source), str(tmp), qtype]))
    return out


def _run(command: list[str], env: dict | None = None) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _made(out: Path, make) -> None:
    """make(tmp) writes a file; it becomes `out` only once whole."""
    if out.is_file():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        make(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _key(*parts) -> str:
    digest = hashlib.sha256()
    for part in (CONVERTER_VERSION, transformers.__version__, os.path.getsize(quantizer()),
                 (HERE / "tiny_models.py").read_bytes(), Path(__file__).read_bytes(), *parts):
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def family_directory(kind: str, tokenizer) -> Path:
    """The tiny `kind` model (tiny_models.save_family, seed 0) as the Hugging Face directory the
    GGUF files are converted from."""
    from tests.tiny_models import save_family
    root = CACHE / f"{kind}-{_key(kind, len(tokenizer))}"
    directory = root / kind  # the converter names the model after its directory
    if (root / "complete").is_file():
        return directory
    shutil.rmtree(root, ignore_errors=True)
    save_family(kind, str(directory), tokenizer)
    if kind == "phi3":
        # The converter reads a Phi-3 vocabulary from sentencepiece's tokenizer.model unless the
        # tokenizer says it is GPT-2's byte-level BPE, as Phi-4's does; SmolLM2's is (transformers
        # picks Phi-3's tokenizer class by model type anyway, so this changes nothing it loads).
        config = directory / "tokenizer_config.json"
        settings = json.loads(config.read_text())
        config.write_text(json.dumps(dict(settings, tokenizer_class="GPT2Tokenizer"), indent=2))
    (root / "complete").write_text("")
    return directory


def family_gguf(kind: str, tokenizer, qtype: str) -> Path:
    """The tiny `kind` model as a GGUF file of `qtype` (one of TYPES)."""
    directory = family_directory(kind, tokenizer)
    f16 = convert(directory, directory.parent / f"{kind}.F16.gguf")
    return f16 if qtype == "F16" else quantize(f16, directory.parent / f"{kind}.{qtype}.gguf", qtype)


def smollm2_gguf(qtype: str) -> Path:
    """The packaged SmolLM2-135M-Instruct requantized from its Q4_1 file to `qtype`, as
    SmolLM2-135M-Instruct.{qtype}.gguf (the worker names the model after the file's stem)."""
    from worker.model_loader import PACKAGED_FILE, packaged_model_dir
    source = Path(packaged_model_dir()) / PACKAGED_FILE
    root = CACHE / f"smollm2-{_key(source.stat().st_size)}"
    return quantize(source, root / f"SmolLM2-135M-Instruct.{qtype}.gguf", qtype)
