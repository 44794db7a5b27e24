"""A batch's lines: the input file (JSONL, OpenAI's Batch API shape) read and checked, and the
output file's lines.

Input, one request a line:
  {"custom_id": "lore-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Each body is checked as the live route checks it (api/validation.py), at upload, so a mistake is a
400 naming its line, not a failed request hours later. What only a worker knows (the model's
context window, whether the model is served) is found when the request runs: it goes to the
batch's error file.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional

from api.errors import ApiError, bad_request
from api.validation import parse_chat, parse_completion

ENDPOINTS = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
MAX_LINES = 50_000       # OpenAI's limit per batch
MAX_CUSTOM_ID = 512


@dataclass
class BatchLine:
    custom_id: str
    url: str
    body: dict


def parse_file(content: bytes, lenient: bool = False) -> list[BatchLine]:
    """Every request in the file, in order; a 400 naming the first bad line. A body's fields follow
    the live routes' rules: a field they do not know is a mistake unless `lenient` (--lenient)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the file is not UTF-8 text (byte {exc.start})")
    lines: list[BatchLine] = []
    first_seen: dict[str, int] = {}
    # split("\n"), not splitlines(): JSON strings may hold U+2028, which splitlines() breaks on.
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue  # a trailing newline, or blank lines: nothing to run
        if len(lines) == MAX_LINES:
            raise _invalid(f"the file holds more than {MAX_LINES} requests: split it into several batches")
        line = _line(number, raw, lenient)
        if line.custom_id in first_seen:
            raise _invalid(f"line {number}: custom_id {line.custom_id!r} is already used on line "
                           f"{first_seen[line.custom_id]}: each request needs its own, to find its answer")
        first_seen[line.custom_id] = number
        lines.append(line)
    if not lines:
        raise _invalid("the file holds no requests: one JSON object per line, e.g. {\"custom_id\": \"1\", "
                       "\"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {...}}")
    return lines


def _line(number: int, raw: str, lenient: bool) -> BatchLine:
    where = f"line {number}"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _invalid(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:  # [[[[...]]]] deeper than Python's stack
        raise _invalid(f"{where}: not valid JSON (it nests too deeply)")
    if not isinstance(data, dict):
        raise _invalid(f"{where}: must be a JSON object with custom_id, method, url and body")
    try:  # a \ud800 escape decodes to a lone surrogate, which Redis and the tokenizer refuse
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise _invalid(f"{where}: holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _invalid(f"{where}: 'custom_id' must be a non-empty string, got {custom_id!r}")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise _invalid(f"{where}: 'custom_id' must be at most {MAX_CUSTOM_ID} characters, got {len(custom_id)}")
    if data.get("method") != "POST":
        raise _invalid(f"{where}: 'method' must be \"POST\", got {data.get('method')!r}")
    url = data.get("url")
    if url not in ENDPOINTS:
        raise _invalid(f"{where}: 'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise _invalid(f"{where}: 'body' must be a JSON object (the request's body), got {type(body).__name__}")
    if body.get("stream"):
        raise _invalid(f"{where}: 'body.stream' must be false or absent: a batch's answers are written to "
                       f"its output file, not streamed")
    try:
        ENDPOINTS[url](body, lenient)
    except ApiError as exc:
        raise _invalid(f"{where} (custom_id {custom_id!r}): {exc.message}")
    return BatchLine(custom_id, url, body)


def _invalid(message: str) -> ApiError:
    return bad_request(message, param="file", code="invalid_file")


def output_line(custom_id: str, status_code: int, body: dict, request_id: Optional[str] = None) -> dict:
    """A request's answer (2xx) or its error response (4xx/5xx), as OpenAI's output and error files have it."""
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id or uuid.uuid4().hex[:24],
                         "body": body},
            "error": None}


def error_line(custom_id: str, code: str, message: str) -> dict:
    """A request that never got a response: the batch was cancelled or expired before it ran."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"
