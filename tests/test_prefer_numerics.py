"""A dead worker's job goes preferably to a worker of the same numerics fingerprint: a worker of
another passes it over for PREFER_SAME_NUMERICS_S after it was put back, and only while a worker
of that fingerprint is live and taking jobs; then anyone takes it. The job keeps its place, and the
priority and last-retry rules hold. On fakeredis and a real redis-server.
"""
from __future__ import annotations

import logging

import pytest

from shared import keys
from tests.queue_jobs import MODEL, announce_worker, die_holding, job_ids_of, lapse, push_jobs
from worker import job_queue
from worker.job_queue import JobQueue

# Long enough that no pause of a loaded machine between the requeue and the takes outlives it (a
# 0.5 s one could lapse mid-test); the tests that need it over run the stamps down by hand.
WINDOW_S = 30.0


@pytest.fixture(autouse=True)
def window(monkeypatch):
    monkeypatch.setattr(job_queue, "PREFER_SAME_NUMERICS_S", WINDOW_S)


def _live(any_redis, worker_id: str, numerics: str) -> JobQueue:
    queue = JobQueue(any_redis, worker_id, MODEL, numerics=numerics)
    announce_worker(queue, ttl_s=60)  # a heartbeat that outlives the test
    return queue


def _dead_holding(any_redis, numerics: str, count: int) -> None:
    """A worker of `numerics` took `count` jobs and died: they are back at the front of the queue."""
    dead = JobQueue(any_redis, "dead", MODEL, numerics=numerics)
    assert len(dead.take(limit=count, wait_s=0, block_s=1)) == count
    die_holding(dead, any_redis)
    assert JobQueue(any_redis, "finder", MODEL).requeue_dead_workers() == count


def _window_passes(any_redis) -> None:
    """PREFER_SAME_NUMERICS_S passes for every requeued job's stamp: each was set to live that long
    in Redis' clock (checked), and is run down to 1 ms rather than the test sleeping it out."""
    stamps = list(any_redis.scan_iter(match=keys.written_by(MODEL, "") + "*"))
    assert stamps
    for stamp in stamps:
        assert 0 < any_redis.pttl(stamp) <= WINDOW_S * 1000
    lapse(any_redis, *stamps)


def test_a_worker_of_another_numerics_passes_a_requeued_job_over_and_takes_what_is_behind_it(any_redis, caplog):
    push_jobs(any_redis, 0, 1, 2)
    _dead_holding(any_redis, "A", 1)
    same, other = _live(any_redis, "same", "A"), _live(any_redis, "other", "B")
    any_redis.delete(keys.wake(MODEL))  # the requeue's token
    with caplog.at_level(logging.INFO):
        assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0)) == ["job-1"]
        assert any_redis.llen(keys.wake(MODEL)) == 1  # for job-2, which it left
        assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0)) == ["job-2"]
        any_redis.delete(keys.wake(MODEL))
        assert other.take(limit=4, wait_s=0, block_s=0) == []
    # Counted and logged once, though each take passed it over; no wake-up for it: an idle worker of
    # another numerics would take its own token back at once, and spin.
    assert other.left_for_numerics[MODEL] == 1
    assert caplog.text.count(f"job job-0: left for up to {WINDOW_S:g} s to a live worker of numerics A") == 1
    assert any_redis.llen(keys.wake(MODEL)) == 0
    assert job_ids_of(same.take(limit=4, wait_s=0, block_s=0)) == ["job-0"]
    assert any_redis.llen(keys.queue(MODEL)) == 0


def test_after_its_time_any_worker_takes_it_first_in_line(any_redis):
    push_jobs(any_redis, 0, 1)
    _dead_holding(any_redis, "A", 1)
    _live(any_redis, "same", "A")
    other = _live(any_redis, "other", "B")
    assert other.take(limit=1, wait_s=0, block_s=0)[0].id == "job-1"
    _window_passes(any_redis)  # the stamp expires, in Redis' clock
    push_jobs(any_redis, 2)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-0", "job-2"]


def test_without_a_live_worker_of_its_numerics_that_takes_jobs_it_is_not_passed_over(any_redis):
    push_jobs(any_redis, 0)
    _dead_holding(any_redis, "A", 1)
    die_holding(JobQueue(any_redis, "stale", MODEL, numerics="A"), any_redis)  # registered, its heartbeat gone
    announce_worker(JobQueue(any_redis, "draining", MODEL, numerics="A"), ttl_s=60, draining=True)  # takes nothing
    other = _live(any_redis, "other", "B")
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-0"]
    assert other.left_for_numerics[MODEL] == 0


def test_a_job_that_was_never_requeued_or_whose_worker_had_no_numerics_is_taken_as_ever(any_redis):
    push_jobs(any_redis, 0, 1)
    _dead_holding(any_redis, "", 1)  # a worker that announced no fingerprint
    other = _live(any_redis, "other", "B")
    assert not any_redis.exists(keys.written_by(MODEL, "job-0"))
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-0", "job-1"]


def test_priority_and_the_last_retry_still_hold(any_redis):
    # A dead worker's urgent job waits for its numerics; the other worker goes on behind it in the
    # same queue, before any less urgent one.
    push_jobs(any_redis, 0, 1, priority=-3)
    push_jobs(any_redis, 2, priority=0)
    _dead_holding(any_redis, "A", 1)
    same, other = _live(any_redis, "same", "A"), _live(any_redis, "other", "B")
    assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0)) == ["job-1"]
    assert job_ids_of(same.take(limit=4, wait_s=0, block_s=0)) == ["job-0", "job-2"]
    # A last retry (its worker died once, max_attempts 1) passed over by a worker of another
    # numerics, and taken by one of its own only alone.
    for queue in (same, other):
        queue.max_attempts = 1
    push_jobs(any_redis, 3)
    _dead_holding(any_redis, "A", 1)
    announce_worker(same, ttl_s=60)  # its next heartbeat (the dead one's last had the fingerprint's expire sooner)
    push_jobs(any_redis, 4)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0, alone_ok=True)) == ["job-4"]
    assert same.take(limit=4, wait_s=0, block_s=0, alone_ok=False) == []
    assert job_ids_of(same.take(limit=4, wait_s=0, block_s=0, alone_ok=True)) == ["job-3"]
    assert same.isolated == {"job-3"}


def test_a_take_passes_over_a_bounded_number(any_redis, monkeypatch):
    monkeypatch.setattr(job_queue, "PASS_OVER_AT_MOST", 2)
    push_jobs(any_redis, 0, 1, 2, 3)
    _dead_holding(any_redis, "A", 3)
    _live(any_redis, "same", "A")
    other = _live(any_redis, "other", "B")
    assert other.take(limit=4, wait_s=0, block_s=0) == []  # stops after two passed over
    _window_passes(any_redis)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-0", "job-1", "job-2", "job-3"]
