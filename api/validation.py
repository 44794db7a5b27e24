"""Read and check a completions or chat request body; every mistake becomes a clear 400.

No field is silently ignored: each one either does what OpenAI (or vLLM, for its extensions)
documents, is metadata that cannot change the answer (METADATA_FIELDS), or is refused with a 400
naming it, unless sent at a value that asks for nothing (UNSUPPORTED). A field neither route knows
is a 400 `unknown_parameter`, or with --lenient a warning in the log, once per field name.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Optional, Union

from api import chat_fields, tools
from api.chat_fields import CHAT_ROLES, MAX_MESSAGES  # noqa: F401 (the API's limits, listed here)
from api.errors import bad_request
from shared.protocol import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN, SamplingParams

log = logging.getLogger(__name__)

MAX_CHOICES = 8
MAX_STOPS = 4
MAX_STOP_CHARS = 256    # each stop string: the worker looks for every one after every token
MAX_PROMPTS = 64
MAX_TOTAL_CHOICES = 64  # n x prompts: the jobs one request may queue
PENALTY_RANGE = (-2.0, 2.0)          # presence_penalty, frequency_penalty (OpenAI's)
MAX_REPETITION_PENALTY = 10.0        # repetition_penalty in (0, this]; 1 is off
MAX_LOGIT_BIAS = 300                 # entries (OpenAI's limit)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_STOP_TOKEN_IDS = 16
MAX_LOGPROBS = 20                    # completions' logprobs, chat's top_logprobs (vLLM's bound)
MAX_TOKEN_ID = 2**31 - 1             # ids beyond the model's vocabulary are refused once it is known
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits on `metadata`

# Every field each route knows. Metadata: accepted, checked for its type, and without effect here.
METADATA_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
_SHARED_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format",
    # vLLM's extensions
    "top_k", "ignore_eos", "priority", "repetition_penalty", "min_p", "stop_token_ids", "min_tokens",
    "structured_outputs", *METADATA_FIELDS)
# OpenAI's fields this server cannot honour: accepted only at the values that ask for nothing.
UNSUPPORTED = {
    "suffix": ((None, ""), "it does not write text to fit before a suffix (fill-in-the-middle)"),
    "modalities": ((None, ["text"]), "it writes text only"),
    "audio": ((None,), "it writes text only"),
    "prediction": ((None,), "it writes every token itself"),
    "web_search_options": ((None,), "it cannot search the web"),
    "reasoning_effort": ((None,), "its models do not reason before answering"),
    "verbosity": ((None,), "length is set by max_tokens"),
    "functions": ((None, []), "deprecated by OpenAI: use 'tools'"),
    "function_call": ((None, "none"), "deprecated by OpenAI: use 'tool_choice'"),
}
COMPLETION_FIELDS = frozenset(_SHARED_FIELDS + ("prompt", "echo", "suffix", "best_of"))
CHAT_FIELDS = frozenset(_SHARED_FIELDS + (
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "modalities", "audio", "prediction", "web_search_options", "reasoning_effort", "verbosity",
    "functions", "function_call"))

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
    echo: bool = False  # completions: the prompt comes back before the answer
    # Constraints, as sent after a check of their shape (api/grammars.py, api/tools.py compile them):
    # None when absent or asking for nothing (response_format {"type": "text"}, tools []).
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None  # vLLM's: one of json, regex, choice, grammar
    tools: Optional[list] = None  # chat
    tool_choice: Optional[Union[str, dict]] = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool = True  # chat: several calls a reply, where the model's format has them
    chat: bool = False  # the chat route's (messages), else the completions route's (prompts)
    # What keeps a client's requests together when routed to the worker holding their history
    # (shared/routing.py): OpenAI's prompt_cache_key, else its user.
    routing_key: str = ""

    @property
    def constraints(self) -> list[str]:
        """The fields that constrain the reply, in the order errors name them. The one place that
        says whether a request has a constraint: api/checks.py asks the workers for the grammar
        feature by it, api/grammars.py compiles it (and refuses more than one)."""
        return [name for name, given in (("response_format", self.response_format is not None),
                                         ("structured_outputs", self.structured_outputs is not None),
                                         ("tools", tools.in_use(self.tools, self.tool_choice))) if given]

    @property
    def choices(self) -> int:
        """The jobs the request queues: n per prompt (a chat is one prompt)."""
        return self.n * (1 if self.chat else len(self.prompts))


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


def _number_in(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = float(get_field(body, name, float, default))
    _check(low <= value <= high, name, f"must be between {low:g} and {high:g}, got {value:g}")
    return value


_warned_unknown: set[str] = set()
MAX_WARNED = 256  # names remembered: past them, no more warnings (random names must not grow memory)


def _known_fields(body: dict, known: frozenset, lenient: bool) -> None:
    """A 400 for the first field the route does not know (or, lenient, a warning once per name)."""
    for name in body:
        if name in known:
            continue
        if not lenient:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                              code="unknown_parameter")
        if name not in _warned_unknown and len(_warned_unknown) < MAX_WARNED:
            _warned_unknown.add(name)
            log.warning("ignoring the request field %r, which this API does not know (--lenient)", name)
    for name, (no_op, reason) in UNSUPPORTED.items():
        if name in known and body.get(name) not in no_op:
            raise bad_request(f"'{name}' is not supported by this server: {reason}", param=name,
                              code="unsupported_parameter")


def _metadata(body: dict, chat: bool) -> None:
    """The metadata fields are checked as OpenAI checks them, and then have no effect."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        get_field(body, name, str)
    get_field(body, "store", bool)
    if chat:
        get_field(body, "parallel_tool_calls", bool)
    tier = get_field(body, "service_tier", str)
    _check(tier in (None, *SERVICE_TIERS), "service_tier", f"must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}")
    metadata = get_field(body, "metadata", dict, {})
    _check(len(metadata) <= MAX_METADATA, "metadata", f"takes at most {MAX_METADATA} pairs, got {len(metadata)}")
    _check(all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(v, str)
               and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()), "metadata",
           f"must map keys of up to {MAX_METADATA_KEY} characters to strings of up to {MAX_METADATA_VALUE}")


