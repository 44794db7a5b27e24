"""What transformers derives from a GGUF file, its tokenizer and its config, made in a child process
and kept on disk beside the other per-machine files (`--cache-dir`).

Why a child: building either imports transformers' family config classes (LlamaConfig, Qwen2Config...),
and those import transformers' activations, hub kernels, torch.distributed.tensor, dynamo and sympy,
~90 MiB that a worker would hold for ever and never run (docs/serving.md, "The worker's memory").
The child pays it and exits; the worker reads the files back: the tokenizer with AutoTokenizer from
plain tokenizer files, the config as a subclass of transformers' base PreTrainedConfig holding the
family class's values, every one (to_dict's). The first start on a file waits for the child (a few
seconds, most of it the tokenizer's building, which the worker did itself before); later starts
read the files (0.5 s for the packaged SmolLM2).

A file the engine's reader refuses (gguf_config.UnsupportedGGUF) still gets its tokenizer (the
static engine may run it): the refusal is kept as text beside it and handed back, not raised; so
is a tokenizer that cannot be built, the engine's refusal being the first fault to report.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CONFIG_FILE = "gguf-config.json"  # not config.json: AutoTokenizer would read that, and import its class
REFUSAL_FILE = "unsupported.txt"
TOKENIZER_ERROR_FILE = "tokenizer-error.txt"
_HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger(__name__)
# What the derived files depend on besides the GGUF file itself: a change to either makes new ones.
_SOURCES = (os.path.join(_HERE, "continuous", "gguf_config.py"), os.path.join(_HERE, "gguf_derived.py"))


class CannotDerive(RuntimeError):
    """The child died before it wrote the files; the message is its last words."""


@dataclass
class Derived:
    tokenizer: object  # transformers' tokenizer, None where it could not be built
    tokenizer_error: str  # why not, in one line
    config: object  # transformers' PreTrainedConfig with the family class's values, None where refused
    refusal: str  # the engine's reader's UnsupportedGGUF message for this file, or ""


def read(path: str, cache_dir: str) -> Derived:
    """What transformers derives from the GGUF file at `path`, made in a child once per file into
    cache_dir, or every start into a temporary directory where cache_dir is unset or read-only."""
    if cache_dir:
        cached = os.path.join(os.path.expanduser(cache_dir), f"gguf-{_key(path)}")
        if not os.path.isdir(cached):
            _derive_into(path, cached)
        if os.path.isdir(cached):
            try:
                return _read(cached)
            except (OSError, ValueError) as exc:  # damaged: made aside this time, kept again next start
                log.warning("%s unreadable (%s): removed", cached, exc)
                shutil.rmtree(cached, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="gguf-derived-") as tmp:
        _run_child(path, tmp)
        return _read(tmp)


def _derive_into(path: str, cached: str) -> None:
    partial = f"{cached}.{os.getpid()}"  # written aside, then renamed: a reader never sees half
    try:
        os.makedirs(partial, exist_ok=True)
        _run_child(path, partial)
        os.replace(partial, cached)
    except OSError as exc:  # another worker was first, or the cache cannot be written
        if not os.path.isdir(cached):
            log.warning("cannot keep %s's tokenizer and config in %s (%s): they are made again at every start",
                        os.path.basename(path), os.path.dirname(cached), exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _read(directory: str) -> Derived:
    from transformers import AutoTokenizer
    found = {name: _text(directory, name) for name in (REFUSAL_FILE, TOKENIZER_ERROR_FILE)}
    return Derived(
        tokenizer=None if found[TOKENIZER_ERROR_FILE] else AutoTokenizer.from_pretrained(directory),
        tokenizer_error=found[TOKENIZER_ERROR_FILE],
        config=None if found[REFUSAL_FILE] else _config(os.path.join(directory, CONFIG_FILE)),
        refusal=found[REFUSAL_FILE])


def _config(path: str):
    """The family class's values on transformers' base config class, named for its model_type (which
    to_dict takes from the class), with what the base class drops on the way in (use_cache) put back."""
    from transformers import PreTrainedConfig
    with open(path) as f:
        values = json.load(f)
    family = type(f"GGUF{values['model_type'].title()}Config", (PreTrainedConfig,), {"model_type": values["model_type"]})
    config = family.from_dict(values)
    for key, value in values.items():
        if not hasattr(config, key):
            setattr(config, key, value)
    return config


def _text(directory: str, name: str) -> str:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _key(path: str) -> str:
    real = os.path.realpath(path)  # a link shares its file's
    stat = os.stat(real)
    hasher = hashlib.sha256(f"{real}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    hasher.update(importlib.metadata.version("transformers").encode())
    for source in _SOURCES:
        with open(source, "rb") as f:
            hasher.update(f.read())
    return hasher.hexdigest()[:16]


def _run_child(path: str, out: str) -> None:
    root = os.path.dirname(_HERE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "worker.gguf_derived", path, out], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise CannotDerive(lines[-1] if lines else f"the child exited with {done.returncode}")


def _derive(path: str, out: str) -> None:
    """In the child: the config (or the refusal), then the tokenizer (or why not)."""
    from transformers import AutoTokenizer

    from worker.continuous.gguf_config import UnsupportedGGUF
    from worker.continuous.gguf_reader import read_config
    from worker.model_loader import one_line
    try:
        read_config(path).to_json_file(os.path.join(out, CONFIG_FILE))
    except UnsupportedGGUF as exc:
        _write(out, REFUSAL_FILE, str(exc))
    directory, name = os.path.split(path)
    try:
        AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
        # Read back as the family's class (GemmaTokenizer, Qwen2Tokenizer), the saved tokenizer is
        # rebuilt by that class's own pipeline, not the one the file's vocabulary was given: measured,
        # another text's ids for the tiny qwen3 and gemma3 files. As the plain backend it is
        # tokenizer.json exactly: the ids, special tokens and chat template the file's build gave.
        config_path = os.path.join(out, "tokenizer_config.json")
        with open(config_path) as f:
            tokenizer_config = json.load(f)
        with open(config_path, "w") as f:
            json.dump({**tokenizer_config, "tokenizer_class": "TokenizersBackend"}, f, indent=2)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer's builders raise, in one line
        _write(out, TOKENIZER_ERROR_FILE, one_line(exc))


def _write(directory: str, name: str, text: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(text)


if __name__ == "__main__":
    _derive(sys.argv[1], sys.argv[2])
