"""The models' tokenizers, as each worker stored them in Redis, loaded once per API process."""
from __future__ import annotations

import os
import tempfile
import threading

from transformers import AutoTokenizer

from shared import keys
from shared.protocol import WorkerInfo


class Tokenizer:
    """Counts and templates prompts. One lock: a fast tokenizer is not safe to call from two threads."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._tok(text).input_ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        with self._lock:
            if not self._tok.chat_template:
                raise ValueError("this model has no chat template: use /v1/completions")
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template writes the special tokens itself.
            return self._tok(text, add_special_tokens=False).input_ids


class TokenizerCache:
    def __init__(self, client):
        self._redis = client
        self._loaded: dict[str, tuple[str, Tokenizer]] = {}
        self._lock = threading.Lock()

    def get(self, worker: WorkerInfo) -> Tokenizer:
        with self._lock:
            cached = self._loaded.get(worker.model)
            if cached is None or cached[0] != worker.tokenizer_digest:
                cached = (worker.tokenizer_digest, self._load(worker.model))
                self._loaded[worker.model] = cached
            return cached[1]

    def _load(self, model: str) -> Tokenizer:
        files = self._redis.hgetall(keys.tokenizer(model))
        if not files:
            raise LookupError(f"no tokenizer stored for {model}")
        with tempfile.TemporaryDirectory() as tmp:
            for name, content in files.items():
                with open(os.path.join(tmp, os.path.basename(name.decode())), "wb") as f:
                    f.write(content)
            return Tokenizer(AutoTokenizer.from_pretrained(tmp))
