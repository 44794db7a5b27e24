"""A reply with tools read back as OpenAI's `tool_calls`, whole or as it is written (the stream's
tool-call deltas), in the model's call format (api/tool_formats.py).

A call is a JSON object `{"name": <function>, "<arguments key>": {...}}`. Its head, up to the
arguments' object, is held back until the name is known (the first delta carries it, with the
call's id); the arguments' object is then passed on as it comes, tracked to its closing brace;
the call's own closing brace is dropped. Whitespace between the JSON's tokens is allowed.

Where the call is the whole reply ("json", "llama3"), a reply is a call when its first non-space
character is "{" (with "required" or a named function, always). Where calls are tagged ("hermes"),
text before a call is content, streamed as it comes except for a tail that may be the start of
`<tool_call>` (or whitespace before it), held back until it is known; each tag opens a call of its
own (index 0, 1, ...). A reply that turns out not to be a call (a worker that wrote past the
grammar: not expected) goes out as content: nothing is lost.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional

WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""     # the arguments' text so far
    complete: bool = False  # the call's object closed


class _CallObject:
    """One call's JSON object as it is written. `state`: "head" (held back: `raw`), "arguments",
    "close" (after the arguments, before the object's "}"), "done", or "not a call"."""

    def __init__(self, heads: dict):
        self.heads = heads  # name -> the call's head, whitespace left out
        self.state, self.raw, self.name = "head", "", None
        self.arguments_closed = False
        self._squeezed = ""
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> tuple[list, Optional[str]]:
        """[("name", n)] once the name is known, [("arguments", piece)] as they come, and, once the
        object has closed, the text after it (None before)."""
        events: list = []
        if self.state == "head":
            self.raw += text
            text = self._read_head(text)
            if text is None:
                return events, None
            events.append(("name", self.name))
        if self.state == "arguments":
            piece, text = self._read_arguments(text)
            if piece:
                events.append(("arguments", piece))
        if self.state == "close":
            rest = text.lstrip(WHITESPACE)
            if not rest:
                return events, None
            self.state = "done"
            return events, rest[1:] if rest[0] == "}" else rest
        return events, None

    def _read_head(self, text: str) -> Optional[str]:
        for i, char in enumerate(text):
            if char in WHITESPACE:
                continue
            self._squeezed += char
            for name, head in self.heads.items():
                if self._squeezed == head:
                    self.name, self.state = name, "arguments"
                    return text[i + 1:]
            if not any(head.startswith(self._squeezed) for head in self.heads.values()):
                self.state = "not a call"
                return None
        return None

    def _read_arguments(self, text: str) -> tuple[str, str]:
        """(the part of `text` in the arguments' object, the text after it)."""
        start = None
        for i, char in enumerate(text):
            if self._depth == 0:
                if char in WHITESPACE:
                    continue
                if char != "{":  # arguments are an object (api/tools.parameters): never here
                    self.state = "close"
                    return "", text[i:]
                start = i
            if start is None:
                start = i
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.arguments_closed, self.state = True, "close"
                    return text[start:i + 1], text[i + 1:]
        return ("" if start is None else text[start:]), ""


class CallReader:
    """Reads one choice's reply as it is written and says what to send: content, or tool calls'
    names and then their arguments piece by piece (module docstring)."""

    def __init__(self, tool_spec):
        self.format = tool_spec.format
        self._heads = {f["name"]: self.format.call_head(f["name"]) for f in tool_spec.allowed}
        self._tagged = bool(self.format.opener)
        self.calls: list[Call] = []
        self.content = ""  # the content sent so far
        if self._tagged:
            self._state = "content"
        else:
            self._state = "call" if tool_spec.required else "undecided"
        self._held = ""    # text not yet placed
        self._object: Optional[_CallObject] = _CallObject(self._heads) if self._state == "call" else None

    @property
    def is_call(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict]:
        """The deltas (OpenAI chat delta objects) that `text`, the reply's next piece, gives."""
        deltas: list[dict] = []
        while text:
            text = self._step(text, deltas)
        return deltas

    def _step(self, text: str, deltas: list) -> str:
        """Reads what it can of `text`; returns what is left for the next state."""
        if self._state == "text":  # a reply that is no call (or what follows a bare call's end)
            self._content(text, deltas)
            return ""
        if self._state == "tail":  # after a bare call: the call's end, dropped
            return ""
        if self._state == "undecided":
            self._held += text
            start = self._held.lstrip(WHITESPACE)
            if not start:
                return ""
            text, self._held = self._held, ""
            if not start.startswith("{"):
                self._state = "text"
                return text
            self._state, self._object = "call", _CallObject(self._heads)
            return text
        if self._state == "content":
            return self._read_content(text, deltas)
        if self._state == "closer":
            return self._read_closer(text)
        return self._read_call(text, deltas)

    def _content(self, text: str, deltas: list) -> None:
        if text:
            self.content += text
            deltas.append({"content": text})

    def _read_content(self, text: str, deltas: list) -> str:
        opener = self.format.opener
        buffer, self._held = self._held + text, ""
        at = buffer.find(opener)
        if at >= 0:  # a call starts: the whitespace before its tag is no content
            self._content(buffer[:at].rstrip(WHITESPACE), deltas)
            self._state, self._object = "call", _CallObject(self._heads)
            return buffer[at + len(opener):]
        keep = len(buffer)  # hold back a tail that may start the tag, and whitespace before it
        for start in range(max(0, len(buffer) - len(opener) + 1), len(buffer)):
            if opener.startswith(buffer[start:]):
                keep = start
                break
        while keep > 0 and buffer[keep - 1] in WHITESPACE:
            keep -= 1
        self._content(buffer[:keep], deltas)
        self._held = buffer[keep:]
        return ""

    def _read_call(self, text: str, deltas: list) -> str:
        events, rest = self._object.feed(text)
        if self._object.state == "not a call":
            self._state = "text" if not self._tagged else "content"
            raw = (self.format.opener if self._tagged else "") + self._object.raw
            if self._tagged:  # the tag's text is content now; what follows may still open a call
                self._content(raw, deltas)
                return ""
            return raw
        for kind, value in events:
            index = len(self.calls) - (kind == "arguments")
            if kind == "name":
                call = Call(new_call_id(), value)
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                               "function": {"name": value, "arguments": ""}}]})
            else:
                self.calls[-1].arguments += value
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": value}}]})
        if rest is None:
            return ""
        self.calls[-1].complete = self._object.arguments_closed
        self._state = "closer" if self._tagged else "tail"
        return rest

    def _read_closer(self, text: str) -> str:
        """After a tagged call's object: whitespace and its closing tag, then content again (which
        may open the next call)."""
        closer = self.format.closer
        self._held += text
        rest = self._held.lstrip(WHITESPACE)
        if closer.startswith(rest) and len(rest) < len(closer):
            return ""  # not yet known
        self._held, self._state = "", "content"
        return rest[len(closer):] if rest.startswith(closer) else rest

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the finish_reason once the reply has ended: "tool_calls" for whole
        calls that ended by themselves; a call cut short keeps its reason ("length": its arguments
        may be incomplete JSON, as OpenAI documents); text still held back goes out as content."""
        deltas: list[dict] = []
        if self._state == "call" and not self.calls and self._object is not None:
            held = (self.format.opener if self._tagged else "") + self._object.raw
        elif self._state in ("undecided", "content"):
            held = self._held
        else:
            held = ""
        self._held = ""
        if held and (not self.calls or held.strip()):
            self._content(held, deltas)
        if self.calls:
            whole = all(c.complete for c in self.calls) and self._state != "call"
            return deltas, "tool_calls" if whole and finish_reason == "stop" else finish_reason
        return deltas, finish_reason


def read_reply(text: str, finish_reason: str, tool_spec) -> tuple[Optional[str], Optional[list], str]:
    """A whole reply as (content, tool_calls, finish_reason), as the stream of it says: whole calls
    that ended by themselves are calls, "tool_calls" (content: the text before them, or None); calls
    cut by max_tokens once their names were written are calls too, with the arguments written so
    far (maybe incomplete JSON, as OpenAI documents), "length"; anything else is text."""
    reader = CallReader(tool_spec)
    reader.feed(text)
    _, reason = reader.finish(finish_reason)
    cut = reason == "length" and reader.calls
    if cut or reason == "tool_calls" and all(_is_json(c.arguments) for c in reader.calls):
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in reader.calls]
        return (reader.content if reader.content.strip() else None), calls, reason
    return text, None, finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
