"""The RQ job that runs a batch: its requests through the API, at the lowest priority, a few at once.

Each request goes to the API over HTTP (the official openai client), exactly as a player's would:
the same validation, tokenizing, admission and model queues. Two things keep live players first:
every batch request carries priority PRIORITY_MAX, so a worker takes any player's job before it,
and at most --batch-concurrency of them are in flight, so a batch never fills the workers' slots or
the queue's cap. A 429 (queue full, rate limit), 503 (no worker) or 504, or no answer at all, is
tried again after a backoff (Retry-After when the API sends one) until the batch is cancelled or
expires; any other error is the request's answer, written to the batch's error file.

Each finished request is kept in Redis at once (keys.batch_results) and counted in the batch's
record, so progress shows while it runs, and a job run again after its RQ worker died (RQ retries
an abandoned job) skips what is done. The output file is written at the end, in input order.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import openai

from api.auth import load_keys
from api.batch_input import BatchLine, error_line, output_line, parse_file
from api.batch_store import BatchStore
from api.errors import ApiError
from api.file_store import PURPOSE_OUTPUT, FileStore
from shared.protocol import PRIORITY_MAX
from shared.redis_client import connect
from shared.settings import Settings

log = logging.getLogger(__name__)

RETRYABLE = (0, 429, 503, 504)  # 0: no HTTP answer (API down or restarting, connection reset)
BACKOFF_FIRST_S, BACKOFF_MOST_S = 0.5, 60.0
LOOK_EVERY_S = 1.0  # a request waiting out a backoff looks this often whether the batch was cancelled


@dataclass
class Reply:
    status_code: int  # 0: no answer
    body: dict
    retry_after: Optional[float] = None  # seconds, from the Retry-After header
    request_id: Optional[str] = None


Sender = Callable[[str, dict], Reply]  # (url as in the input line, body) -> the API's reply


class HttpSender:
    """Sends a batch's requests to the API with the official client; retries are the runner's."""

    def __init__(self, settings: Settings):
        api_keys = load_keys(settings)  # the batch worker shares the API's settings, keys included
        self.client = openai.OpenAI(base_url=settings.api_url, api_key=api_keys[0] if api_keys else "unused",
                                    max_retries=0, timeout=settings.request_timeout + 30)

    def __call__(self, url: str, body: dict) -> Reply:
        try:
            answer = self.client.post(url.removeprefix("/v1"), body=body, cast_to=object)
            return Reply(200, answer, request_id=answer.get("id") if isinstance(answer, dict) else None)
        except openai.APIStatusError as exc:
            try:
                error = exc.response.json()
            except ValueError:
                error = {"error": {"message": exc.response.text[:2000], "type": "api_error",
                                   "param": None, "code": None}}
            return Reply(exc.status_code, error, _seconds(exc.response.headers.get("retry-after")))
        except openai.APIConnectionError as exc:  # also a timeout
            return Reply(0, {"error": {"message": f"no answer from the API: {exc}",
                                       "type": "api_connection_error", "param": None, "code": None}})


def _seconds(header: Optional[str]) -> Optional[float]:
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None


@dataclass
class BatchRun:
    batch_id: str
    batches: BatchStore
    files: FileStore
    send: Sender
    concurrency: int = 8
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    _expires_at: float = field(default=0.0, init=False)

    def run(self) -> str:
        """Runs the batch to its end; returns the status it ended in."""
        batch = self.batches.get(self.batch_id)
        if batch is None or batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch["status"] if batch else "missing"
        self._expires_at = batch["expires_at"]
        lines = self._lines(batch["input_file_id"])
        if lines is None:
            return "failed"
        if batch["status"] == "validating":
            moved, found = self.batches.move(self.batch_id, ("validating",), "in_progress")
            if not moved and found != "in_progress":
                return found  # cancelled before it started
        if self.batches.status(self.batch_id) == "in_progress":
            self._send_all(lines)
        return self._finish(lines)

    def _lines(self, input_file_id: str) -> Optional[list[BatchLine]]:
        content = self.files.content(input_file_id)
        try:
            if content is None:
                raise ApiError(400, f"the input file {input_file_id} no longer exists", code="file_not_found")
            return parse_file(content)
        except ApiError as exc:
            errors = {"object": "list", "data": [{"code": exc.code, "message": exc.message,
                                                  "param": "input_file_id", "line": None}]}
            self.batches.move(self.batch_id, ("validating", "in_progress"), "failed", errors=json.dumps(errors))
            return None

    def _stopping(self) -> bool:
        return self.clock() >= self._expires_at or self.batches.status(self.batch_id) != "in_progress"

    def _send_all(self, lines: list[BatchLine]) -> None:
        done = self.batches.done_indexes(self.batch_id)
        todo = [i for i in range(len(lines)) if i not in done]
        log.info("batch %s: %d requests to send (%d done before), %d at once",
                 self.batch_id, len(todo), len(done), self.concurrency)
        slots = threading.BoundedSemaphore(self.concurrency)
        crashed: list[BaseException] = []

        def one(index: int) -> None:
            try:
                self._send_one(index, lines[index])
            except BaseException as exc:  # e.g. Redis gone: the job fails, and RQ's rerun resumes it
                crashed.append(exc)
            finally:
                slots.release()

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="batch") as pool:
            for index in todo:
                slots.acquire()  # bounded: a new request only when one has finished
                if crashed or self._stopping():
                    slots.release()
                    break
                pool.submit(one, index)
        if crashed:
            raise crashed[0]

    def _send_one(self, index: int, line: BatchLine) -> None:
        # Lowest priority, whatever the line asked for: a batch waits behind every live player.
        body = dict(line.body, priority=PRIORITY_MAX)
        for attempt in range(1_000_000):
            reply = self.send(line.url, body)
            if reply.status_code not in RETRYABLE:
                break
            backoff = min(BACKOFF_MOST_S, BACKOFF_FIRST_S * 2 ** min(attempt, 16)) * random.uniform(0.5, 1.0)
            delay = min(BACKOFF_MOST_S, reply.retry_after) if reply.retry_after is not None else backoff
            log.info("batch %s: %s got %d, again in %.1f s", self.batch_id, line.custom_id,
                     reply.status_code, delay)
            if not self._wait(delay):
                return  # cancelled or expired: the request stays unsent
        ok = 200 <= reply.status_code < 300
        self.batches.record(self.batch_id, index, output_line(line.custom_id, reply.status_code, reply.body,
                                                              reply.request_id), ok)

    def _wait(self, seconds: float) -> bool:
        """Sleep `seconds`, looking now and then whether the batch stopped; False if it did."""
        give_up = self.clock() + seconds
        while not self._stopping():
            left = give_up - self.clock()
            if left <= 0:
                return True
            self.sleep(min(LOOK_EVERY_S, left))
        return False

    def _finish(self, lines: list[BatchLine]) -> str:
        status = self.batches.status(self.batch_id)
        if status == "in_progress":
            if self.clock() >= self._expires_at:
                status = "expired"
            else:
                moved, status = self.batches.move(self.batch_id, ("in_progress",), "finalizing")
                status = "completed" if moved else status
        final = "cancelled" if status == "cancelling" else status
        if final not in ("completed", "expired", "cancelled"):
            return final  # failed meanwhile (RQ's failure callback): nothing to write
        ids = self._write_files(lines, final)
        allowed = {"completed": ("finalizing",), "expired": ("in_progress",), "cancelled": ("cancelling",)}[final]
        moved, found = self.batches.move(self.batch_id, allowed, final, **ids)
        if not moved and found == "cancelling":  # cancelled while it expired
            final = "cancelled"
            self.batches.move(self.batch_id, ("cancelling",), final, **ids)
        self.batches.forget_results(self.batch_id)
        log.info("batch %s: %s", self.batch_id, final)
        return final

    def _write_files(self, lines: list[BatchLine], final: str) -> dict:
        """The output file (2xx answers) and the error file (the rest), in input order."""
        results = self.batches.results(self.batch_id)
        answers, errors = [], []
        for index, line in enumerate(lines):
            result = results.get(index)
            if result is None:  # never ran: the batch was cancelled or expired first
                errors.append(error_line(line.custom_id, f"batch_{final}",
                                         f"the batch was {final} before this request ran"))
            elif 200 <= result["response"]["status_code"] < 300:
                answers.append(result)
            else:
                errors.append(result)
        ids = {}
        for name, part, rows in (("output_file_id", "output", answers), ("error_file_id", "errors", errors)):
            if rows:
                # ASCII: a model's text may hold U+2028 or U+0085, which many readers (Python's
                # str.splitlines among them) take for a line break inside a JSONL line.
                content = "".join(json.dumps(row) + "\n" for row in rows).encode()
                ids[name] = self.files.create(content, f"{self.batch_id}_{part}.jsonl", PURPOSE_OUTPUT)["id"]
        return ids


# What the RQ worker runs. `configure` is called by batch/__main__.py before it forks job processes.

_settings: Optional[Settings] = None


def configure(settings: Settings) -> None:
    global _settings
    _settings = settings


def run_batch(batch_id: str) -> str:
    settings = _settings or Settings.from_env()
    client = connect(settings.redis_url, socket_connect_timeout=5, socket_timeout=30)
    runner = BatchRun(batch_id, BatchStore(client), FileStore(client, settings.files_dir), HttpSender(settings),
                      concurrency=max(1, settings.batch_concurrency))
    return runner.run()


def on_failure(job, connection, exc_type, exc_value, traceback) -> None:
    """RQ gave up on the job (it raised, or its worker died, with no retries left): the batch failed."""
    if job.retries_left:
        return  # RQ runs it again; the rerun picks up where it stopped
    message = f"the batch job failed: {exc_type.__name__}: {exc_value}"
    errors = {"object": "list", "data": [{"code": "batch_job_failed", "message": message, "param": None,
                                          "line": None}]}
    BatchStore(connection).move(job.args[0], ("validating", "in_progress", "finalizing", "cancelling"),
                                "failed", errors=json.dumps(errors))
