"""The worker's Redis side: the batching rule, reliable pops, results, dead workers.

Each test runs on fakeredis and on a real redis-server, except where fakeredis falls short.
"""
from __future__ import annotations

import threading
import time

import pytest

from shared import keys
from shared.protocol import Failure, Final, Job, WorkerInfo, decode_result
from tests.queue_jobs import MODEL, FakeTime, die_holding, job_ids_of, lapse, numbered_job, push_jobs
from tests.tiny_models import tiny_tokenizer
from worker.job_queue import FILL_POLL_S, JobQueue
from worker.sequence import Sequence


def test_a_batch_takes_at_most_its_size_in_queue_order(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, *range(20))
    taken = queue.take(limit=16, wait_s=0.005, block_s=1)
    assert [j.id for j in taken] == [f"job-{i}" for i in range(16)]
    assert any_redis.llen(keys.queue(MODEL)) == 4
    # Reliable pop: what was taken sits in this worker's processing list until it is answered.
    assert any_redis.llen(keys.processing(MODEL, "w1")) == 16


def test_a_batch_waits_for_late_arrivals_only_until_the_deadline(any_redis, monkeypatch):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0)
    # One arrives 20 ms after the first (inside a 150 ms wait), another after 400 ms (outside it).
    fake = FakeTime([(0.02, lambda: push_jobs(any_redis, 1)), (0.4, lambda: push_jobs(any_redis, 2))])
    monkeypatch.setattr("worker.job_queue.time", fake)
    taken = queue.take(limit=16, wait_s=0.15, block_s=1)
    assert [j.id for j in taken] == ["job-0", "job-1"]
    # It waited out the whole 150 ms for more (not returning with the first job, nor at the second),
    # and not one poll past it.
    assert 0.15 <= fake.now <= 0.15 + 2 * FILL_POLL_S
    assert any_redis.llen(keys.queue(MODEL)) == 0  # the 400 ms arrival has not come yet
    fake.advance(0.45 - fake.now)
    assert [j.id for j in queue.take(limit=16, wait_s=0, block_s=1)] == ["job-2"]


def test_a_full_batch_does_not_wait(any_redis, monkeypatch):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, *range(4))
    fake = FakeTime()
    monkeypatch.setattr("worker.job_queue.time", fake)
    assert len(queue.take(limit=4, wait_s=5.0, block_s=1)) == 4
    assert fake.sleeps == 0 and fake.now == 0.0  # not one poll of the 5 s fill wait


# Real Redis only: fakeredis 2.40's BLMOVE does not block for a fractional timeout, and never
# wakes up for a push made while it waits (it retries the empty list it saw first).
def test_an_empty_queue_gives_nothing_after_blocking(real_redis):
    client = real_redis
    queue = JobQueue(client, "w1", MODEL)
    assert queue.take(limit=4, wait_s=0.005, block_s=0) == []
    started = time.monotonic()
    assert queue.take(limit=4, wait_s=0.005, block_s=0.2) == []
    assert time.monotonic() - started >= 0.15


