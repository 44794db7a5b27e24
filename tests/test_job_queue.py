"""The worker's Redis side: the batching rule, reliable pops, results, dead workers.

Each test runs on fakeredis and on a real redis-server, except where fakeredis falls short.
"""
from __future__ import annotations

import threading
import time

import pytest

from shared import keys
from shared.protocol import Failure, Final, Job, SamplingParams, WorkerInfo, decode_result
from tests.tiny_models import tiny_tokenizer
from worker.job_queue import JobQueue
from worker.sequence import Sequence

MODEL = "m"


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request):
    return request.getfixturevalue("fake_redis" if request.param == "fakeredis" else "real_redis")


def _job(i: int, stream: bool = False, priority: int = 0) -> Job:
    return Job(id=f"job-{i}", model=MODEL, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=2),
               timeout_s=60, stream=stream, priority=priority)


def _push(client, *ids: int, stream: bool = False, priority: int = 0) -> None:
    client.rpush(keys.queue(MODEL, priority), *[_job(i, stream, priority).to_json() for i in ids])


def _ids(jobs) -> list[str]:
    return [j.id for j in jobs]


def test_a_batch_takes_at_most_its_size_in_queue_order(client):
    queue = JobQueue(client, "w1", MODEL)
    _push(client, *range(20))
    taken = queue.take(limit=16, wait_s=0.005, block_s=1)
    assert [j.id for j in taken] == [f"job-{i}" for i in range(16)]
    assert client.llen(keys.queue(MODEL)) == 4
    # Reliable pop: what was taken sits in this worker's processing list until it is answered.
    assert client.llen(keys.processing(MODEL, "w1")) == 16


def test_a_batch_waits_for_late_arrivals_only_until_the_deadline(client):
    queue = JobQueue(client, "w1", MODEL)
    _push(client, 0)
    # One arrives 20 ms after the first (inside a 150 ms wait), another after 400 ms (outside it).
    threading.Timer(0.02, _push, (client, 1)).start()
    threading.Timer(0.4, _push, (client, 2)).start()
    started = time.monotonic()
    taken = queue.take(limit=16, wait_s=0.15, block_s=1)
    waited = time.monotonic() - started
    assert [j.id for j in taken] == ["job-0", "job-1"]
    assert 0.1 <= waited < 0.4
    time.sleep(0.45)
    assert [j.id for j in queue.take(limit=16, wait_s=0, block_s=1)] == ["job-2"]


def test_a_full_batch_does_not_wait(client):
    queue = JobQueue(client, "w1", MODEL)
    _push(client, *range(4))
    started = time.monotonic()
    assert len(queue.take(limit=4, wait_s=5.0, block_s=1)) == 4
    assert time.monotonic() - started < 1.0


# Real Redis only: fakeredis 2.40's BLMOVE does not block for a fractional timeout, and never
# wakes up for a push made while it waits (it retries the empty list it saw first).
def test_an_empty_queue_gives_nothing_after_blocking(real_redis):
    client = real_redis
    queue = JobQueue(client, "w1", MODEL)
    assert queue.take(limit=4, wait_s=0.005, block_s=0) == []
    started = time.monotonic()
    assert queue.take(limit=4, wait_s=0.005, block_s=0.2) == []
    assert time.monotonic() - started >= 0.15


def test_a_malformed_job_is_dropped_not_retried_forever(client):
    queue = JobQueue(client, "w1", MODEL)
    client.rpush(keys.queue(MODEL), b"{not json")
    _push(client, 1)
    assert [j.id for j in queue.take(limit=4, wait_s=0, block_s=1)] == ["job-1"]
    assert [Job.from_json(r).id for r in client.lrange(keys.processing(MODEL, "w1"), 0, -1)] == ["job-1"]


@pytest.mark.parametrize("stream, published", [(True, ["text", "final"]), (False, ["final"])])
def test_a_finished_sequence_is_published_stored_and_removed(client, stream, published):
    tokenizer = tiny_tokenizer()
    queue = JobQueue(client, "w1", MODEL, answer_ttl_s=30)
    _push(client, 0, stream=stream)
    [job] = queue.take(limit=1, wait_s=0, block_s=1)
    pubsub = client.pubsub()
    pubsub.subscribe(keys.channel(MODEL, job.id))
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    seq = Sequence(job, tokenizer, frozenset({tokenizer.eos_token_id}))
    for token in tokenizer(" brave knight").input_ids[:2]:
        seq.append(token)
    queue.publish([seq])

    # Text as it comes only for a streaming request: nobody else listens to the pieces.
    messages = [decode_result(m["data"]) for m in iter(lambda: pubsub.get_message(timeout=0.5), None)]
    assert [m.type for m in messages] == published
    final = messages[-1]
    assert isinstance(final, Final) and final.finish_reason == "length" and final.completion_tokens == 2
    assert final.text == tokenizer.decode(tokenizer(" brave knight").input_ids[:2])
    assert decode_result(client.get(keys.answer(MODEL, job.id))) == final
    assert 0 < client.ttl(keys.answer(MODEL, job.id)) <= 30
    assert client.llen(keys.processing(MODEL, "w1")) == 0


