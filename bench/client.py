"""The benchmarks' one HTTP client: a completion, whole or streamed, sent and timed.

Plain urllib, one connection per request: nothing to configure or pool, and it behaves the same
under 64 threads as under one. Every bench sends through `send`, which records what came back
(the text, when each piece of it arrived, the usage, whether the stream ended with [DONE] or an
error event) without judging it. Two judges sit on top: `complete` / `stream_complete` raise on
anything short of a whole answer, which is what a crowd measuring speed wants; the soak
(bench/soak_client.py) sorts the same outcomes into answered, hung up, failed and lost.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional


class StreamError(ValueError):
    """The server sent an error event in the middle of a stream, or the stream fell short."""


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
    # The caller stopped reading before the end (`stop`); completion_tokens is then 0, as the
    # server never said how many tokens it wrote.
    cancelled: bool = False
    text: str = ""
    finished: bool = True  # a stream ended with [DONE] (a whole answer always has)
    error: Optional[dict] = None  # the error event that ended a stream
    overdue: bool = False  # a stream still going past `within` seconds, abandoned
    usage: Optional[dict] = None

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


def body(model: str, prompt: str, tokens: int, temperature: float, ignore_eos: bool,
         extra: Optional[dict] = None, stream: bool = False) -> dict:
    """A completion request; `extra`: more fields (a response_format, a seed...). A streamed one
    asks for the usage chunk, so its tokens are counted as a whole answer's are."""
    request = {"model": model, "prompt": prompt, "max_tokens": tokens,
               "temperature": temperature, "ignore_eos": ignore_eos, **(extra or {})}
    if stream:
        request.update(stream=True, stream_options={"include_usage": True})
    return request


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
    """The text a completions or chat-completions chunk (or whole reply) adds (empty for a
    usage-only chunk)."""
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def send(url: str, request: dict, timeout: float, *,
         stop: Optional[Callable[[Outcome], bool]] = None,
         within: Optional[float] = None) -> Outcome:
    """POST `request` to <url>/completions and read the answer, whole or streamed as it asks.

    Raises one of REQUEST_ERRORS for an HTTP error status, a connection that fails or drops, or
    a body that is not JSON; whatever else came back is in the Outcome, unjudged. `timeout`
    bounds each read; `within` bounds a whole stream, which a server could otherwise keep open
    forever with a trickle. `stop(outcome)`, asked after each streamed chunk, closes the stream
    when true (the server then cancels the request), and the outcome comes back cancelled.
    """
    sent = time.perf_counter()
    outcome = Outcome(sent, sent, 0)
    data = json.dumps(request).encode()
    req = urllib.request.Request(f"{url}/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        if request.get("stream"):
            _read_stream(resp, outcome, stop, within)
        else:
            reply = json.loads(resp.read())
            # Stop the clock only after the whole body is read: that is what a player waits for.
            outcome.done_at = time.perf_counter()
            outcome.text, outcome.usage = chunk_text(reply), reply["usage"]
    if outcome.usage is not None and not outcome.cancelled:
        outcome.completion_tokens = int(outcome.usage["completion_tokens"])
        outcome.prompt_tokens = outcome.usage.get("prompt_tokens")
    return outcome


def _read_stream(resp, outcome: Outcome, stop, within: Optional[float]) -> None:
    outcome.finished = False
    give_up = None if within is None else outcome.sent_at + within
    for data in sse_events(resp):
        now = time.perf_counter()  # before parsing: the arrival, not our JSON speed
        outcome.done_at = now
        if give_up is not None and now > give_up:
            outcome.overdue = True
            return
        if data == "[DONE]":
            outcome.finished = True
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            outcome.error = chunk
            return
        piece = chunk_text(chunk)
        if piece:
            outcome.chunk_times.append(now)
            outcome.text += piece
        outcome.usage = chunk.get("usage") or outcome.usage
        if stop is not None and stop(outcome):
            outcome.cancelled = True
            return  # leaving the `with` closes the connection: the server cancels the request
    outcome.done_at = time.perf_counter()


def _judged(outcome: Outcome) -> Outcome:
    """The outcome of a request that must have been answered whole; raises StreamError if not."""
    if outcome.error is not None:
        error = outcome.error["error"]
        raise StreamError(error.get("message", error) if isinstance(error, dict) else error)
    if outcome.usage is None and not outcome.cancelled:
        raise StreamError("the stream ended without a usage chunk")
    return outcome


def complete(url: str, model: str, prompt: str, tokens: int, temperature: float,
             ignore_eos: bool, timeout: float, extra: Optional[dict] = None) -> Outcome:
    """One whole completion; raises one of REQUEST_ERRORS on failure."""
    return _judged(send(url, body(model, prompt, tokens, temperature, ignore_eos, extra), timeout))


def stream_complete(url: str, model: str, prompt: str, tokens: int, temperature: float,
                    ignore_eos: bool, timeout: float,
                    stop: Optional[threading.Event] = None, extra: Optional[dict] = None) -> Outcome:
    """One streamed completion, timing each chunk that carries text.

    Tokens are counted from the usage chunk (stream_options.include_usage), as with a whole
    answer, because a chunk may carry several tokens' text. With `stop` set, the stream is closed
    at the next chunk, which cancels the request on a server that notices disconnects, and
    the outcome comes back marked cancelled.
    """
    request = body(model, prompt, tokens, temperature, ignore_eos, extra, stream=True)
    return _judged(send(url, request, timeout,
                        stop=None if stop is None else (lambda _: stop.is_set())))


def request(url: str, model: str, prompt: str, tokens: int, *, temperature: float = 0.8,
            ignore_eos: bool = True, timeout: float = 600, stream: bool = False,
            stop: Optional[threading.Event] = None, extra: Optional[dict] = None) -> Outcome:
    """complete() or stream_complete(), by `stream`."""
    if stream:
        return stream_complete(url, model, prompt, tokens, temperature, ignore_eos, timeout, stop, extra)
    return complete(url, model, prompt, tokens, temperature, ignore_eos, timeout, extra)
