"""The worker's loop on its own, with stand-ins for Redis or the engine: how it stops."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import redis

from shared import keys
from shared.protocol import Job, SamplingParams, WorkerInfo
from shared.settings import Settings
from tests.engines import StandIn
from worker import worker as worker_module
from worker.job_queue import JobQueue
from worker.worker import Worker


class RedisGone:
    """A JobQueue whose Redis went away after the worker announced itself."""
    isolated: set = set()

    def count_start(self) -> None:
        pass

    def heartbeat(self, info, ttl_s) -> None:
        pass

    def __getattr__(self, name):
        def unreachable(*args, **kwargs):
            raise redis.ConnectionError("Connection refused")
        return unreachable


class IdleEngine:
    busy = False

    def free_slots(self) -> int:
        return 4

    def held_slots(self) -> int:
        return 0

    def sequences(self) -> list:
        return []

    def stats(self) -> dict:
        return {}


def test_a_stopping_worker_whose_redis_is_gone_leaves_after_a_while(monkeypatch):
    monkeypatch.setattr(worker_module, "STOPPING_REDIS_WAIT_S", 0.5)
    monkeypatch.setattr(worker_module, "REDIS_RETRY_S", 0.05)
    info = WorkerInfo(id="w", model="m", context_window=8, engine="test", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    queue = RedisGone()
    worker = Worker(queue, IdleEngine(), info, Settings(heartbeat_s=0.05))
    # An answer it could not send before Redis went.
    worker._unpublished = [SimpleNamespace(id="job-0", finished=True, finish_reason="length")]
    worker.stop()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.run(), done.set()), daemon=True).start()
    started = time.monotonic()
    assert done.wait(20), "the worker never left"
    # Not before its 0.5 s wait (load only lengthens it); the upper bound tells its setting from the
    # 30 s default, with room for a loaded 2-core machine.
    assert 0.5 <= time.monotonic() - started < 20


# Queued jobs when workers stop: the last ones take them (worker.Worker._admit).

MODEL = "m"


def one_at_a_time() -> StandIn:
    """An engine that holds one job at a time and writes a token a step."""
    return StandIn(capacity=1, word=" knight")


def _info(worker_id: str, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(id=worker_id, model=MODEL, context_window=128, engine="test", batch=1, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0, draining=draining)


def _queue_jobs(any_redis, count: int) -> list[str]:
    jobs = [Job(id=f"job-{i}", model=MODEL, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=3),
                timeout_s=60) for i in range(count)]
    any_redis.rpush(keys.queue(MODEL), *[j.to_json() for j in jobs])
    return [j.id for j in jobs]


def _stopped_worker(any_redis, worker_id: str) -> Worker:
    worker = Worker(JobQueue(any_redis, worker_id, MODEL), one_at_a_time(), _info(worker_id),
                    Settings(heartbeat_s=0.05, wait_ms=0))
    worker.stop()  # as SIGTERM does, before it looked at the queue
    return worker


def _run_all(workers: list[Worker]) -> None:
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive(), "a stopping worker never left"


def _answered(any_redis, ids: list[str]) -> list[str]:
    return [i for i in ids if any_redis.exists(keys.answer(MODEL, i))]


@pytest.mark.parametrize("peer", ["none", "draining", "dead"])
def test_the_last_worker_to_stop_answers_the_queue_deeper_than_its_batch(any_redis, peer):
    """No other worker takes jobs (none, one draining too, one whose heartbeat expired): the
    stopping worker, with room for one job at a time, answers all three queued before it leaves."""
    if peer != "none":
        JobQueue(any_redis, "peer", MODEL).heartbeat(_info("peer", draining=peer == "draining"),
                                                     ttl_s=30 if peer == "draining" else 0.01)
        time.sleep(0.05)
    ids = _queue_jobs(any_redis, 3)
    _run_all([_stopped_worker(any_redis, "w")])
    assert _answered(any_redis, ids) == ids
    assert any_redis.llen(keys.queue(MODEL)) == 0
    assert any_redis.llen(keys.processing(MODEL, "w")) == 0


def test_a_stopping_worker_leaves_the_queue_to_a_live_one(any_redis):
    """A rolling restart: another worker of the model takes jobs, so the stopping one takes none."""
    JobQueue(any_redis, "peer", MODEL).heartbeat(_info("peer"), ttl_s=30)
    ids = _queue_jobs(any_redis, 3)
    started = time.monotonic()
    _run_all([_stopped_worker(any_redis, "w")])
    # It leaves in its first round, milliseconds in process (one that waited for the queue to empty
    # would never leave: the peer here takes nothing, and _run_all's join says so). 10 s: room for
    # any load on 2 cores.
    assert time.monotonic() - started < 10
    assert _answered(any_redis, ids) == []
    assert any_redis.llen(keys.queue(MODEL)) == 3
    assert JobQueue(any_redis, "peer", MODEL).others_taking() is False  # "w" left: nobody but the peer


def test_workers_stopping_together_leave_no_job_unanswered(any_redis):
    """Every worker stopped at once, each seeing the others taking jobs when it was told: the one
    that looks last sees the others draining, so the queue is emptied all the same."""
    ids = _queue_jobs(any_redis, 6)
    workers = [Worker(JobQueue(any_redis, f"w{i}", MODEL), one_at_a_time(), _info(f"w{i}"),
                      Settings(heartbeat_s=0.05, wait_ms=0)) for i in range(3)]
    for worker in workers:  # each announced, taking jobs
        worker.queue.heartbeat(worker.info, ttl_s=30)
    assert workers[0].queue.others_taking()
    for worker in workers:
        worker.stop()
    _run_all(workers)
    assert _answered(any_redis, ids) == ids
    assert any_redis.llen(keys.queue(MODEL)) == 0
