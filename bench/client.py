"""The benchmark's HTTP client: one completion, whole or streamed, against an OpenAI-shaped server.

Plain urllib, one connection per request: nothing to configure or pool, and it behaves the same
under 64 threads as under one. A streamed request records when each piece of text arrived, which
is what time-to-first-token and the gaps between tokens are computed from.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional


class StreamError(ValueError):
    """The server sent an error event in the middle of a stream."""


# Everything a request can fail with: URLError/HTTPError/timeouts/resets are
# OSErrors, truncated bodies are HTTPExceptions, bad JSON is a ValueError.
REQUEST_ERRORS = (OSError, http.client.HTTPException, ValueError, KeyError, TypeError)


@dataclass
class Outcome:
    """One request, timed with time.perf_counter(): when it was sent, when it ended, and (when
    streamed) when each chunk carrying text arrived."""
    sent_at: float
    done_at: float
    completion_tokens: int
    prompt_tokens: Optional[int] = None
    chunk_times: list[float] = field(default_factory=list)
    # The caller stopped reading before the end (see stream_complete); completion_tokens is then
    # 0, as the server never said how many tokens it wrote.
    cancelled: bool = False

    @property
    def seconds(self) -> float:
        return self.done_at - self.sent_at

    @property
    def ttft(self) -> Optional[float]:
        """Seconds to the first text, or None when no text came (or not streamed)."""
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None


def describe_error(exc: BaseException) -> str:
    # HTTPError is a URLError, so it must be checked first to keep its status.
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = json.loads(exc.read())
            message = body.get("error", {}).get("message") or body.get("detail") or body
        except Exception:  # a non-JSON error page: the reason phrase will do
            message = exc.reason
        return f"HTTP {exc.code}: {message}"
    if isinstance(exc, urllib.error.URLError):
        return f"connection failed: {exc.reason}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, StreamError):
        return f"error in stream: {exc}"
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return f"bad response: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def get_first_model(url: str, timeout: float = 10) -> Optional[str]:
    """The first model id the server lists, or None if it lists none."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/models", timeout=timeout) as resp:
        models = json.loads(resp.read()).get("data") or []
    return models[0]["id"] if models else None


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _body(model: str, prompt: str, tokens: int, temperature: float, ignore_eos: bool,
          extra: Optional[dict] = None) -> dict:
    """`extra`: more request fields (a response_format, penalties...)."""
    return {"model": model, "prompt": prompt, "max_tokens": tokens,
            "temperature": temperature, "ignore_eos": ignore_eos, **(extra or {})}


def complete(url: str, model: str, prompt: str, tokens: int, temperature: float,
             ignore_eos: bool, timeout: float, extra: Optional[dict] = None) -> Outcome:
    """One whole completion; raises one of REQUEST_ERRORS on failure."""
    sent = time.perf_counter()
    with _post(url, _body(model, prompt, tokens, temperature, ignore_eos, extra), timeout) as resp:
        reply = json.loads(resp.read())
    # Stop the clock only after the whole body is read: that is what a player waits for.
    done = time.perf_counter()
    usage = reply["usage"]
    return Outcome(sent, done, int(usage["completion_tokens"]), usage.get("prompt_tokens"))


def sse_events(lines):
    """The data of each server-sent event in an iterable of byte lines, as text; a blank line
    ends an event, and an event's data lines are joined with newlines, as the SSE spec says."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # other fields (event:, id:, retry:) and comments (":...") carry nothing we need
    if data:
        yield "\n".join(data)


def chunk_text(chunk: dict) -> str:
    """The text a completions or chat-completions chunk adds (empty for a usage-only chunk)."""
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def stream_complete(url: str, model: str, prompt: str, tokens: int, temperature: float,
                    ignore_eos: bool, timeout: float,
                    stop: Optional[threading.Event] = None, extra: Optional[dict] = None) -> Outcome:
    """One streamed completion, timing each chunk that carries text.

    Tokens are counted from the usage chunk (stream_options.include_usage), as with a whole
    answer, because a chunk may carry several tokens' text. With `stop` set, the stream is closed
    at the next chunk, which cancels the request on a server that notices disconnects, and
    the outcome comes back marked cancelled.
    """
    body = _body(model, prompt, tokens, temperature, ignore_eos, extra)
    body.update(stream=True, stream_options={"include_usage": True})
    times: list[float] = []
    usage = None
    sent = time.perf_counter()
    with _post(url, body, timeout) as resp:
        for data in sse_events(resp):
            now = time.perf_counter()  # before parsing: the arrival, not our JSON speed
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                error = chunk["error"]
                raise StreamError(error.get("message", error) if isinstance(error, dict) else error)
            if chunk_text(chunk):
                times.append(now)
            usage = chunk.get("usage") or usage
            if stop is not None and stop.is_set():
                return Outcome(sent, now, 0, None, times, cancelled=True)
    done = time.perf_counter()
    if usage is None:
        raise StreamError("the stream ended without a usage chunk")
    return Outcome(sent, done, int(usage["completion_tokens"]), usage.get("prompt_tokens"), times)


def request(url: str, model: str, prompt: str, tokens: int, *, temperature: float = 0.8,
            ignore_eos: bool = True, timeout: float = 600, stream: bool = False,
            stop: Optional[threading.Event] = None, extra: Optional[dict] = None) -> Outcome:
    """complete() or stream_complete(), by `stream`."""
    if stream:
        return stream_complete(url, model, prompt, tokens, temperature, ignore_eos, timeout, stop, extra)
    return complete(url, model, prompt, tokens, temperature, ignore_eos, timeout, extra)
