"""One real stack a test module shares: a redis-server, one worker of the tiny Llama and the API,
as processes, with OpenAI's own client; and reading what its streams sent.

Module-scoped (the model loads once per module): the integration tests and the tests of each
request field that must cross the real path (logprobs, structured output, the fields' features)
import these fixtures. Tests that stop or kill things start processes of their own
(tests/processes.py).
"""
from __future__ import annotations

import pytest

from tests.processes import MODEL, live_worker_ids, make_client, models_served, start_api, stop, tiny_worker, wait_until


class Stack:
    """The shared stack's processes, its API's port and a client of its Redis."""

    def __init__(self, redis_server, port, worker, api):
        self.redis_server, self.port, self.worker, self.api = redis_server, port, worker, api
        self.redis = redis_server.client()

    def worker_ids(self, model: str = MODEL) -> list[str]:
        """Ids of the live workers of `model`, as their heartbeats announce them."""
        return live_worker_ids(self.redis, model)


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model_dirs, tmp_path_factory):
    redis_server.client().flushdb()  # no stale workers or queues from other tests
    log_dir = tmp_path_factory.mktemp("stack-logs")
    worker = tiny_worker(tiny_model_dirs["llama"], redis_server, log_dir, "worker", "--batch", "16")
    # No cap on the queue: these tests are about answers, not backpressure (tests/test_reliability.py).
    port, api = start_api(redis_server, log_dir, "api", "--max-queue", "0")
    try:
        wait_until(lambda: MODEL in models_served(port), [worker, api], f"/v1/models to list {MODEL}")
        yield Stack(redis_server, port, worker, api)
    finally:
        stop(api), stop(worker)


@pytest.fixture(scope="module")
def client(stack):
    with make_client(stack.port) as c:
        yield c


def stream_text(stream, chat: bool) -> tuple[str, list]:
    """Concatenated text of a one-choice stream, and every chunk."""
    chunks = list(stream)
    pieces = []
    for c in chunks:
        for choice in c.choices:
            pieces.append((choice.delta.content if chat else choice.text) or "")
    return "".join(pieces), chunks


def finish_reasons(chunks) -> list:
    """Every finish_reason a stream's chunks carried, in order (one per choice that ended)."""
    return [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
