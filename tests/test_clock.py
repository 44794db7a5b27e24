"""No two hosts' clocks are compared: jobs are stamped in Redis' clock as they are queued and live
`timeout_s` from then, workers read Redis' clock through their monotonic one, the API's metrics
read Redis' time. Pure logic and fakeredis / redis-server here; real processes whose clocks are
ten minutes off in test_reliability.py."""
from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

from api.admission import Admission
from api.metrics import QueueCollector
from shared import keys, metrics as names
from shared.protocol import Job, SamplingParams
from worker import clock
from worker.clock import RedisClock
from worker.job_queue import JobQueue

MODEL = "clocked"


def _job(job_id: str = "j-0", stop: tuple[str, ...] = (), priority: int = 0, timeout_s: float = 60) -> Job:
    return Job(id=job_id, model=MODEL, prompt_ids=[5, 6], params=SamplingParams(stop=list(stop)),
               timeout_s=timeout_s, priority=priority)


def _redis_time(any_redis) -> float:
    seconds, microseconds = any_redis.time()
    return seconds + microseconds / 1e6


def test_a_job_is_alive_for_its_timeout_from_its_stamp_and_an_unstamped_one_by_redis_clock_never_expires():
    assert not clock.expired(enqueued_at=1000.0, timeout_s=5, now=1004.9)
    assert clock.expired(enqueued_at=1000.0, timeout_s=5, now=1005.1)
    assert not clock.expired(enqueued_at=0.0, timeout_s=5, now=10 ** 10)  # the API's cancel flag ends it


def test_queue_wait_is_measured_in_one_clock_and_never_below_zero():
    assert clock.queue_wait(1000.0, 1002.5) == 2.5
    assert clock.queue_wait(1000.0, 999.0) == 0.0  # Redis' clock stepped back between the readings
    assert clock.queue_wait(0.0, 1002.5) is None


def test_redis_clock_is_read_from_the_monotonic_clock_at_the_middle_of_the_round_trip(monkeypatch):
    redis_clock = RedisClock()
    assert not redis_clock.synced
    with pytest.raises(RuntimeError):
        redis_clock.now()
    redis_clock.sync(redis_time=5000.0, sent=100.0, received=100.2)  # Redis read its clock at ~100.1
    monkeypatch.setattr(time, "monotonic", lambda: 103.1)
    assert redis_clock.now() == pytest.approx(5003.0)


def test_a_worker_whose_wall_clock_is_off_still_reads_redis_clock(any_redis, monkeypatch):
    queue = JobQueue(any_redis, "w-clock", MODEL)
    any_redis.ping()  # connected: the sync's round trip, its error's bound, is Redis' answer alone
    # Bracketed by readings taken before and after, not compared with a window: on a loaded machine
    # any round trip may take long, but each reading still falls between its neighbours. SLACK: the
    # two clocks' rates over a second (NTP slews at most 0.05%), and TIME's microseconds.
    slack = 0.005
    before, sent = _redis_time(any_redis), time.monotonic()
    synced = queue.sync_clock()
    received, after = time.monotonic(), _redis_time(any_redis)
    half_trip = (received - sent) / 2  # the sync's error: Redis read its clock within its round trip
    assert before - half_trip - slack <= synced <= after + half_trip + slack
    earlier = time.time()
    skewed = clock.wall(-600.0)  # the clock_skew_s fault
    assert earlier - 600 <= skewed <= time.time() - 600
    time.sleep(0.2)
    before = _redis_time(any_redis)
    now = queue.clock.now()
    after = _redis_time(any_redis)
    assert before - half_trip - slack <= now <= after + half_trip + slack


def test_the_admission_script_stamps_each_job_with_redis_time_and_keeps_id_first_and_priority_last(any_redis):
    # A stop string spelling the field must not be taken for it: inside JSON its quotes are escaped.
    trap = '"enqueued_at":0.0,'
    jobs = [_job("j-0", stop=(trap,), priority=3), _job("j-1", priority=3)]
    before = _redis_time(any_redis)
    Admission(any_redis, max_queue=0).push(jobs, cap=0)
    after = _redis_time(any_redis)
    raws = any_redis.lrange(keys.queue(MODEL, 3), 0, -1)
    assert len(raws) == 2
    for raw in raws:
        text = raw.decode()
        assert re.match(r'^\{"id":"j-\d"', text) and re.search(r'"priority":3\}$', text)
        stamped = Job.from_json(raw)
        assert before - 0.001 <= stamped.enqueued_at <= after + 0.001
        assert stamped.timeout_s == 60
    assert Job.from_json(raws[0]).params.stop == [trap]
    assert json.loads(raws[0])["params"]["stop"] == [trap]


def test_the_oldest_job_age_is_measured_in_redis_clock_not_the_api_hosts(fake_redis, monkeypatch):
    redis_now = time.time() + 600  # Redis' host is ten minutes ahead of this one
    monkeypatch.setattr(fake_redis, "time", lambda: (int(redis_now), int(redis_now % 1 * 1e6)))
    job = _job()
    job.enqueued_at = redis_now - 7  # as the admission script would have stamped it
    fake_redis.rpush(keys.queue(MODEL), job.to_json())
    fake_redis.zadd(keys.MODELS, {MODEL: redis_now})
    families = {f.name: f for f in QueueCollector(fake_redis).collect()}
    [sample] = [s for s in families[names.OLDEST_JOB_AGE].samples if s.labels["model"] == MODEL]
    assert sample.value == pytest.approx(7, abs=0.01)


def test_the_worker_reads_the_wall_clock_only_through_the_skew_hook():
    """So that --clock-skew-s reaches every wall reading, and the skew tests prove what they say."""
    root = pathlib.Path(__file__).resolve().parent.parent / "worker"
    # kernels.py compares this host's clock with a file this host stamped: one clock, skewed alike.
    allowed = {"clock.py", "continuous/kernels.py"}
    readers = sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                     if re.search(r"\btime\.time\(\)|\bdatetime\.now\(", path.read_text()))
    assert set(readers) <= allowed, readers
    assert "clock.py" in readers
