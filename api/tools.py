"""Tools on chat: how the functions are shown to the model, what a reply may be, and the reply read
back as OpenAI's `tool_calls`, whole or streamed.

The call format. A reply that calls a function is exactly one compact JSON object,
`{"name":"<function>","arguments":{...}}`: the name first, then the arguments, which match the
function's parameter schema. api/grammars.py compiles the grammar (llguidance) that lets the
worker write nothing else:
- "required": one call of any of the tools (an anyOf over them);
- a named function ({"type": "function", "function": {"name"}}): a call of that one;
- "auto": either free text that does not start with "{" (after any whitespace) or a call;
- "none": no grammar, and the tools are not shown to the model (only the history's calls are).
One call per reply: `parallel_tool_calls` is accepted (metadata) and never gives more than one.

The prompt. A chat template that reads `tools` (transformers' apply_chat_template(tools=...))
renders them its own way, and the history as given (a call's arguments parsed to an object, as
transformers' templates expect). SmolLM2's template knows no tools and renders any role as
`<|im_start|>role\\ncontent<|im_end|>`, so for such a template the API shows them itself:
- the functions, as a JSON list of {name, description, parameters}, and the call format, in a
  system message (appended to the conversation's first system or developer message, or put first:
  it then takes the place of the template's default system prompt);
- an assistant message's tool_calls as the text the model is asked to write (one call a line,
  after its content if it has some);
- tool messages as a user turn, "The call <id> to <name> returned:" and the content (consecutive
  ones in one turn): a role every template renders.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from api.errors import bad_request

# OpenAI's rule for a function's name; it also keeps a name the same text in any JSON encoding,
# which lets the stream reader below recognise a call's start byte for byte.
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_WHITESPACE = " \t\r\n"
COMPACT = (",", ":")  # the JSON separators the model writes calls with (api/grammars.py: no spaces)


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and its choice among them. `functions`: {name, description, parameters}
    of each tool, the parameters a JSON Schema of an object; `forced`: the one function a named
    tool_choice allows; `required`: the reply must be a call (required or named), else "auto"."""
    functions: tuple
    required: bool
    forced: Optional[str] = None

    @property
    def allowed(self) -> list[dict]:
        return [f for f in self.functions if self.forced in (None, f["name"])]


def spec(tools: Optional[list], tool_choice) -> Optional[ToolSpec]:
    """The request's ToolSpec, or None when the reply is free (no tools, or tool_choice "none").
    `tools` and `tool_choice` come with their shape checked (api/chat_fields.py)."""
    if not tools or tool_choice in (None, "none"):
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if not NAME_PATTERN.fullmatch(function["name"]):
            raise bad_request(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_' or '-', "
                              f"got {function['name']!r}", param=f"tools[{i}].function.name",
                              code="invalid_value")
        functions.append({"name": function["name"], "description": function.get("description") or "",
                          "parameters": parameters(function.get("parameters"), f"tools[{i}].function.parameters")})
    if isinstance(tool_choice, dict):
        return ToolSpec(tuple(functions), required=True, forced=tool_choice["function"]["name"])
    return ToolSpec(tuple(functions), required=tool_choice == "required")


def parameters(schema: Optional[dict], param: str) -> dict:
    """A function's parameter schema as the call's `arguments` must match it: an object (OpenAI's
    rule; none given: a function without parameters, so {})."""
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    kind = schema.get("type", "object")
    if kind != "object":
        raise bad_request(f"'{param}.type' must be \"object\" (a function's arguments are an object), "
                          f"got {kind!r}", param=f"{param}.type", code="invalid_value")
    return {**schema, "type": "object"}


def call_schema(tool_spec: ToolSpec) -> dict:
    """The JSON Schema of a reply that calls one of the allowed functions (name first: properties
    are written in their order)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in tool_spec.allowed]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


# Prompt rendering -----------------------------------------------------------------------------

def template_messages(messages: list[dict], tool_spec: Optional[ToolSpec], native: bool) -> tuple[list, Optional[list]]:
    """(messages, tools) for the chat template: `native` says the template reads `tools` itself."""
    if native:
        tools = [{"type": "function", "function": f} for f in tool_spec.functions] if tool_spec else None
        return [_native_message(m) for m in messages], tools
    rendered: list[dict] = []
    names = {call["id"]: call["function"]["name"]
             for m in messages for call in m.get("tool_calls") or []}
    for message in messages:
        if message["role"] == "tool":
            result = (f"The call {message['tool_call_id']} to "
                      f"{message.get('name') or names.get(message['tool_call_id'], 'a function')} "
                      f"returned:\n{message['content']}")
            if rendered and rendered[-1].get("tool_results"):
                rendered[-1]["content"] += "\n\n" + result
            else:
                rendered.append({"role": "user", "content": result, "tool_results": True})
        elif message.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            rendered.append({"role": "assistant",
                             "content": f"{message['content']}\n{calls}" if message.get("content") else calls})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    rendered = [{"role": m["role"], "content": m["content"]} for m in rendered]
    if tool_spec:
        instructions = system_text(tool_spec)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered, None


def _native_message(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _arguments(text: str):
    """A call's arguments as an object where they are JSON, else the text as sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it."""
    return json.dumps({"name": name, "arguments": _arguments(arguments)}, separators=COMPACT,
                      ensure_ascii=False)


