"""The soak's judge (bench/soak_client.py): a server that misbehaves in each way must be called
what it is. A soak that reports 0 lost is worth only as much as its eye for a lost request. The
crowd's judge (bench/client.py) reads through the same client, and is asked here too."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.faults import plan
from bench.soak_client import ANSWERED, FAILED, HUNG_UP, LOST, Attempt, compare, send

REFERENCE = "Once upon a time a dragon guarded the gate."


def event(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def text_chunk(text: str) -> bytes:
    return event({"choices": [{"index": 0, "text": text}]})


class Misbehaving(BaseHTTPRequestHandler):
    """POST /<case>/completions answers as <case> says."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *_):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        case = self.path.split("/")[1]
        if case == "whole":
            self._json(200, {"choices": [{"text": REFERENCE}], "usage": {"completion_tokens": 9}})
        elif case == "overloaded":
            self._json(503, {"error": {"message": "no worker", "type": "service_unavailable",
                                       "param": None, "code": "service_unavailable"}})
        elif case == "bare-500":
            self._raw(500, b"<html>oops</html>", "text/html")
        elif case == "empty":
            self._json(200, {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}})
        elif case == "silent":
            time.sleep(2)
            self._json(200, {"choices": [{"text": REFERENCE}], "usage": {"completion_tokens": 9}})
        else:
            self._stream(case)

    def _json(self, status: int, body: dict):
        self._raw(status, json.dumps(body).encode(), "application/json")

    def _raw(self, status: int, body: bytes, kind: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, case: str):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [text_chunk(REFERENCE[:10]), text_chunk(REFERENCE[10:])]
        if case == "stream-error":
            events = events[:1] + [event({"error": {"message": "worker died", "code": "worker_crashed"}})]
        elif case == "repeated":  # a second worker writes it all again after the first died
            events = events[:1] + [text_chunk(REFERENCE)]
        events += [event({"choices": [], "usage": {"completion_tokens": 9}}), event("[DONE]")]
        if case == "no-done":
            events = events[:2]
        for body in events[:1] if case == "dropped" else events:
            self.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n")
            self.wfile.flush()
        if case == "dropped":  # half a chunk, then the connection goes
            self.wfile.write(b"40\r\ndata: {\"cho")
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # clients that hang up or time out on purpose: no tracebacks


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Misbehaving)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


ANSWER_WITHIN_S = 10.0  # the client timeout where the stand-in server answers at once


def judged(server: str, case: str, stream: bool, hang_up_after: int = 0) -> Attempt:
    began = time.monotonic()
    attempt = Attempt(player=0, item=0, stream=stream, hang_up_after=hang_up_after, sent=0.0)
    # A short client timeout only where running past it is the case (the server stays silent 2 s);
    # elsewhere 10 s, so that a loaded machine's late answer is not called silent.
    timeout = 0.5 if case == "silent" else ANSWER_WITHIN_S
    send(f"{server}/{case}", "m", "prompt", 9, attempt, timeout=timeout, clock=lambda: time.monotonic() - began)
    compare(attempt, REFERENCE)
    return attempt


@pytest.mark.parametrize("case, stream, hang_up, outcome, detail, verdict", [
    ("whole", False, 0, ANSWERED, "", ""),
    ("complete", True, 0, ANSWERED, "", ""),
    ("complete", True, 1, HUNG_UP, "closed after 1 chunk(s)", ""),
    ("overloaded", False, 0, FAILED, "HTTP 503 service_unavailable", ""),
    ("bare-500", False, 0, FAILED, "HTTP 500 (no error body)", ""),
    ("stream-error", True, 0, FAILED, "stream error worker_crashed", ""),
    ("empty", False, 0, LOST, "empty answer", ""),
    ("silent", False, 0, LOST, "silent past the client timeout", ""),
    ("no-done", True, 0, LOST, "stream ended without [DONE]", ""),
    ("dropped", True, 0, LOST, "connection dropped (IncompleteRead)", ""),
    ("repeated", True, 0, ANSWERED, "", "repeated"),
])
def test_each_misbehaviour_is_called_what_it_is(server, case, stream, hang_up, outcome, detail, verdict):
    attempt = judged(server, case, stream, hang_up)
    assert (attempt.outcome, attempt.detail, attempt.verdict) == (outcome, detail, verdict)
    assert attempt.done >= attempt.sent


def test_compare_with_the_reference():
    def verdict(outcome: str, text: str) -> tuple[str, str]:
        attempt = Attempt(0, 0, True, 0, 0.0, outcome=outcome, text=text)
        compare(attempt, REFERENCE)
        return attempt.outcome, attempt.verdict

    assert verdict(ANSWERED, REFERENCE[:12]) == (LOST, "truncated")
    assert verdict(ANSWERED, REFERENCE[:12] + REFERENCE) == (ANSWERED, "repeated")
    assert verdict(ANSWERED, "Once upon a time a knight guarded the gate.") == (ANSWERED, "differs")
    assert verdict(HUNG_UP, REFERENCE[:12]) == (HUNG_UP, "")
    assert verdict(HUNG_UP, REFERENCE[:10] + REFERENCE[:5]) == (HUNG_UP, "repeated")


def test_fault_plan():
    faults = [(f.at, f.kind) for f in plan(600, 60)]
    assert [at for at, kind in faults if kind == "kill"] == list(range(60, 541, 60))
    assert [kind for at, kind in faults].count("term") == 1 and [kind for at, kind in faults].count("redis") == 1
    assert all(at <= 580 for at, _ in faults)  # the last one's aftermath is measured too
    with pytest.raises(SystemExit, match="too short"):
        plan(60, 30)


def test_the_crowds_judge_reads_the_same_client(server):
    # bench.client.send reads for both judges: the crowd's wants a whole answer or an error.
    from bench.client import StreamError, complete, stream_complete

    whole = complete(f"{server}/whole", "m", "prompt", 9, 0, True, timeout=ANSWER_WITHIN_S)
    assert (whole.text, whole.completion_tokens, whole.chunk_times) == (REFERENCE, 9, [])
    streamed = stream_complete(f"{server}/complete", "m", "prompt", 9, 0, True, timeout=ANSWER_WITHIN_S)
    assert streamed.text == REFERENCE and streamed.completion_tokens == 9 and streamed.finished
    assert len(streamed.chunk_times) == 2 and streamed.ttft is not None
    with pytest.raises(StreamError, match="worker died"):
        stream_complete(f"{server}/stream-error", "m", "prompt", 9, 0, True, timeout=ANSWER_WITHIN_S)
    with pytest.raises(StreamError, match="usage"):
        stream_complete(f"{server}/no-done", "m", "prompt", 9, 0, True, timeout=ANSWER_WITHIN_S)
    stop = threading.Event()
    stop.set()
    cancelled = stream_complete(f"{server}/complete", "m", "prompt", 9, 0, True, ANSWER_WITHIN_S, stop)
    assert cancelled.cancelled and cancelled.completion_tokens == 0
    assert len(cancelled.chunk_times) == 1  # closed at the first chunk
