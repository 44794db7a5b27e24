"""The shapes of chat's own fields: the conversation (with tool calls and their results), `tools`
and `tool_choice`. Shapes only: what a tool's parameter schema means is api/tools.py's business.

Each mistake is a 400 naming where it is, e.g. `messages[2].tool_calls[0].function.name`.
"""
from __future__ import annotations

from typing import Optional, Union

from api.errors import bad_request
from api.tools import NAME_PATTERN

MAX_MESSAGES = 512
MAX_TOOLS = 128  # OpenAI's limit
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
TOOL_CHOICES = ("none", "auto", "required")


def _invalid(where: str, message: str, code: str = "invalid_type"):
    return bad_request(f"'{where}' {message}", param=where, code=code)


def _function_name(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(where, "must be a non-empty string (the function's name)")
    return value


def messages(raw) -> list[dict]:
    """The conversation as the chat template reads it: each message's role and content (text parts
    joined), and where present an assistant's `tool_calls` (content may then be null), a tool
    result's `tool_call_id`, and `name`."""
    if raw is None:
        raise bad_request("you must provide 'messages'", param="messages", code="missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", param="messages", code="invalid_type")
    if len(raw) > MAX_MESSAGES:
        raise _invalid("messages", f"takes at most {MAX_MESSAGES} messages, got {len(raw)}", "invalid_value")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(raw)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise _invalid(where, "must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}", "invalid_value")
    clean: dict = {"role": role}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise _invalid(f"{where}.tool_calls", f"is only for assistant messages, not {role}", "invalid_value")
        calls = _tool_calls(tool_calls, f"{where}.tool_calls")
        if calls:  # [] is what some clients send for none
            clean["tool_calls"] = calls
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is understood by a text model
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _invalid(f"{where}.content", "parts must all be of type 'text'")
        content = "".join(p["text"] for p in content)
    if content is None and "tool_calls" in clean:
        clean["content"] = None  # OpenAI's clients send null beside tool calls
    elif isinstance(content, str):
        clean["content"] = content
    else:
        raise _invalid(f"{where}.content", "must be a string" + (" (or null beside tool_calls)"
                                                                  if role == "assistant" else ""))
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"'{where}.tool_call_id' must be the id of the call this message answers",
                              param=f"{where}.tool_call_id",
                              code="missing_required_parameter" if call_id is None else "invalid_type")
        clean["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _invalid(f"{where}.name", "must be a string")
        clean["name"] = name
    return clean


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _invalid(where, "must be an array of {id, type: \"function\", function: {name, arguments}}")
    clean = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise _invalid(at, "must be an object {id, type: \"function\", function: {name, arguments}}")
        if not isinstance(call.get("id"), str):
            raise _invalid(f"{at}.id", "must be a string (the call's id, which its tool message names)")
        if call.get("type", "function") != "function":
            raise _invalid(f"{at}.type", f"must be \"function\", got {call.get('type')!r}", "invalid_value")
        function = call.get("function")
        if not isinstance(function, dict):
            raise _invalid(f"{at}.function", "must be an object {name, arguments}")
        name = _function_name(function.get("name"), f"{at}.function.name")
        if not isinstance(function.get("arguments"), str):
            raise _invalid(f"{at}.function.arguments", "must be a string (the arguments as JSON text)")
        clean.append({"id": call["id"], "type": "function",
                      "function": {"name": name, "arguments": function["arguments"]}})
    return clean


def tools(raw) -> Optional[list]:
    """`tools` as sent, after its shape is checked; None for none (null or [])."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _invalid("tools", "must be an array of {type: \"function\", function: {name, ...}}")
    if len(raw) > MAX_TOOLS:
        raise _invalid("tools", f"takes at most {MAX_TOOLS} tools, got {len(raw)}", "invalid_value")
    names = set()
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(at, "must be an object {type: \"function\", function: {name, ...}}")
        if tool.get("type") != "function":
            raise _invalid(f"{at}.type", f"must be \"function\", got {tool.get('type')!r}", "invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _invalid(f"{at}.function", "must be an object {name, description, parameters}")
        name = _function_name(function.get("name"), f"{at}.function.name")
        if not NAME_PATTERN.fullmatch(name):
            raise _invalid(f"{at}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}",
                           "invalid_value")
        if name in names:
            raise _invalid(f"{at}.function.name", f"{name!r} is already the name of another tool", "invalid_value")
        names.add(name)
        for key, kind, what in (("parameters", dict, "an object (a JSON Schema)"), ("description", str, "a string"),
                                ("strict", bool, "a boolean")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise _invalid(f"{at}.function.{key}", f"must be {what}")
    return raw


def tool_choice(raw, given_tools: Optional[list]) -> Optional[Union[str, dict]]:
    """`tool_choice`: "auto" when tools are given and it is not (OpenAI's default), None without tools."""
    if raw is None:
        return "auto" if given_tools else None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise _invalid("tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or "
                                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {raw!r}",
                           "invalid_value")
        if raw == "required" and not given_tools:
            raise _invalid("tool_choice", "is \"required\", but no 'tools' are given", "invalid_value")
        return raw if given_tools else None  # "none" or "auto" without tools: nothing to choose
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise _invalid("tool_choice", "must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = _function_name(raw["function"].get("name"), "tool_choice.function.name")
    if name not in {tool["function"]["name"] for tool in given_tools or []}:
        raise _invalid("tool_choice.function.name", f"names {name!r}, which is not one of the 'tools'",
                       "invalid_value")
    return {"type": "function", "function": {"name": name}}
