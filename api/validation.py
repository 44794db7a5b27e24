"""Read and check a completions or chat request body; every mistake becomes a clear 400."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from api.errors import bad_request
from shared.protocol import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN, SamplingParams

MAX_CHOICES = 8
MAX_STOPS = 4
MAX_STOP_CHARS = 256    # each stop string: the worker looks for every one after every token
MAX_PROMPTS = 64
MAX_TOTAL_CHOICES = 64  # n x prompts: the jobs one request may queue
MAX_MESSAGES = 512
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")

Prompt = Union[str, list[int]]  # text, or token ids already


@dataclass
class CompletionRequest:
    model: str
    params: SamplingParams
    max_tokens: Optional[int]  # None: all the room the context window leaves
    max_tokens_param: str = "max_tokens"  # the field it came from, for errors
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = PRIORITY_DEFAULT  # lower is served first
    prompts: list[Prompt] = field(default_factory=list)  # completions
    messages: list[dict] = field(default_factory=list)   # chat


def _kind_ok(value, kind) -> bool:
    if kind is int:
        # JSON has one kind of number: 2.0 is the integer 2 (JSON Schema's "integer" says so too).
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return integral and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               dict: "an object", list: "an array"}


def get_field(body: dict, name: str, kind, default=None, *, required: bool = False):
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"you must provide '{name}'", param=name, code="missing_required_parameter")
        return default
    if not _kind_ok(value, kind):
        raise bad_request(f"'{name}' must be {_KIND_NAMES[kind]}, not {type(value).__name__}: {value!r}",
                          param=name, code="invalid_type")
    return int(value) if kind is int else value


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise bad_request(f"'{name}' {message}", param=name, code="invalid_value")


def _max_tokens(body: dict, name: str, default: Optional[int]) -> Optional[int]:
    max_tokens = get_field(body, name, int, default)
    if max_tokens is not None:
        _check(max_tokens >= 1, name, f"must be at least 1, got {max_tokens}")
    return max_tokens


def _sampling(body: dict, max_tokens_name: str = "max_tokens", default_max: Optional[int] = None):
    max_tokens = _max_tokens(body, max_tokens_name, default_max)
    temperature = float(get_field(body, "temperature", float, 1.0))
    _check(0 <= temperature <= 2, "temperature", f"must be between 0 and 2, got {temperature}")
    top_p = float(get_field(body, "top_p", float, 1.0))
    _check(0 < top_p <= 1, "top_p", f"must be in (0, 1], got {top_p}")
    top_k = get_field(body, "top_k", int, 0)
    _check(top_k >= -1, "top_k", f"must be -1 or 0 (off) or a positive integer, got {top_k}")
    seed = get_field(body, "seed", int)
    if seed is not None:
        _check(abs(seed) < 2**63 - MAX_CHOICES, "seed", f"must fit in 64 bits, got {seed}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    _check(len(stop) <= MAX_STOPS, "stop", f"takes at most {MAX_STOPS} sequences, got {len(stop)}")
    _check(all(stop), "stop", "sequences must not be empty")
    _check(all(len(s) <= MAX_STOP_CHARS for s in stop), "stop",
           f"sequences must be at most {MAX_STOP_CHARS} characters, got {max(map(len, stop), default=0)}")
    # max_tokens here is a placeholder: the API sets it once it knows the room the prompt leaves.
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p,
                            top_k=max(top_k, 0), seed=seed, stop=stop,
                            ignore_eos=get_field(body, "ignore_eos", bool, False))
    return params, max_tokens


def _common(body, max_tokens_name: str, default_max: Optional[int], **fields) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object, e.g. {\"model\": ..., \"prompt\": ...}",
                          code="invalid_json")
    model = get_field(body, "model", str, required=True)
    params, max_tokens = _sampling(body, max_tokens_name, default_max)
    n = get_field(body, "n", int, 1)
    _check(1 <= n <= MAX_CHOICES, "n", f"must be between 1 and {MAX_CHOICES}, got {n}")
    get_field(body, "user", str)
    options = get_field(body, "stream_options", dict, {})
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request(f"'stream_options.include_usage' must be a boolean, not {include_usage!r}",
                          param="stream_options.include_usage", code="invalid_type")
    priority = get_field(body, "priority", int, PRIORITY_DEFAULT)
    _check(PRIORITY_MIN <= priority <= PRIORITY_MAX, "priority",
           f"must be between {PRIORITY_MIN} (most urgent) and {PRIORITY_MAX}, got {priority}")
    return CompletionRequest(model=model, params=params, max_tokens=max_tokens, max_tokens_param=max_tokens_name,
                             n=n, priority=priority, stream=get_field(body, "stream", bool, False),
                             include_usage=bool(include_usage), **fields)


def parse_completion(body) -> CompletionRequest:
    prompts = _prompts(body.get("prompt") if isinstance(body, dict) else None)
    req = _common(body, "max_tokens", 16, prompts=prompts)
    _check(req.n * len(prompts) <= MAX_TOTAL_CHOICES, "n",
           f"times the number of prompts must be at most {MAX_TOTAL_CHOICES} choices in all, "
           f"got {req.n} x {len(prompts)}")
    return req


def parse_chat(body) -> CompletionRequest:
    raw = body.get("messages") if isinstance(body, dict) else None
    # max_completion_tokens is OpenAI's newer name; given, it wins over max_tokens.
    given = isinstance(body, dict) and body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if given else "max_tokens"
    if given:  # max_tokens is then unused, but a wrong one is still a mistake worth hearing about
        _max_tokens(body, "max_tokens", None)
    return _common(body, name, None, messages=_messages(raw))


def _prompts(prompt) -> list[Prompt]:
    def is_ids(x):
        return isinstance(x, list) and x and all(_kind_ok(t, int) and t >= 0 for t in x)

    if prompt is None:
        raise bad_request("you must provide 'prompt'", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, an array of strings, or token ids",
                          param="prompt", code="invalid_type")
    _check(len(prompts) <= MAX_PROMPTS, "prompt", f"takes at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    _check(all(len(p) > 0 for p in prompts), "prompt", "must not be empty")
    return prompts


def _messages(messages) -> list[dict]:
    if messages is None:
        raise bad_request("you must provide 'messages'", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages", code="invalid_type")
    _check(len(messages) <= MAX_MESSAGES, "messages", f"takes at most {MAX_MESSAGES} messages, got {len(messages)}")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", param=where,
                              code="invalid_type")
        role, content = message.get("role"), message.get("content")
        _check(role in CHAT_ROLES, f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):  # content parts: only text is understood by a text model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"'{where}.content' parts must all be of type 'text'",
                                  param=f"{where}.content", code="invalid_type")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string", param=f"{where}.content",
                              code="invalid_type")
        clean.append({"role": role, "content": content})
    return clean


def check_max_tokens(req: CompletionRequest, context_window: int) -> None:
    """More tokens than the model's whole window is a mistake, not a wish to fill it: a 400.
    (max_tokens within the window but beyond the room the prompt leaves is cut to the room.)"""
    if req.max_tokens is not None and req.max_tokens > context_window:
        raise bad_request(f"'{req.max_tokens_param}' is {req.max_tokens}, more than this model's context window "
                          f"of {context_window} tokens", param=req.max_tokens_param, code="invalid_value")
