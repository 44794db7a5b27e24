"""Prometheus metrics, in-process: the API's (Flask's test client on fakeredis) and a worker's (its
engines' numbers, its histograms). tests/test_metrics_processes.py checks them on real processes and
through a real Prometheus.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import replace

import fakeredis
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from redis.backoff import NoBackoff
from redis.retry import Retry

import api.__main__
from api.app import create_app
from shared import keys, metrics as names
from shared.protocol import Failure, Final, Job, SamplingParams, TextDelta, encode_result
from shared.settings import Settings
from tests.engines import make_engine
from tests.fake_workers import MODEL as FAKE_MODEL, next_job, register_worker
from tests.processes import free_port
from tests.prometheus_text import grew, has, parse, value
from worker.job_queue import JobQueue
from worker.metrics import EngineCollector, WorkerMetrics
from worker.static_engine import StaticEngine

pytestmark = pytest.mark.timeout(240)


# Reading metrics


# The API, in-process (Flask's test client, fakeredis)

@pytest.fixture
def api_client(fake_redis):
    return create_app(Settings(request_timeout=5), client=fake_redis).test_client()


def _metrics(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.content_type.startswith("text/plain")
    return parse(response.get_data(as_text=True))


def test_requests_are_counted_by_route_and_status_and_errors_by_code(api_client):
    before = _metrics(api_client)
    for path in ["/health", "/v1/nothing/here", "/favicon.ico"]:
        api_client.get(path, buffered=True)  # buffered: the test client closes the response then
    api_client.post("/v1/completions", data="{not json", buffered=True)
    api_client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, buffered=True)  # no worker: 503
    after = _metrics(api_client)
    assert grew(before, after, names.REQUESTS, route="/health", status=200) == 1
    # Unknown paths share one label value, whatever they are: the label's values stay bounded.
    assert grew(before, after, names.REQUESTS, route="unmatched", status=404) == 2
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=400) == 1
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=503) == 1
    assert grew(before, after, names.ERRORS, code="invalid_json") == 1
    assert grew(before, after, names.ERRORS, code="service_unavailable") == 1
    assert grew(before, after, names.ERRORS, code="invalid_request_error") == 2  # the 404s: no code, a type
    assert grew(before, after, names.REQUEST_LATENCY + "_count", route="/v1/completions") == 2
    assert not any(n.startswith(names.REQUESTS) and dict(ls).get("route") == "/metrics" for n, ls in after), \
        "a scrape is not an API request"


def _stand_in_worker(client, answers: int, fail: bool = False) -> threading.Thread:
    """Takes `answers` jobs and writes each: a streamed job gets a piece of text first."""
    def run():
        for _ in range(answers):
            job = next_job(client, FAKE_MODEL)
            if fail:
                client.publish(keys.channel(job.model, job.id), encode_result(Failure("it broke", code="worker_error")))
                continue
            if job.stream:
                client.publish(keys.channel(job.model, job.id), encode_result(TextDelta(" and", 0, 1)))
            client.publish(keys.channel(job.model, job.id), encode_result(Final(" and then", "length",
                                                                                len(job.prompt_ids), 2)))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_token_counters_are_the_sum_of_usage_and_streams_time_their_first_token(fake_redis):
    register_worker(fake_redis)
    client = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    before = _metrics(client)
    _stand_in_worker(fake_redis, answers=4)
    usages = []
    for body in [{"prompt": "Once upon a time", "max_tokens": 2},
                 {"prompt": ["One", "Two"], "max_tokens": 2}]:
        response = client.post("/v1/completions", json={"model": FAKE_MODEL, **body})
        usages.append(response.get_json()["usage"])
    response = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "A stream", "max_tokens": 2,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in response.get_data(as_text=True).splitlines()
              if line.startswith("data: {")]
    usages.append(events[-1]["usage"])
    after = _metrics(client)
    assert grew(before, after, names.PROMPT_TOKENS, model=FAKE_MODEL) == sum(u["prompt_tokens"] for u in usages)
    assert grew(before, after, names.COMPLETION_TOKENS, model=FAKE_MODEL) == 8 == \
        sum(u["completion_tokens"] for u in usages)
    # Streams only: a whole answer's first token reaches its client with its last.
    assert grew(before, after, names.TIME_TO_FIRST_TOKEN + "_count", model=FAKE_MODEL) == 1


def test_an_error_inside_a_stream_is_counted_by_its_code(fake_redis):
    register_worker(fake_redis)
    client = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    before = _metrics(client)
    _stand_in_worker(fake_redis, answers=1, fail=True)
    response = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "x", "stream": True})
    assert '"code": "worker_error"' in response.get_data(as_text=True)
    after = _metrics(client)
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=200) == 1
    assert grew(before, after, names.ERRORS, code="worker_error") == 1
    assert grew(before, after, names.COMPLETION_TOKENS) == 0


def _queue_job(client, model: str, priority: int, enqueued_at: float) -> None:
    job = Job(id=f"job-{priority}-{enqueued_at}", model=model, prompt_ids=[1, 2], params=SamplingParams(),
              timeout_s=60, enqueued_at=enqueued_at, priority=priority)
    client.rpush(keys.queue(model, priority), job.to_json())


def test_queues_workers_and_worker_starts_are_read_from_redis_when_scraped(fake_redis, api_client):
    queue = register_worker(fake_redis)  # alive: a heartbeat
    queue.count_start(), queue.count_start()  # it started twice (a restart)
    now = time.time()
    _queue_job(fake_redis, FAKE_MODEL, 0, now - 30)
    _queue_job(fake_redis, FAKE_MODEL, 0, now - 5)
    _queue_job(fake_redis, FAKE_MODEL, -5, now - 12)  # taken first, but not the oldest
    # Another model: its only worker is gone (announced, no heartbeat), its jobs wait.
    fake_redis.hset(keys.WORKERS, "gone-1", "other")
    _queue_job(fake_redis, "other", 3, now - 2)
    # And one not served for days: forgotten, not reported as a model with no worker.
    fake_redis.zadd(keys.MODELS, {"retired": now - 3 * 24 * 3600})

    samples = _metrics(api_client)
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=0) == 2
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=-5) == 1
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL) == 3  # every priority is a series
    assert has(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=10)
    assert 30 <= value(samples, names.OLDEST_JOB_AGE, model=FAKE_MODEL) < 40
    assert value(samples, names.WORKERS_ALIVE, model=FAKE_MODEL) == 1
    assert value(samples, names.WORKER_STARTS, model=FAKE_MODEL) == 2
    assert value(samples, names.QUEUE_DEPTH, model="other", priority=3) == 1
    assert has(samples, names.WORKERS_ALIVE, model="other") and value(samples, names.WORKERS_ALIVE, model="other") == 0
    assert not has(samples, names.WORKERS_ALIVE, model="retired")

    fake_redis.delete(*keys.queues(FAKE_MODEL))
    samples = _metrics(api_client)
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL) == 0
    assert value(samples, names.OLDEST_JOB_AGE, model=FAKE_MODEL) == 0


def test_metrics_still_answer_while_redis_is_down():
    dead = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))  # no retries: a refusal at once
    client = create_app(Settings(), client=dead).test_client()
    samples = _metrics(client)
    assert not has(samples, names.QUEUE_DEPTH)


def test_the_api_refuses_to_start_if_metrics_would_count_per_process():
    # This test process has imported prometheus_client already: in gunicorn's processes that would
    # mean each reports only its own requests, so `python -m api` stops rather than mislead.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        api.__main__._metrics_dir()


# A worker's metrics, in-process

def _exposition(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def _shared_prefix_jobs(count: int) -> list[Job]:
    prefix = list(range(10, 42))  # two blocks of 16: the second request finds them in the cache
    return [Job(id=f"j{i}", model="tiny", prompt_ids=prefix + [50 + i],
                params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                timeout_s=60, enqueued_at=time.time() - 0.5) for i in range(count)]


def test_the_continuous_engines_numbers_reach_the_workers_metrics(tiny_llama):
    settings = Settings(block_size=16, kv_blocks=32, max_batch_tokens=64)
    engine = make_engine(tiny_llama, settings)
    observed = WorkerMetrics("tiny-continuous")
    first, second = _shared_prefix_jobs(2)
    seqs = [engine.add(first)]
    batches = []
    while engine.busy:
        if len(seqs) == 1 and seqs[0].output_ids:  # the first one's prompt is in the cache now
            seqs.append(engine.add(second))
        engine.step()
        batches.append(engine.last_batch)
        observed.stepped(engine.last_batch)
    observed.finished(seqs)
    stats = engine.stats()
    assert stats["generated"] == 10 == sum(len(s.output_ids) for s in seqs)
    assert stats["prefix_hit_blocks"] == 2
    assert max(batches) == 2

    samples = _exposition(EngineCollector("tiny-continuous", engine, requeued=Counter(other=3),
                                          crashed=Counter()))
    assert value(samples, names.GENERATED_TOKENS, model="tiny-continuous") == 10
    assert value(samples, names.PREFIX_CACHE_HITS, model="tiny-continuous") == 2
    assert value(samples, names.PREEMPTIONS, model="tiny-continuous") == 0
    assert value(samples, names.RUNNING, model="tiny-continuous") == 0
    assert value(samples, names.KV_CACHE_USAGE, model="tiny-continuous") == 0  # all given back
    # Requeued jobs carry their own model; the worker's own model is there at 0.
    assert value(samples, names.REQUEUED_JOBS, model="other") == 3
    assert has(samples, names.REQUEUED_JOBS, model="tiny-continuous")
    assert has(samples, names.CRASHED_JOBS, model="tiny-continuous")
    assert has(samples, names.LEFT_FOR_SAME_NUMERICS, model="tiny-continuous")


def test_the_static_engine_reports_what_it_has(tiny_llama):
    engine = StaticEngine(tiny_llama, capacity=4)
    for job in _shared_prefix_jobs(3):
        engine.add(job)
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        assert engine.last_batch in (0, 3)
    samples = _exposition(EngineCollector("tiny-static", engine, Counter(), Counter()))
    assert value(samples, names.GENERATED_TOKENS, model="tiny-static") == 15
    assert has(samples, names.RUNNING, model="tiny-static")
    assert not has(samples, names.KV_CACHE_USAGE)  # no paged cache, no usage: left out, not a 0


def test_worker_histograms_observe_queue_wait_per_token_time_and_batches():
    observed = WorkerMetrics("histograms")
    job = _shared_prefix_jobs(1)[0]
    observed.taken(job, redis_now=time.time())  # the test's Redis would be on this host
    observed.taken(Job(id="unstamped", model="m", prompt_ids=[1], params=SamplingParams(), timeout_s=60),
                   redis_now=time.time())
    samples = parse(generate_latest().decode())
    assert value(samples, names.QUEUE_WAIT + "_count", model="histograms") == 1  # unstamped: not observed
    assert 0.5 <= value(samples, names.QUEUE_WAIT + "_sum", model="histograms") < 5


def test_the_offer_wait_counts_offered_jobs_by_who_took_them():
    observed, queue = WorkerMetrics("offers"), JobQueue(fakeredis.FakeRedis(), "w1", "offers")
    own, other, shared, put_back = (replace(job, offer=offer) for job, offer
                                    in zip(_shared_prefix_jobs(4), ("w1", "w2", "", "w2")))
    queue.retried.add(put_back.id)  # as the take names a job a dead worker held
    for job in (own, other, shared, put_back):
        observed.taken(job, redis_now=time.time(), offer=queue.offer_taken_by(job))
    samples = parse(generate_latest().decode())
    assert value(samples, names.QUEUE_WAIT + "_count", model="offers") == 4
    # its own offer and w2's, apart; the job offered to no one, and the one w2 died holding, in neither
    assert value(samples, names.OFFER_WAIT + "_count", model="offers", taken_by="own") == 1
    assert value(samples, names.OFFER_WAIT + "_count", model="offers", taken_by="other") == 1
    assert 0.5 <= value(samples, names.OFFER_WAIT + "_sum", model="offers", taken_by="own") < 5
