"""The bodies OpenAI's API answers with, for completions and chat, whole or streamed."""
from __future__ import annotations

import json
import time
from typing import Optional

from api import tools
from api.logprobs import Rendering
from shared.protocol import Final


class Shape:
    """Builds one request's answer bodies; `chat` picks chat.completion over text_completion."""

    def __init__(self, request_id: str, model: str, chat: bool,
                 tool_spec: Optional[tools.ToolSpec] = None):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.chat = chat
        self.tool_spec = tool_spec  # a chat with tools: a reply may be a call (api/tools.py)
        self.created = int(time.time())
        self.rendering: Optional[Rendering] = None  # logprobs and echo (api/logprobs.py): api/answer.py sets it
        self.n = 1  # choices per prompt (usage counts each prompt's cached tokens once)
        # What of the request's schema is not enforced (strict not asked: api/grammars.LENIENT),
        # said in every body as `unenforced`, absent when all of it is.
        self.unenforced: tuple = ()

    def _envelope(self, object_name: str, choices: list, usage_body: Optional[dict] = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage_body is not None:
            body["usage"] = usage_body
        if self.unenforced:
            body["unenforced"] = list(self.unenforced)
        return body

    def whole(self, finals: list[Final], prompt_tokens: int) -> dict:
        r = self.rendering
        if self.chat:
            choices = [{"index": i, **self._reply(f), "logprobs": r.whole(i, f) if r else None}
                       for i, f in enumerate(finals)]
            return self._envelope("chat.completion", choices, usage(prompt_tokens, finals, self.n))
        choices = [{"text": r.text(i, f.text) if r else f.text, "index": i,
                    "logprobs": r.whole(i, f) if r else None, "finish_reason": f.finish_reason}
                   for i, f in enumerate(finals)]
        return self._envelope("text_completion", choices, usage(prompt_tokens, finals, self.n))

    def _reply(self, final: Final) -> dict:
        """A chat choice's message and finish_reason: with tools, a whole call is message.tool_calls."""
        if self.tool_spec is None:
            return {"message": {"role": "assistant", "content": final.text}, "finish_reason": final.finish_reason}
        content, calls, finish_reason = tools.read_reply(final.text, final.finish_reason, self.tool_spec)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "finish_reason": finish_reason}

    def chunk(self, index: int, text: Optional[str] = None, finish_reason: Optional[str] = None,
              first: bool = False, fields: Optional[dict] = None, logprobs: Optional[dict] = None) -> dict:
        """`fields`: the chat delta's other fields (content or tool_calls: api/tools.CallReader);
        `logprobs`: those of the chunk's text (api/logprobs.Rendering.piece)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            delta.update(fields or {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, finals: list[Final], prompt_tokens: int) -> dict:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(name, [], usage(prompt_tokens, finals, self.n))


def usage(prompt: int, finals: list[Final], n: int = 1) -> dict:
    """`prompt` counts each prompt once, however many choices (n) were written from it, and so do
    its cached tokens: of a prompt's n choices (finals in prompt order), the most its workers' prefix
    caches held."""
    completion = sum(f.completion_tokens for f in finals)
    cached = [f.cached_tokens if f is not None else 0 for f in finals]
    cached_tokens = sum(max(cached[i:i + n]) for i in range(0, len(cached), n))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
