"""The models' tokenizers, as each worker stored them in Redis, loaded once per API process."""
from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Optional

import jinja2
import jinja2.meta
import llguidance
import llguidance.hf
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte-level alphabet

from api import tool_formats, tools
from shared import keys
from shared.protocol import WorkerInfo


class Tokenizer:
    """Counts and templates prompts. One lock: a fast tokenizer is not safe to call from two threads."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self.takes_tools = _template_reads_tools(hf_tokenizer.chat_template)
        # The call syntax the model was trained on (api/tool_formats.py): what grammars ask for.
        self.tool_format = tool_formats.detect(hf_tokenizer.chat_template, self.takes_tools)
        self._byte_decoder: Optional[dict] = None  # token_bytes', made at its first use

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._tok(text).input_ids

    def encode_chat(self, messages: list[dict], tool_spec: Optional[tools.ToolSpec] = None) -> list[int]:
        """The conversation through the chat template, with the tools shown as api/tools.py says
        (the template's own way if it reads `tools`, else a system message of the API's)."""
        messages, tool_list = tools.template_messages(messages, tool_spec, native=self.takes_tools)
        with self._lock:
            if not self._tok.chat_template:
                raise ValueError("this model has no chat template: use /v1/completions")
            try:
                text = self._tok.apply_chat_template(messages, tools=tool_list, tokenize=False,
                                                     add_generation_prompt=True)
            except jinja2.TemplateError as exc:  # its raise_exception(), e.g. Llama 3's one call a turn
                raise ValueError(f"this model's chat template refuses the conversation: {exc}") from exc
            # The template writes the special tokens itself.
            return self._tok(text, add_special_tokens=False).input_ids

    def llguidance(self) -> llguidance.LLTokenizer:
        """llguidance's view of this tokenizer, for checking grammars (api/grammars.py): built once
        (~0.3 s for SmolLM2's 49,152 tokens, holding Python's lock), over len(tokenizer) tokens."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tok, n_vocab=len(self._tok))
            return self._ll_tokenizer

    def decode(self, ids: list[int]) -> str:
        """Token ids' text (a completions prompt given as ids, for echo), special tokens left out."""
        with self._lock:
            return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (its piece of the text; a byte-level token's may be part of a
        character), for logprobs' `token` and `bytes` (api/logprobs.py)."""
        with self._lock:
            if self._byte_decoder is None:
                self._byte_decoder = _byte_decoder(self._tok)
            pieces = self._tok.convert_ids_to_tokens(ids)
        return [_piece_bytes(piece, self._byte_decoder) for piece in pieces]


def _byte_decoder(hf_tokenizer) -> dict:
    """Byte-level BPE's map from its vocabulary's characters back to bytes (GPT-2's, as SmolLM2 and
    Llama 3 use); {} for other tokenizers (SentencePiece's pieces, with their <0xHH> byte tokens)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.decoder.__getstate__()) if backend is not None and backend.decoder else {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
    return {char: byte for byte, char in bytes_to_unicode().items()} if "ByteLevel" in kinds else {}


def _piece_bytes(piece: Optional[str], byte_decoder: dict) -> bytes:
    if piece is None:  # an id past the tokenizer's own (a padded vocabulary)
        return b""
    if byte_decoder and all(char in byte_decoder for char in piece):
        return bytes(byte_decoder[char] for char in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary is a space


def _template_reads_tools(template) -> bool:
    """Whether a chat template (or any of several, by name) uses the `tools` variable."""
    templates = template.values() if isinstance(template, dict) else [template] if template else []
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])

    def reads_tools(text: str) -> bool:
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(env.parse(text))
        except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %})
            return "tools" in text
    return any(reads_tools(t) for t in templates)


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
