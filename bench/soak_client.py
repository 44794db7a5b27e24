"""One soak request and what became of it: the soak's judge, on top of bench.client.

Every request ends in exactly one of:
  answered  the whole answer came (a streamed one ended with [DONE])
  hung_up   a streaming client that closed the stream on purpose after a few chunks
  failed    the server said why: an HTTP error status, or an error event in the stream
  lost      neither: silence past the client's timeout, a connection dropped without an error, a
            stream that ended without [DONE], an empty answer (or, once compared with its
            reference, a truncated one)
The text that came is kept, to be compared with the request's reference answer (bench/soak.py).
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from bench import client

ANSWERED, HUNG_UP, FAILED, LOST = "answered", "hung_up", "failed", "lost"
SEED = 0  # with temperature 0 the seed changes nothing; sent so a sampling change would still repeat


@dataclass
class Attempt:
    player: int
    item: int  # which of the soak's distinct requests
    stream: bool
    hang_up_after: int  # streamed text chunks after which the client closes the stream (0: never)
    sent: float  # seconds since the players started
    done: float = 0.0
    outcome: str = ""
    detail: str = ""  # the error code or status, or how it was lost
    message: str = ""  # the server's error message, for a failed one
    text: str = ""
    completion_tokens: Optional[int] = None
    ttft: Optional[float] = None
    verdict: str = ""  # after comparison with the reference: "" (as the reference), or what differs

    @property
    def latency(self) -> float:
        return self.done - self.sent

    def to_dict(self) -> dict:
        row = asdict(self)
        row["text_chars"] = len(row.pop("text"))  # the texts are compared, not kept in the results
        for name in ("sent", "done", "ttft"):
            row[name] = None if row[name] is None else round(row[name], 3)
        return row


def error_label(payload: dict) -> str:
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "error")
    return "error"


def error_message(payload: dict) -> str:
    error = payload.get("error")
    return str(error.get("message", ""))[:200] if isinstance(error, dict) else ""


def send(url: str, model: str, prompt: str, max_tokens: int, attempt: Attempt, timeout: float,
         clock: Callable[[], float]) -> Attempt:
    """Send the request (bench.client.send), and fill in `attempt`'s outcome from what came.

    Greedy, and every token written (ignore_eos): the same text whatever the batch, and a
    truncated answer is seen by its length. A streamed one must end within `timeout` as a whole,
    not only between reads."""
    request = client.body(model, prompt, max_tokens, 0, True, {"seed": SEED}, attempt.stream)
    hang_up = (lambda o: len(o.chunk_times) >= attempt.hang_up_after) if attempt.hang_up_after else None
    try:
        outcome = client.send(url, request, timeout, stop=hang_up, within=timeout)
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read())
            label, attempt.message = f"HTTP {exc.code} {error_label(payload)}", error_message(payload)
        except (ValueError, OSError, http.client.HTTPException):
            label = f"HTTP {exc.code} (no error body)"
        _end(attempt, clock, FAILED, label)
    except urllib.error.URLError as exc:
        reason = exc.reason
        how = "silent past the client timeout" if isinstance(reason, (TimeoutError, socket.timeout)) \
            else f"connection failed ({type(reason).__name__})"
        _end(attempt, clock, LOST, how)
    except (TimeoutError, socket.timeout):
        _end(attempt, clock, LOST, "silent past the client timeout")
    except (http.client.HTTPException, ConnectionError) as exc:
        _end(attempt, clock, LOST, f"connection dropped ({type(exc).__name__})")
    except OSError as exc:
        _end(attempt, clock, LOST, f"connection error ({type(exc).__name__})")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        _end(attempt, clock, LOST, f"unreadable answer ({type(exc).__name__})")
    else:
        _judge(attempt, outcome, clock)
    return attempt


def _judge(attempt: Attempt, outcome: client.Outcome, clock) -> None:
    """The outcome of a request the server answered with a 200: what came, and how it ended."""
    attempt.text, attempt.ttft = outcome.text, outcome.ttft
    if outcome.usage:
        attempt.completion_tokens = int(outcome.usage["completion_tokens"])
    if outcome.overdue:
        _end(attempt, clock, LOST, "no end within the client timeout")
    elif outcome.error is not None:
        attempt.message = error_message(outcome.error)
        _end(attempt, clock, FAILED, f"stream error {error_label(outcome.error)}")
    elif outcome.cancelled:
        _end(attempt, clock, HUNG_UP, f"closed after {len(outcome.chunk_times)} chunk(s)")
    elif not outcome.finished:
        _end(attempt, clock, LOST, "stream ended without [DONE]")
    elif not outcome.text:
        _end(attempt, clock, LOST, "empty answer")
    else:
        _end(attempt, clock, ANSWERED, "")


def _end(attempt: Attempt, clock, outcome: str, detail: str) -> None:
    attempt.done, attempt.outcome, attempt.detail = clock(), outcome, detail


def compare(attempt: Attempt, reference: str) -> None:
    """Set `verdict` (and turn a truncated answer into a lost one): an answer must be its
    reference exactly; a client that hung up must have received a prefix of it."""
    got = attempt.text
    if attempt.outcome == HUNG_UP:
        if not reference.startswith(got):
            attempt.verdict = "repeated" if _repeats(got, reference) else "differs"
        return
    if attempt.outcome != ANSWERED or got == reference:
        return
    if reference.startswith(got):
        attempt.outcome, attempt.detail, attempt.verdict = LOST, "truncated answer", "truncated"
    else:
        attempt.verdict = "repeated" if _repeats(got, reference) else "differs"


def _repeats(got: str, reference: str) -> bool:
    """Text written twice: longer than the reference, or, where it leaves the reference, starting
    the reference over (a worker that died after streaming part of it, and a second that wrote it
    all again). Only a label: any text unlike the reference counts as a mismatch."""
    if len(got) > len(reference):
        return True
    common = 0
    while common < min(len(got), len(reference)) and got[common] == reference[common]:
        common += 1
    rest = got[common:]
    probe = min(len(rest), common, 8)
    return probe >= 3 and rest[:probe] == reference[:probe]
