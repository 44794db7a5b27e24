"""The models' tokenizers, as each worker stored them in Redis, loaded once per API process."""
from __future__ import annotations

import os
import tempfile
import threading
from typing import Optional

import jinja2
import jinja2.meta
import llguidance
import llguidance.hf
from transformers import AutoTokenizer

from api import tools
from shared import keys
from shared.protocol import WorkerInfo


class Tokenizer:
    """Counts and templates prompts. One lock: a fast tokenizer is not safe to call from two threads."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self.takes_tools = _template_reads_tools(hf_tokenizer.chat_template)

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
            text = self._tok.apply_chat_template(messages, tools=tool_list, tokenize=False,
                                                 add_generation_prompt=True)
            # The template writes the special tokens itself.
            return self._tok(text, add_special_tokens=False).input_ids

    def llguidance(self) -> llguidance.LLTokenizer:
        """llguidance's view of this tokenizer, for checking grammars (api/grammars.py): built once
        (~0.3 s for SmolLM2's 49,152 tokens, holding Python's lock), over len(tokenizer) tokens."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tok, n_vocab=len(self._tok))
            return self._ll_tokenizer


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
