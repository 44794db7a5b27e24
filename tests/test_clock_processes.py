"""Workers whose clocks are ten minutes off, as real processes on a private redis-server (the tests'
clock_skew_s fault, worker/faults.py, which every wall-clock reading of a worker goes through):
nothing a worker decides compares its clock with the API's. The logic alone is in test_clock.py."""
from __future__ import annotations

import time

import openai
import pytest

from shared import keys, metrics as names
from shared.protocol import Failure, decode_result
from tests.processes import (MODEL, Paused, free_port, get_json, logs, make_client, models_served, start_api, stop,
                             tiny_worker, wait_until)
from tests.prometheus_text import grew, scrape, value
from worker.faults import as_env

pytestmark = pytest.mark.timeout(180)

TEN_MINUTES = 600


def _worker_started(port: int) -> float:
    """The worker's start as its own wall clock told it (WorkerInfo.started, /v1/models' `created`):
    proof that the skew reached it, and so that the test below tests something."""
    [served] = get_json(f"http://127.0.0.1:{port}/v1/models")[1]["data"]
    return served["created"]


def test_a_worker_ten_minutes_ahead_answers_live_jobs_and_their_queue_wait_is_seconds(
        redis_alone, tiny_model_dirs, tmp_path):
    worker_port = free_port()
    worker = tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "worker", "--metrics-port", str(worker_port),
                         **as_env(clock_skew_s=TEN_MINUTES))
    port, api = start_api(redis_alone, tmp_path, "api")
    worker_metrics = f"http://127.0.0.1:{worker_port}/metrics"
    try:
        wait_until(lambda: MODEL in models_served(port), [worker, api], "the stack")
        assert _worker_started(port) > time.time() + TEN_MINUTES - 60
        client = make_client(port)
        before = scrape(worker_metrics)
        answers = [client.completions.create(model=MODEL, prompt=f"Tale {i}", max_tokens=4, temperature=0)
                   for i in range(3)]  # greedy: a sampled reply may end at its first token
        streamed = list(client.completions.create(model=MODEL, prompt="A streamed tale", max_tokens=4, stream=True))
        after = scrape(worker_metrics)
        oldest = value(scrape(f"http://127.0.0.1:{port}/metrics"), names.OLDEST_JOB_AGE, model=MODEL)
    finally:
        stop(api), stop(worker)
    assert all(a.usage.completion_tokens >= 1 for a in answers), logs(worker)
    assert streamed and streamed[-1].choices[0].finish_reason in ("stop", "length")
    taken = grew(before, after, names.QUEUE_WAIT + "_count", model=MODEL)
    waited = grew(before, after, names.QUEUE_WAIT + "_sum", model=MODEL)
    assert taken == 4
    assert 0 <= waited / taken < 5  # seconds, not the ten minutes between the clocks
    assert oldest == 0


def test_a_worker_ten_minutes_behind_drops_a_job_whose_deadline_passed(redis_alone, tiny_model_dirs, tmp_path):
    worker_port = free_port()
    worker = tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "worker", "--metrics-port", str(worker_port),
                         **as_env(clock_skew_s=-TEN_MINUTES))
    port, api = start_api(redis_alone, tmp_path, "api", "--request-timeout", "2")
    worker_metrics = f"http://127.0.0.1:{worker_port}/metrics"
    redis_client = redis_alone.client()
    try:
        wait_until(lambda: MODEL in models_served(port), [worker, api], "the stack")
        assert _worker_started(port) < time.time() - TEN_MINUTES + 60
        client = make_client(port)
        before = scrape(worker_metrics)
        paused = Paused(worker, redis_client)  # alive to the API, taking nothing
        paused_at = time.monotonic()
        try:
            with pytest.raises(openai.APIStatusError) as timed_out:
                client.completions.create(model=MODEL, prompt="Too late", max_tokens=4)
            # As if the API had gone before it could cancel the job: the worker alone must see it is dead.
            [cancelled] = redis_client.keys(keys.cancel(MODEL, "*"))
            job_id = cancelled.decode().removeprefix(keys.cancel(MODEL, ""))
            redis_client.delete(cancelled)
            time.sleep(max(0.0, 3 - (time.monotonic() - paused_at)))
        finally:
            paused.resume()
        wait_until(lambda: redis_client.exists(keys.answer(MODEL, job_id)), [worker, api], "the dead job's answer")
        after = scrape(worker_metrics)
    finally:
        stop(api), stop(worker)
    assert timed_out.value.status_code == 504 and timed_out.value.code == "timeout"
    answer = decode_result(redis_client.get(keys.answer(MODEL, job_id)))
    assert isinstance(answer, Failure) and answer.code == "timeout", (answer, logs(worker))
    assert grew(before, after, names.GENERATED_TOKENS, model=MODEL) == 0  # not decoded
    # It waited the ~3 s of the pause: not 0, as it would be were the worker's clock read.
    assert grew(before, after, names.QUEUE_WAIT + "_count", model=MODEL) == 1
    assert 2.5 <= grew(before, after, names.QUEUE_WAIT + "_sum", model=MODEL) < 30
