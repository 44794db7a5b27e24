"""A take whose reply never reaches the worker (a socket timeout while Redis stalls, a link cut with
the take in flight, a take sent again after the worker gave up on the first) has still moved its
jobs into the worker's processing list, leased to it. The worker finds them there about once a
heartbeat and runs them, or puts them back in the queue, and each is answered once.

On fakeredis and a real redis-server; the stalled take itself on a private redis-server.
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis

from shared import keys
from shared.protocol import Final, Job, SamplingParams, WorkerInfo, decode_result
from shared.settings import Settings
from tests.engines import StandIn
from tests.processes import RedisServer
from tests.queue_jobs import MODEL, job_ids_of, push_jobs, subscribe_to
from tests.tiny_models import tiny_tokenizer
from worker import worker as worker_module
from worker.faults import Faults
from worker.job_queue import JobQueue
from worker.sequence import Sequence
from worker.worker import Worker


def _lost_take(any_redis, worker_id: str, limit: int, alone_ok: bool = True) -> None:
    """A take by `worker_id` that runs in Redis, whose reply the worker never sees."""
    JobQueue(any_redis, worker_id, MODEL).take(limit=limit, wait_s=0, block_s=0, alone_ok=alone_ok)


def _in_processing(any_redis, worker_id: str) -> list[str]:
    return [Job.from_json(r).id for r in any_redis.lrange(keys.processing(MODEL, worker_id), 0, -1)]


def _queued(any_redis, priority: int = 0) -> list[str]:
    return [Job.from_json(r).id for r in any_redis.lrange(keys.queue(MODEL, priority), 0, -1)]


# JobQueue.adopt_stranded


def test_jobs_a_lost_take_left_are_adopted_up_to_the_room_and_the_rest_go_back_in_order(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0, 1, 2)
    push_jobs(any_redis, 3, priority=-3)
    _lost_take(any_redis, "w1", 3)  # job-3 (more urgent), job-0, job-1: unknown to the worker
    assert job_ids_of(queue.take(limit=1, wait_s=0, block_s=0)) == ["job-2"]  # what it does know
    assert _in_processing(any_redis, "w1") == ["job-3", "job-0", "job-1", "job-2"]
    any_redis.delete(keys.wake(MODEL))

    adopted = queue.adopt_stranded({"job-2"}, room=1)
    assert job_ids_of(adopted) == ["job-3"]
    # No room for the others: back at the front of their queue, in their order, for any worker.
    push_jobs(any_redis, 4)
    assert _queued(any_redis) == ["job-0", "job-1", "job-4"]
    assert _in_processing(any_redis, "w1") == ["job-3", "job-2"]
    assert not any_redis.exists(keys.lease(MODEL, "job-0")) and not any_redis.exists(keys.lease(MODEL, "job-1"))
    assert any_redis.get(keys.lease(MODEL, "job-3")) == b"w1"
    assert any_redis.llen(keys.wake(MODEL)) == 1  # an idle worker wakes for them

    # Adopted, it is held: found again, it is neither adopted nor put back a second time.
    assert queue.adopt_stranded({"job-2", "job-3"}, room=4) == []
    assert _in_processing(any_redis, "w1") == ["job-3", "job-2"]
    other = JobQueue(any_redis, "w2", MODEL)
    assert job_ids_of(other.take(limit=2, wait_s=0, block_s=0)) == ["job-0", "job-1"]

    # The adopted job is answered as a taken one is: published, stored, removed, its lease ended.
    tokenizer = tiny_tokenizer()
    seq = Sequence(adopted[0], tokenizer, frozenset({tokenizer.eos_token_id}))
    for token in tokenizer(" brave knight").input_ids[:2]:
        seq.append(token)
    assert queue.publish([seq]).finished == [seq]
    assert isinstance(decode_result(any_redis.get(keys.answer(MODEL, "job-3"))), Final)
    assert _in_processing(any_redis, "w1") == ["job-2"]
    assert not any_redis.exists(keys.lease(MODEL, "job-3"))


def test_a_put_back_that_runs_twice_queues_each_job_once(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0)
    _lost_take(any_redis, "w1", 1)
    raw = any_redis.lindex(keys.processing(MODEL, "w1"), 0)
    assert queue.adopt_stranded(set(), room=0) == []
    # Its reply lost too, and sent again: the lease is gone, so the copy moves nothing.
    again = queue._put_back_script(keys=[keys.processing(MODEL, "w1"), keys.wake(MODEL)],
                                   args=["w1", keys.lease(MODEL, ""), keys.queue_prefix(MODEL), raw])
    assert again == 0
    assert _queued(any_redis) == ["job-0"] and _in_processing(any_redis, "w1") == []


def test_jobs_no_longer_leased_to_the_worker_are_left_alone(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0)
    _lost_take(any_redis, "w1", 1)
    any_redis.set(keys.lease(MODEL, "job-0"), "w2")  # whoever holds the lease answers the job, not w1
    assert queue.adopt_stranded(set(), room=4) == []
    assert queue.adopt_stranded(set(), room=0) == []
    assert _in_processing(any_redis, "w1") == ["job-0"] and _queued(any_redis) == []
    assert any_redis.get(keys.lease(MODEL, "job-0")) == b"w2"


def test_a_stranded_last_retry_runs_only_alone(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL, max_attempts=2)
    push_jobs(any_redis, 0)
    any_redis.set(keys.attempts(MODEL, "job-0"), 2)  # two workers died holding it: its last retry
    _lost_take(any_redis, "w1", 4)
    # The worker is busy: the job goes back, for a worker that holds nothing.
    assert queue.adopt_stranded({"job-9"}, room=4, alone_ok=False) == []
    assert _queued(any_redis) == ["job-0"] and not queue.isolated
    _lost_take(any_redis, "w1", 4)
    assert job_ids_of(queue.adopt_stranded(set(), room=4, alone_ok=True)) == ["job-0"]
    assert queue.isolated == {"job-0"}


def test_a_malformed_stranded_job_is_dropped(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    any_redis.rpush(keys.processing(MODEL, "w1"), b"{not json")
    assert queue.adopt_stranded(set(), room=4) == []
    assert any_redis.llen(keys.processing(MODEL, "w1")) == 0


# The worker's loop


def _worker(any_redis, engine: StandIn, heartbeat_s: float = 0.1, step_delay_s: float = 0.0) -> Worker:
    info = WorkerInfo(id="w1", model=MODEL, context_window=128, engine="stand-in", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    return Worker(JobQueue(any_redis, "w1", MODEL), engine, info, Settings(heartbeat_s=heartbeat_s, heartbeat_ttl_s=5.0),
                  faults=Faults(step_delay_s=step_delay_s))


def _push_long(any_redis, *ids: int, max_tokens: int = 8) -> None:
    any_redis.rpush(keys.queue(MODEL), *[Job(id=f"job-{i}", model=MODEL, prompt_ids=[5, 6, 7],
                                             params=SamplingParams(max_tokens=max_tokens), timeout_s=60).to_json()
                                         for i in ids])


def _running(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def _wait_for_answers(any_redis, *job_ids: str, timeout: float = 8) -> None:
    give_up = time.monotonic() + timeout
    while missing := [j for j in job_ids if not any_redis.exists(keys.answer(MODEL, j))]:
        assert time.monotonic() < give_up, f"unanswered: {missing}"
        time.sleep(0.02)


def _finals(pubsub) -> Counter:
    heard = Counter()
    for message in iter(lambda: pubsub.get_message(timeout=0.3), None):
        if message["type"] == "message" and isinstance(decode_result(message["data"]), Final):
            heard[message["channel"].decode().rsplit(":", 1)[1]] += 1
    return heard


def test_a_working_worker_answers_the_jobs_a_lost_take_left_once_each(fake_redis):
    client = fake_redis
    engine = StandIn()
    # Jobs of 8 steps of 50 ms: the worker looks at its processing list a few times while it
    # writes them, and must not take them for stranded.
    worker = _worker(client, engine, step_delay_s=0.05)
    pubsub = subscribe_to(client, "job-0", "job-1", "job-2", "job-3")
    _push_long(client, 0, 1)
    _lost_take(client, "w1", 2)  # as if the worker's own take had lost its reply
    thread = _running(worker)
    try:
        _push_long(client, 2, 3)
        client.lpush(keys.wake(MODEL), "1")
        _wait_for_answers(client, "job-0", "job-1", "job-2", "job-3")
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert engine.added == {"job-0": 1, "job-1": 1, "job-2": 1, "job-3": 1}
    assert _finals(pubsub) == {"job-0": 1, "job-1": 1, "job-2": 1, "job-3": 1}
    assert _in_processing(client, "w1") == []


def test_a_stopping_worker_puts_stranded_jobs_back(fake_redis):
    client = fake_redis
    engine = StandIn()
    worker = _worker(client, engine)
    push_jobs(client, 0)
    _lost_take(client, "w1", 1)
    worker.stop()  # it takes nothing more: the job goes back now, not after its heartbeat runs out
    worker.run()
    assert engine.added == {}
    assert _queued(client) == ["job-0"] and _in_processing(client, "w1") == []
    assert not client.exists(keys.lease(MODEL, "job-0")) and not client.exists(keys.attempts(MODEL, "job-0"))
    assert not client.hexists(keys.WORKERS, "w1")


@pytest.fixture(scope="module")
def debug_redis(tmp_path_factory):
    """A private redis-server that allows DEBUG (Redis 7 refuses it by default)."""
    server = RedisServer(str(tmp_path_factory.mktemp("redis-debug")),
                         extra_args=["--enable-debug-command", "yes"])
    server.start()
    yield server
    server.stop()


def _stall(server: RedisServer, seconds: float) -> None:
    """Make Redis stall for `seconds` (DEBUG SLEEP), and return once it does: a probe times out."""
    threading.Thread(target=server.client().execute_command, args=("DEBUG", "SLEEP", seconds)).start()
    # 0.3 s: a ping on a loaded 2-core machine can take longer than 50 ms without any stall, and
    # a probe that timed out early would return before the stall began.
    probe = redis.Redis.from_url(server.url, socket_timeout=0.3)
    while True:
        try:
            probe.ping()
        except redis.TimeoutError:
            return
        time.sleep(0.01)


def test_a_take_that_times_out_while_redis_stalls_is_answered(debug_redis, monkeypatch):
    """The bug as found: Redis runs the take after the worker's 1 s socket timeout gave up on it."""
    # The worker tries again only after the stall: a take of its own sent meanwhile could run first
    # once Redis wakes (which waiting client Redis serves first is not ordered), and find the job.
    monkeypatch.setattr(worker_module, "REDIS_RETRY_S", 1.5)
    client = debug_redis.client()
    client.flushdb()
    engine = StandIn()
    worker = _worker(redis.Redis.from_url(debug_redis.url, socket_timeout=1), engine, heartbeat_s=0.2)
    # The take script loaded first: an EVALSHA of an unknown script would run late as a NOSCRIPT
    # error, and take nothing.
    assert worker.queue.take(limit=1, wait_s=0, block_s=0) == []
    take_now, failures, stall = worker.queue._take_now, [], threading.Event()

    def stalled_take(*args, **kwargs):
        # Once, with the job queued: Redis stalls for 2.5 s, and this take waits behind the stall
        # (sent some 0.3 s in, its 1 s socket timeout comes more than a second before the stall ends).
        if stall.is_set() and client.llen(keys.queue(MODEL)):
            stall.clear()
            _stall(debug_redis, 2.5)
            try:
                return take_now(*args, **kwargs)
            except redis.RedisError as exc:
                failures.append(exc)
                raise
        return take_now(*args, **kwargs)

    worker.queue._take_now = stalled_take
    pubsub = subscribe_to(client, "job-0")
    thread = _running(worker)
    try:
        stall.set()
        push_jobs(client, 0)
        client.lpush(keys.wake(MODEL), "1")
        _wait_for_answers(client, "job-0")
    finally:
        worker.stop()
        thread.join(10)
    assert [type(e) for e in failures] == [redis.TimeoutError]  # the take's reply never came
    assert engine.added == {"job-0": 1}
    assert _finals(pubsub) == {"job-0": 1}
    assert _in_processing(client, "w1") == [] and not client.exists(keys.lease(MODEL, "job-0"))