def system_text(tool_spec: ToolSpec) -> str:
    """The system message that shows a template without tools the functions and the call format."""
    listing = json.dumps(list(tool_spec.functions), ensure_ascii=False)
    fmt = '{"name":<the function\'s name>,"arguments":<its arguments, a JSON object>}'
    if tool_spec.forced:
        rule = f"You must call {tool_spec.forced}: reply with only a JSON object {fmt}."
    elif tool_spec.required:
        rule = f"You must call one of them: reply with only a JSON object {fmt}."
    else:
        rule = (f"To call one, reply with only a JSON object {fmt}. "
                "Otherwise answer in words, not starting with {.")
    return f"You can call these functions (their parameters are JSON Schemas):\n{listing}\n{rule}"


# Reading the reply ----------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallReader:
    """Reads one choice's reply as it is written and says what to send: content text, or a tool
    call's name and then its arguments' text piece by piece (OpenAI's tool-call stream deltas).

    A reply is a call when its first non-space character is "{" (with "required" or a named
    function, always). Its head `{"name":"<name>","arguments":` is held back until the name is
    known (the first delta carries it), the arguments object is then passed on as it comes,
    tracked to its closing brace, and the call's own closing brace is dropped. A reply that turns
    out not to be a call (a worker that wrote past the grammar: not expected) is sent as content.
    """

    def __init__(self, tool_spec: ToolSpec):
        self.spec = tool_spec
        self.call_id = new_call_id()
        self.name: Optional[str] = None
        self.arguments = ""          # the arguments' text so far
        self.complete = False        # the arguments' object closed
        self._state = "head" if tool_spec.required else "undecided"
        self._held = ""              # text not yet placed (before the call's name is known)
        self._depth = 0
        self._in_string = self._escaped = False
        self._heads = {f["name"]: '{"name":' + json.dumps(f["name"]) + ',"arguments":'
                       for f in tool_spec.allowed}

    @property
    def is_call(self) -> bool:
        return self.name is not None

    def feed(self, text: str) -> list[dict]:
        """The deltas (OpenAI chat delta objects) that `text`, the reply's next piece, gives."""
        deltas: list[dict] = []
        if self._state == "text":
            return [{"content": text}] if text else []
        if self._state in ("undecided", "head"):
            self._held += text
            if self._state == "undecided":
                start = self._held.lstrip(_WHITESPACE)
                if not start:
                    return []
                if not start.startswith("{"):
                    return self._as_text()
                self._state = "head"
            rest = self._read_head()
            if rest is None:
                return [] if self._state == "head" else self._as_text()
            deltas.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                           "function": {"name": self.name, "arguments": ""}}]})
            text = rest
        if self._state == "arguments":
            piece = self._read_arguments(text)
            if piece:
                self.arguments += piece
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return deltas  # after the arguments ("tail"): the call's closing brace, dropped

    def _as_text(self) -> list[dict]:
        self._state, held, self._held = "text", self._held, ""
        return [{"content": held}] if held else []

    def _read_head(self) -> Optional[str]:
        """The text after a complete head (the name now known), or None: not yet, or (state set to
        "text") never. Whitespace between the head's tokens is allowed."""
        squeezed, consumed = "", 0
        for consumed, char in enumerate(self._held, 1):
            if char in _WHITESPACE:
                continue
            squeezed += char
            for name, head in self._heads.items():
                if squeezed == head:
                    self.name, self._state = name, "arguments"
                    rest, self._held = self._held[consumed:], ""
                    return rest
            if not any(head.startswith(squeezed) for head in self._heads.values()):
                self._state = "not a call"
                return None
        return None

    def _read_arguments(self, text: str) -> str:
        """The part of `text` that belongs to the arguments' object (leading whitespace skipped)."""
        out = []
        for i, char in enumerate(text):
            if self._depth == 0:
                if char in _WHITESPACE:
                    continue
                if char != "{":  # arguments are an object (api/tools.parameters): never here
                    self._state = "tail"
                    return "".join(out)
            out.append(char)
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
                    self.complete, self._state = True, "tail"
                    return "".join(out)
        return "".join(out)

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the finish_reason once the reply has ended: "tool_calls" for a whole
        call that ended by itself; a call cut short keeps its reason ("length": its arguments may
        be incomplete JSON, as OpenAI documents); text still held back goes out as content."""
        if self.is_call:
            return [], "tool_calls" if self.complete and finish_reason == "stop" else finish_reason
        return self._as_text(), finish_reason


def read_reply(text: str, finish_reason: str, tool_spec: ToolSpec) -> tuple[Optional[str], Optional[list], str]:
    """A whole reply as (content, tool_calls, finish_reason): a complete call that ended by itself
    is a call (content None); anything else, a call cut short by max_tokens included, is text."""
    reader = CallReader(tool_spec)
    reader.feed(text)
    if reader.is_call and reader.complete and finish_reason == "stop" and _is_json(reader.arguments):
        calls = [{"id": reader.call_id, "type": "function",
                  "function": {"name": reader.name, "arguments": reader.arguments}}]
        return None, calls, "tool_calls"
    return text, None, finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
