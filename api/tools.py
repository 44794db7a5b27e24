"""Tools on chat: how the functions are shown to the model, what a reply may be, and (in
api/tool_readers.py) the reply read back as OpenAI's `tool_calls`, whole or streamed.

The call format is the model's own where its chat template has one (api/tool_formats.py: Qwen's
`<tool_call>` tags, Llama 3's `{"name": .., "parameters": ..}`), else the fallback: one compact
JSON object, `{"name":"<function>","arguments":{...}}`, the name first, then the arguments, which
match the function's parameter schema. api/grammars.py compiles the grammar (llguidance) that lets
the worker write nothing else:
- "required": a call of any of the tools (an anyOf over them);
- a named function ({"type": "function", "function": {"name"}}): a call of that one;
- "auto": free text or a call (the fallback and Llama 3: text that does not start with "{" after
  any whitespace; Qwen's: text without a `<tool_call>` tag, or text and then calls);
- "none": no grammar, and the tools are not shown to the model (only the history's calls are).
Qwen's format may hold several calls a reply (`parallel_tool_calls`, true by default; false: one);
the others, one.

The prompt. A chat template that reads `tools` (transformers' apply_chat_template(tools=...))
renders them its own way, and the history in the shape transformers' templates expect (a call's
arguments parsed to an object; tool results as role "tool", which Qwen's renders as
<tool_response> and Llama 3's as ipython). SmolLM2's template knows no tools and renders any role
as `<|im_start|>role\\ncontent<|im_end|>`, so for such a template the API shows them itself:
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
from dataclasses import dataclass
from typing import Optional

from api import tool_formats
from api.errors import bad_request
from api.tool_formats import ToolFormat
from api.tool_readers import CallReader, new_call_id, read_reply  # noqa: F401 (api.tools' readers)

# OpenAI's rule for a function's name; it also keeps a name the same text in any JSON encoding,
# which lets the readers (api/tool_readers.py) recognise a call's start byte for byte.
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
COMPACT = (",", ":")  # the fallback format's JSON separators (api/tool_formats.JSON: no spaces)


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and its choice among them. `functions`: {name, description, parameters}
    of each tool, the parameters a JSON Schema of an object; `forced`: the one function a named
    tool_choice allows; `required`: the reply must be a call (required or named), else "auto";
    `format`: the model's call syntax; `parallel`: several calls a reply (where the format has
    them and the request allows them); `strict`: the functions whose `strict` is true (their
    schemas are enforced whole or refused; the others' are relaxed where llguidance cannot
    enforce a keyword: api/grammars.py)."""
    functions: tuple
    required: bool
    forced: Optional[str] = None
    format: ToolFormat = tool_formats.JSON
    parallel: bool = False
    strict: tuple = ()

    @property
    def allowed(self) -> list[dict]:
        return [f for f in self.functions if self.forced in (None, f["name"])]


def in_use(tools: Optional[list], tool_choice) -> bool:
    """Whether a request's tools take part in its reply: shown to the model, the reply constrained
    to text or calls. With tool_choice "none" they do not (api/validation.CompletionRequest.constraints)."""
    return bool(tools) and tool_choice not in (None, "none")


def spec(tools: Optional[list], tool_choice, tool_format: ToolFormat = tool_formats.JSON,
         parallel_tool_calls: bool = True) -> Optional[ToolSpec]:
    """The request's ToolSpec, or None when the reply is free (tools not in_use).
    `tools` and `tool_choice` come with their shape checked (api/chat_fields.py); `tool_format` is
    the model's (its api.tokenizers.Tokenizer.tool_format)."""
    if not in_use(tools, tool_choice):
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
    how = {"format": tool_format, "parallel": tool_format.parallel and parallel_tool_calls is not False,
           "strict": tuple(t["function"]["name"] for t in tools if t["function"].get("strict") is True)}
    if isinstance(tool_choice, dict):
        return ToolSpec(tuple(functions), required=True, forced=tool_choice["function"]["name"], **how)
    return ToolSpec(tuple(functions), required=tool_choice == "required", **how)


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
    """The JSON Schema of a call of one of the allowed functions, in the spec's format (name first:
    properties are written in their order)."""
    key = tool_spec.format.arguments_key
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
              "required": ["name", key], "additionalProperties": False}
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