def test_a_malformed_job_is_dropped_not_retried_forever(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    any_redis.rpush(keys.queue(MODEL), b"{not json")
    push_jobs(any_redis, 1)
    assert [j.id for j in queue.take(limit=4, wait_s=0, block_s=1)] == ["job-1"]
    assert [Job.from_json(r).id for r in any_redis.lrange(keys.processing(MODEL, "w1"), 0, -1)] == ["job-1"]


@pytest.mark.parametrize("stream, published", [(True, ["text", "final"]), (False, ["final"])])
def test_a_finished_sequence_is_published_stored_and_removed(any_redis, stream, published):
    tokenizer = tiny_tokenizer()
    queue = JobQueue(any_redis, "w1", MODEL, answer_ttl_s=30)
    push_jobs(any_redis, 0, stream=stream)
    [job] = queue.take(limit=1, wait_s=0, block_s=1)
    pubsub = any_redis.pubsub()
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
    assert decode_result(any_redis.get(keys.answer(MODEL, job.id))) == final
    assert 0 < any_redis.ttl(keys.answer(MODEL, job.id)) <= 30
    assert any_redis.llen(keys.processing(MODEL, "w1")) == 0


def test_jobs_of_a_dead_worker_go_back_to_the_front_of_the_queue(any_redis):
    dead = JobQueue(any_redis, "dead", MODEL)
    info = WorkerInfo(id="dead", model=MODEL, context_window=128, engine="static", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    # A heartbeat of 30 s: no round trip on a loaded machine outlives it before the first look
    # (a 50 ms one could lapse during the three round trips below).
    dead.heartbeat(info, ttl_s=30)
    push_jobs(any_redis, 0, 1)
    dead.take(limit=2, wait_s=0, block_s=1)
    push_jobs(any_redis, 2)
    alive = JobQueue(any_redis, "alive", MODEL)
    assert alive.requeue_dead_workers() == 0  # its heartbeat is still fresh
    beat = keys.heartbeat(MODEL, "dead")
    assert 0 < any_redis.pttl(beat) <= 30_000  # the heartbeat lives only its TTL, then...
    # ...it lapses (its TTL run down to 1 ms, rather than the test sleeping out 30 s).
    lapse(any_redis, beat)
    assert alive.requeue_dead_workers() == 2
    assert [Job.from_json(r).id for r in any_redis.lrange(keys.queue(MODEL), 0, -1)] == ["job-0", "job-1", "job-2"]
    assert not any_redis.hexists(keys.WORKERS, "dead")


def test_the_most_urgent_queue_is_taken_first_fifo_within_a_class(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0, 1, priority=5)    # background lore
    push_jobs(any_redis, 2, 3, priority=-3)   # a boss fight
    push_jobs(any_redis, 4, priority=0)
    assert job_ids_of(queue.take(limit=3, wait_s=0, block_s=1)) == ["job-2", "job-3", "job-4"]
    push_jobs(any_redis, 5, priority=-3)      # arrives later, still goes first
    assert job_ids_of(queue.take(limit=8, wait_s=0, block_s=1)) == ["job-5", "job-0", "job-1"]


def test_a_flood_of_low_priority_work_does_not_starve_high_priority(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, *range(100), priority=10)
    order = []
    for step in range(20):
        if step % 4 == 0:
            push_jobs(any_redis, 1000 + step, priority=-10)
        order += job_ids_of(queue.take(limit=2, wait_s=0, block_s=0))
    # Each urgent job is taken at the first take after it arrives; the flood still moves between.
    for step in range(0, 20, 4):
        assert order.index(f"job-{1000 + step}") == 2 * step
    # ...and the flood moves too, in its own order, whenever nothing urgent waits.
    assert [o for o in order if int(o[4:]) < 100] == [f"job-{i}" for i in range(35)]


def test_an_idle_worker_wakes_when_the_api_pushes(real_redis):
    from api.admission import Admission
    queue = JobQueue(real_redis, "w1", MODEL)
    threading.Timer(0.1, lambda: Admission(real_redis, 0).push([numbered_job(0)], cap=0)).start()
    started = time.monotonic()
    assert job_ids_of(queue.take(limit=1, wait_s=0, block_s=30)) == ["job-0"]
    # A worker the push did not wake would sleep out its whole 30 s block; woken, it takes the job
    # a round trip after the push, well under 15 s even on a loaded 2-core machine.
    assert time.monotonic() - started < 15


def test_a_job_that_kills_its_workers_fails_after_its_retries_and_the_others_go_on(any_redis):
    pubsub = any_redis.pubsub()
    pubsub.subscribe(keys.channel(MODEL, "job-0"))
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    push_jobs(any_redis, 0, 1, 2)
    first = JobQueue(any_redis, "first", MODEL, max_attempts=2)
    assert len(first.take(limit=8, wait_s=0, block_s=1)) == 3
    die_holding(first, any_redis)
    # First retry: batched as usual (a worker killed from outside must not slow the crowd down).
    second = JobQueue(any_redis, "second", MODEL, max_attempts=2)
    assert second.requeue_dead_workers() == 3
    assert job_ids_of(second.take(limit=8, wait_s=0, block_s=0)) == ["job-0", "job-1", "job-2"]
    assert not second.isolated
    die_holding(second, any_redis)

    # The last retry: each job runs alone, never beside another, never in a busy worker.
    third = JobQueue(any_redis, "third", MODEL, max_attempts=2)
    assert third.requeue_dead_workers() == 3
    assert third.take(limit=8, wait_s=0, block_s=0, alone_ok=False) == []
    assert job_ids_of(third.take(limit=8, wait_s=0, block_s=0)) == ["job-0"]
    assert third.isolated == {"job-0"}
    die_holding(third, any_redis)  # job-0 kills this worker too, alone: it is the culprit
    fourth = JobQueue(any_redis, "fourth", MODEL, max_attempts=2)
    assert fourth.requeue_dead_workers() == 0
    failure = decode_result(any_redis.get(keys.answer(MODEL, "job-0")))
    assert isinstance(failure, Failure) and failure.code == "worker_crashed"
    assert "3 time(s)" in failure.message
    assert decode_result(pubsub.get_message(timeout=1)["data"]) == failure
    # The innocent ones are still queued, in order, and are taken (alone) as usual.
    assert job_ids_of(fourth.take(limit=8, wait_s=0, block_s=0)) == ["job-1"]


def test_a_requeued_job_keeps_its_priority(any_redis):
    push_jobs(any_redis, 0, priority=7)
    first = JobQueue(any_redis, "first", MODEL, max_attempts=3)
    first.take(limit=1, wait_s=0, block_s=1)
    die_holding(first, any_redis)
    JobQueue(any_redis, "survivor", MODEL).requeue_dead_workers()
    assert any_redis.llen(keys.queue(MODEL, 7)) == 1 and any_redis.llen(keys.queue(MODEL)) == 0
