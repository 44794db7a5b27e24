"""Backpressure: the cap on waiting jobs holds under a concurrent burst, and a full queue is told
when to come back. On fakeredis and on a real redis-server; the whole stack is in
test_reliability.py."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from api.admission import RETRY_MAX_S, RETRY_STALLED_S, Admission, retry_after
from api.app import create_app
from api.errors import ApiError
from shared import keys
from shared.protocol import Job, SamplingParams, WorkerInfo
from shared.settings import Settings
from tests.fake_workers import MODEL, completion_body, openai_error, register_worker
from worker.job_queue import JobQueue


def _jobs(n: int, priority: int = 0, tag: str = "j") -> list[Job]:
    return [Job(id=f"{tag}-{i}", model=MODEL, prompt_ids=[5, 6], params=SamplingParams(),
                timeout_s=60, priority=priority) for i in range(n)]


def _waiting(any_redis) -> int:
    return sum(any_redis.llen(q) for q in keys.queues(MODEL))


def test_jobs_are_pushed_all_or_none_under_the_cap_across_priorities(any_redis):
    admission = Admission(any_redis, max_queue=5)
    admission.push(_jobs(3, priority=4, tag="a"), cap=5)
    admission.push(_jobs(2, priority=-2, tag="b"), cap=5)
    with pytest.raises(ApiError) as refused:
        admission.push(_jobs(1, tag="c"), cap=5)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert refused.value.retry_after == RETRY_STALLED_S  # nothing has been taken lately
    with pytest.raises(ApiError):
        admission.check(MODEL, 1, cap=5)
    assert _waiting(any_redis) == 5
    admission.push(_jobs(50, tag="d"), cap=0)  # 0: unbounded
    assert _waiting(any_redis) == 55


def test_a_burst_from_many_threads_gets_exactly_the_cap_through(real_redis):
    admission = Admission(real_redis, max_queue=20)

    def one(i: int) -> bool:
        try:
            admission.push(_jobs(1, tag=f"burst{i}"), cap=20)
            return True
        except ApiError:
            return False

    with ThreadPoolExecutor(64) as pool:
        accepted = list(pool.map(one, range(300)))
    assert sum(accepted) == 20 and _waiting(real_redis) == 20


def test_retry_after_follows_the_rate_workers_take_jobs(any_redis):
    admission = Admission(any_redis, max_queue=10)
    admission.push(_jobs(10), cap=10)
    # A worker takes 6 jobs (the take script counts them per second), 10 more arrive.
    JobQueue(any_redis, "w1", MODEL).take(limit=6, wait_s=0, block_s=0)
    admission.push(_jobs(6, tag="more"), cap=10)
    with pytest.raises(ApiError) as refused:
        admission.push(_jobs(4, tag="late"), cap=10)
    # 6 jobs in the last 30 s is 0.2 jobs/s; 4 too many -> 20 s.
    assert refused.value.retry_after == 20
    assert retry_after(1, 0.0) == RETRY_STALLED_S
    assert retry_after(10_000, 1.0) == RETRY_MAX_S
    assert retry_after(1, 100.0) == 1


def test_the_api_answers_429_in_openai_shape_before_tokenizing_or_queueing(fake_redis):
    register_worker(fake_redis)
    client = create_app(Settings(max_queue=2, request_timeout=5), client=fake_redis).test_client()
    fake_redis.rpush(keys.queue(MODEL), *[j.to_json() for j in _jobs(2)])
    response = client.post("/v1/completions", json=completion_body(n=1))
    openai_error(response, 429, code="queue_full")
    assert int(response.headers["Retry-After"]) >= 1
    assert response.get_json()["error"]["type"] == "rate_limit_error"
    assert _waiting(fake_redis) == 2


def test_the_default_cap_is_sized_from_the_live_workers(fake_redis):
    register_worker(fake_redis)  # batch 4
    admission = Admission(fake_redis, max_queue=-1)
    worker = fake_redis.get(keys.heartbeat(MODEL, "w1"))
    assert admission.cap([WorkerInfo.from_json(worker)]) == 16
    assert Admission(fake_redis, max_queue=7).cap([WorkerInfo.from_json(worker)]) == 7