def _max_tokens(body: dict, name: str, default: Optional[int]) -> Optional[int]:
    max_tokens = get_field(body, name, int, default)
    if max_tokens is not None:
        _check(max_tokens >= 1, name, f"must be at least 1, got {max_tokens}")
    return max_tokens


def _stop(body: dict) -> list[str]:
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
    return stop


def _logit_bias(body: dict) -> dict[str, float]:
    bias = get_field(body, "logit_bias", dict, {})
    _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    clean = {}
    for key, value in bias.items():
        _check(bool(re.fullmatch(r"[0-9]{1,10}", key)) and int(key) <= MAX_TOKEN_ID, "logit_bias",
               f"keys must be token ids (non-negative integers as strings), got {key!r}")
        _check(_kind_ok(value, float) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1], "logit_bias",
               f"values must be numbers between -100 and 100, got {value!r} for token {key}")
        clean[str(int(key))] = float(value)
    return clean


def _stop_token_ids(body: dict) -> list[int]:
    ids = get_field(body, "stop_token_ids", list, [])
    _check(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    _check(all(_kind_ok(t, int) and 0 <= t <= MAX_TOKEN_ID for t in ids), "stop_token_ids",
           "must be an array of token ids (non-negative integers)")
    return [int(t) for t in ids]


def _sampling(body: dict, max_tokens_name: str = "max_tokens", default_max: Optional[int] = None):
    max_tokens = _max_tokens(body, max_tokens_name, default_max)
    temperature = _number_in(body, "temperature", 0, 2, 1.0)
    top_p = float(get_field(body, "top_p", float, 1.0))
    _check(0 < top_p <= 1, "top_p", f"must be in (0, 1], got {top_p}")
    top_k = get_field(body, "top_k", int, 0)
    _check(top_k >= -1, "top_k", f"must be -1 or 0 (off) or a positive integer, got {top_k}")
    seed = get_field(body, "seed", int)
    if seed is not None:
        _check(abs(seed) < 2**63 - MAX_CHOICES, "seed", f"must fit in 64 bits, got {seed}")
    repetition_penalty = float(get_field(body, "repetition_penalty", float, 1.0))
    _check(0 < repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
           f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), got {repetition_penalty:g}")
    min_tokens = get_field(body, "min_tokens", int, 0)
    _check(min_tokens >= 0, "min_tokens", f"must be at least 0, got {min_tokens}")
    if max_tokens is not None:
        _check(min_tokens <= max_tokens, "min_tokens", f"is {min_tokens}, more than {max_tokens_name} ({max_tokens})")
    # max_tokens here is a placeholder: the API sets it once it knows the room the prompt leaves.
    params = SamplingParams(
        max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
        stop=_stop(body), ignore_eos=get_field(body, "ignore_eos", bool, False),
        presence_penalty=_number_in(body, "presence_penalty", *PENALTY_RANGE, 0.0),
        frequency_penalty=_number_in(body, "frequency_penalty", *PENALTY_RANGE, 0.0),
        repetition_penalty=repetition_penalty, min_p=_number_in(body, "min_p", 0, 1, 0.0),
        logit_bias=_logit_bias(body), stop_token_ids=_stop_token_ids(body), min_tokens=min_tokens)
    return params, max_tokens


def _constraints(body: dict) -> dict:
    """response_format and structured_outputs, their shape checked; their contents are compiled later."""
    response_format = get_field(body, "response_format", dict)
    if response_format is not None:
        kind = response_format.get("type")
        _check(kind in RESPONSE_FORMATS, "response_format.type",
               f"must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
        if not isinstance(response_format.get("json_schema", {}), dict) or (
                kind == "json_schema" and "json_schema" not in response_format):
            raise bad_request("'response_format.json_schema' must be an object {name, schema, strict}",
                              param="response_format.json_schema", code="invalid_type")
        if kind == "text":
            response_format = None  # asks for nothing
    return {"response_format": response_format,
            "structured_outputs": get_field(body, "structured_outputs", dict)}


def _common(body: dict, max_tokens_name: str, default_max: Optional[int], chat: bool, **fields) -> CompletionRequest:
    model = get_field(body, "model", str, required=True)
    params, max_tokens = _sampling(body, max_tokens_name, default_max)
    n = get_field(body, "n", int, 1)
    _check(1 <= n <= MAX_CHOICES, "n", f"must be between 1 and {MAX_CHOICES}, got {n}")
    _metadata(body, chat)
    options = get_field(body, "stream_options", dict, {})
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request(f"'stream_options.include_usage' must be a boolean, not {include_usage!r}",
                          param="stream_options.include_usage", code="invalid_type")
    priority = get_field(body, "priority", int, PRIORITY_DEFAULT)
    _check(PRIORITY_MIN <= priority <= PRIORITY_MAX, "priority",
           f"must be between {PRIORITY_MIN} (most urgent) and {PRIORITY_MAX}, got {priority}")
    return CompletionRequest(model=model, params=params, max_tokens=max_tokens, max_tokens_param=max_tokens_name,
                             n=n, priority=priority, chat=chat, stream=get_field(body, "stream", bool, False),
                             include_usage=bool(include_usage), **_constraints(body),
                             routing_key=body.get("prompt_cache_key") or body.get("user") or "", **fields)


def _an_object(body) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object, e.g. {\"model\": ..., \"prompt\": ...}",
                          code="invalid_json")
    return body


def parse_completion(body, lenient: bool = False) -> CompletionRequest:
    _known_fields(_an_object(body), COMPLETION_FIELDS, lenient)
    prompts = _prompts(body.get("prompt"))
    req = _common(body, "max_tokens", 16, chat=False, prompts=prompts, echo=get_field(body, "echo", bool, False))
    _check(req.choices <= MAX_TOTAL_CHOICES, "n",
           f"times the number of prompts must be at most {MAX_TOTAL_CHOICES} choices in all, "
           f"got {req.n} x {len(prompts)}")
    best_of = get_field(body, "best_of", int)
    if best_of not in (None, req.n):  # best_of == n picks all it writes: the same as n alone
        raise bad_request(f"'best_of' other than n ({req.n}) is not supported by this server: ask for n "
                          f"choices and pick among them", param="best_of", code="unsupported_parameter")
    logprobs = None if body.get("logprobs") is False else get_field(body, "logprobs", int)
    if logprobs is not None:
        _check(0 <= logprobs <= MAX_LOGPROBS, "logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
        req.params.logprobs = logprobs
        req.params.prompt_logprobs = logprobs if req.echo else None
    return req


def parse_chat(body, lenient: bool = False) -> CompletionRequest:
    _known_fields(_an_object(body), CHAT_FIELDS, lenient)
    messages = chat_fields.messages(body.get("messages"))
    # max_completion_tokens is OpenAI's newer name; given, it wins over max_tokens.
    given = body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if given else "max_tokens"
    if given:  # max_tokens is then unused, but a wrong one is still a mistake worth hearing about
        _max_tokens(body, "max_tokens", None)
    tools = chat_fields.tools(body.get("tools"))
    req = _common(body, name, None, chat=True, messages=messages, tools=tools,
                  tool_choice=chat_fields.tool_choice(body.get("tool_choice"), tools))
    logprobs = get_field(body, "logprobs", bool, False)
    top_logprobs = get_field(body, "top_logprobs", int, 0)
    _check(0 <= top_logprobs <= MAX_LOGPROBS, "top_logprobs",
           f"must be between 0 and {MAX_LOGPROBS}, got {top_logprobs}")
    _check(logprobs or not top_logprobs, "top_logprobs", "needs 'logprobs': true")
    req.params.logprobs = top_logprobs if logprobs else None
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False  # its type: _metadata
    return req


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