def test_jobs_of_a_dead_worker_go_back_to_the_front_of_the_queue(client):
    dead = JobQueue(client, "dead", MODEL)
    info = WorkerInfo(id="dead", model=MODEL, context_window=128, engine="static", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    dead.heartbeat(info, ttl_s=0.05)
    _push(client, 0, 1)
    dead.take(limit=2, wait_s=0, block_s=1)
    _push(client, 2)
    alive = JobQueue(client, "alive", MODEL)
    assert alive.requeue_dead_workers() == 0  # its heartbeat is still fresh
    time.sleep(0.1)
    assert alive.requeue_dead_workers() == 2
    assert [Job.from_json(r).id for r in client.lrange(keys.queue(MODEL), 0, -1)] == ["job-0", "job-1", "job-2"]
    assert not client.hexists(keys.WORKERS, "dead")


def _announce(queue: JobQueue, ttl_s: float, draining: bool = False) -> None:
    """A heartbeat from the worker behind `queue`, for `ttl_s`."""
    info = WorkerInfo(id=queue.worker_id, model=MODEL, context_window=128, engine="continuous", batch=4,
                      device="cpu", dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0,
                      draining=draining)
    queue.heartbeat(info, ttl_s=ttl_s)


def _die(queue: JobQueue, client) -> None:
    """The worker behind `queue` dies holding its jobs: its heartbeat expires."""
    _announce(queue, ttl_s=0.05)
    time.sleep(0.1)


def test_the_most_urgent_queue_is_taken_first_fifo_within_a_class(client):
    queue = JobQueue(client, "w1", MODEL)
    _push(client, 0, 1, priority=5)    # background lore
    _push(client, 2, 3, priority=-3)   # a boss fight
    _push(client, 4, priority=0)
    assert _ids(queue.take(limit=3, wait_s=0, block_s=1)) == ["job-2", "job-3", "job-4"]
    _push(client, 5, priority=-3)      # arrives later, still goes first
    assert _ids(queue.take(limit=8, wait_s=0, block_s=1)) == ["job-5", "job-0", "job-1"]


def test_a_flood_of_low_priority_work_does_not_starve_high_priority(client):
    queue = JobQueue(client, "w1", MODEL)
    _push(client, *range(100), priority=10)
    order = []
    for step in range(20):
        if step % 4 == 0:
            _push(client, 1000 + step, priority=-10)
        order += _ids(queue.take(limit=2, wait_s=0, block_s=0))
    # Each urgent job is taken at the first take after it arrives; the flood still moves between.
    for step in range(0, 20, 4):
        assert order.index(f"job-{1000 + step}") == 2 * step
    # ...and the flood moves too, in its own order, whenever nothing urgent waits.
    assert [o for o in order if int(o[4:]) < 100] == [f"job-{i}" for i in range(35)]


def test_an_idle_worker_wakes_when_the_api_pushes(real_redis):
    from api.admission import Admission
    queue = JobQueue(real_redis, "w1", MODEL)
    threading.Timer(0.1, lambda: Admission(real_redis, 0).push([_job(0)], cap=0)).start()
    started = time.monotonic()
    assert _ids(queue.take(limit=1, wait_s=0, block_s=5)) == ["job-0"]
    assert time.monotonic() - started < 1


def test_a_job_that_kills_its_workers_fails_after_its_retries_and_the_others_go_on(client):
    pubsub = client.pubsub()
    pubsub.subscribe(keys.channel(MODEL, "job-0"))
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    _push(client, 0, 1, 2)
    first = JobQueue(client, "first", MODEL, max_attempts=2)
    assert len(first.take(limit=8, wait_s=0, block_s=1)) == 3
    _die(first, client)
    # First retry: batched as usual (a worker killed from outside must not slow the crowd down).
    second = JobQueue(client, "second", MODEL, max_attempts=2)
    assert second.requeue_dead_workers() == 3
    assert _ids(second.take(limit=8, wait_s=0, block_s=0)) == ["job-0", "job-1", "job-2"]
    assert not second.isolated
    _die(second, client)

    # The last retry: each job runs alone, never beside another, never in a busy worker.
    third = JobQueue(client, "third", MODEL, max_attempts=2)
    assert third.requeue_dead_workers() == 3
    assert third.take(limit=8, wait_s=0, block_s=0, alone_ok=False) == []
    assert _ids(third.take(limit=8, wait_s=0, block_s=0)) == ["job-0"]
    assert third.isolated == {"job-0"}
    _die(third, client)  # job-0 kills this worker too, alone: it is the culprit
    fourth = JobQueue(client, "fourth", MODEL, max_attempts=2)
    assert fourth.requeue_dead_workers() == 0
    failure = decode_result(client.get(keys.answer(MODEL, "job-0")))
    assert isinstance(failure, Failure) and failure.code == "worker_crashed"
    assert "3 time(s)" in failure.message
    assert decode_result(pubsub.get_message(timeout=1)["data"]) == failure
    # The innocent ones are still queued, in order, and are taken (alone) as usual.
    assert _ids(fourth.take(limit=8, wait_s=0, block_s=0)) == ["job-1"]


def test_a_requeued_job_keeps_its_priority(client):
    _push(client, 0, priority=7)
    first = JobQueue(client, "first", MODEL, max_attempts=3)
    first.take(limit=1, wait_s=0, block_s=1)
    _die(first, client)
    JobQueue(client, "survivor", MODEL).requeue_dead_workers()
    assert client.llen(keys.queue(MODEL, 7)) == 1 and client.llen(keys.queue(MODEL)) == 0
