"""The limits on what one request may ask for, on fakeredis: each refusal a 400 naming the field,
each limit itself accepted, and nothing queued for a refused request."""
from __future__ import annotations

import io

import pytest

from api.app import create_app
from api.validation import MAX_CHOICES, MAX_MESSAGES, MAX_STOP_CHARS, MAX_TOTAL_CHOICES, parse_chat, parse_completion
from shared import keys
from shared.settings import Settings
from tests.fake_workers import CONTEXT, MODEL, openai_error, register_worker

CHAT = [{"role": "user", "content": "A dragon?"}]


@pytest.fixture
def served(fake_redis):
    register_worker(fake_redis)
    return create_app(Settings(request_timeout=5), client=fake_redis).test_client()


def _nothing_queued(fake_redis) -> None:
    assert not any(fake_redis.llen(name) for name in keys.queues(MODEL))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["end", "x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    # n times the prompts: each of n (8) and the prompts (64) is allowed alone, not together.
    ("/v1/completions", {"prompt": ["hi"] * (MAX_TOTAL_CHOICES // MAX_CHOICES + 1), "n": MAX_CHOICES}, "n"),
    ("/v1/completions", {"prompt": [[5, 6]] * MAX_TOTAL_CHOICES, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**20}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT * (MAX_MESSAGES + 1)}, "messages"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_a_request_past_a_limit_gets_a_400_naming_the_field(served, fake_redis, path, body, param):
    error = openai_error(served.post(path, json={"model": MODEL, **body}), 400, param=param)
    assert error["type"] == "invalid_request_error"
    _nothing_queued(fake_redis)


def test_the_limits_themselves_are_accepted():
    at_most = parse_completion({"model": MODEL, "prompt": ["hi"] * (MAX_TOTAL_CHOICES // MAX_CHOICES),
                                "n": MAX_CHOICES, "stop": ["x" * MAX_STOP_CHARS]})
    assert at_most.n * len(at_most.prompts) == MAX_TOTAL_CHOICES
    chat = parse_chat({"model": MODEL, "messages": CHAT * MAX_MESSAGES, "max_completion_tokens": CONTEXT})
    assert len(chat.messages) == MAX_MESSAGES and chat.max_tokens == CONTEXT


def test_the_error_for_max_tokens_says_what_the_window_is(served):
    error = openai_error(served.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 500}),
                         400, param="max_tokens", code="invalid_value")
    assert "500" in error["message"] and str(CONTEXT) in error["message"]


def test_a_null_max_completion_tokens_leaves_max_tokens_in_charge():
    req = parse_chat({"model": MODEL, "messages": CHAT, "max_completion_tokens": None, "max_tokens": 7})
    assert req.max_tokens == 7 and req.max_tokens_param == "max_tokens"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": " ".join(["dragon"] * CONTEXT)}, "prompt"),
    ("/v1/completions", {"prompt": [[5]] + [[5] * CONTEXT]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "dragon " * CONTEXT}]}, "messages"),
])
def test_a_prompt_past_the_context_window_names_its_field(served, fake_redis, path, body, param):
    openai_error(served.post(path, json={"model": MODEL, **body}), 400, param=param, code="context_length_exceeded")
    _nothing_queued(fake_redis)


@pytest.mark.parametrize("field, value", [
    ("prompt", "once \ud800 upon"), ("model", "tiny\udfff"), ("stop", ["\udc00"]), ("user", "\ud83d"),
])
def test_a_lone_surrogate_anywhere_gets_a_400(served, fake_redis, field, value):
    # Python's json reads "\ud800" into a str that no tokenizer nor Redis can encode.
    body = '{"model": "%s", "prompt": "hi", "%s": %s}' % (MODEL, field, _escaped(value))
    response = served.post("/v1/completions", data=body, content_type="application/json")
    openai_error(response, 400, code="invalid_json")
    _nothing_queued(fake_redis)


def _escaped(value) -> str:
    """JSON text of `value` with every non-ASCII character as a \\u escape (surrogates as they are)."""
    if isinstance(value, list):
        return "[" + ", ".join(_escaped(v) for v in value) + "]"
    return '"' + "".join(c if c.isascii() else f"\\u{ord(c):04x}" for c in value) + '"'


@pytest.mark.parametrize("depth", [900, 1000, 100_000])  # about Python's recursion limit, and far past it
def test_json_nested_deeper_than_the_stack_gets_a_400_not_a_500(served, depth):
    nested = "[" * depth + "]" * depth
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        body = '{"model": "%s", "prompt": "hi", "user": %s}' % (MODEL, nested)
        # Parsed (a 400 for the field) or not (a 400 for the JSON): whichever, no RecursionError's 500.
        openai_error(served.post(path, data=body, content_type="application/json"), 400)
    line = '{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": %s}' % nested
    upload = served.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line.encode()), "deep.jsonl")})
    assert "line 1" in openai_error(upload, 400, param="file")["message"]
