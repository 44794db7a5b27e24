"""Jobs pushed by hand and workers that are only a JobQueue, for the queue's tests.

The queue's tests (batching, leases, resuming, lost replies, the numerics preference) play both
sides of Redis themselves: they push jobs as the API would, take and publish them through a real
`JobQueue` as a worker would, let a worker "die" by letting its heartbeat expire, and listen on
the jobs' channels as the API does. These are those moves, written once.
"""
from __future__ import annotations

import time

from shared import keys
from shared.protocol import Job, SamplingParams, WorkerInfo, decode_result
from worker.job_queue import JobQueue

MODEL = "m"


def numbered_job(i: int, stream: bool = False, priority: int = 0) -> Job:
    return Job(id=f"job-{i}", model=MODEL, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=2),
               timeout_s=60, stream=stream, priority=priority)


def push_jobs(client, *ids: int, stream: bool = False, priority: int = 0) -> None:
    client.rpush(keys.queue(MODEL, priority), *[numbered_job(i, stream, priority).to_json() for i in ids])


def job_ids_of(jobs) -> list[str]:
    return [j.id for j in jobs]


def announce_worker(queue: JobQueue, ttl_s: float, draining: bool = False) -> None:
    """A heartbeat from the worker behind `queue`, for `ttl_s`."""
    info = WorkerInfo(id=queue.worker_id, model=MODEL, context_window=128, engine="continuous", batch=4,
                      device="cpu", dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0,
                      draining=draining)
    queue.heartbeat(info, ttl_s=ttl_s)


def lapse(client, *names) -> None:
    """The keys `names` expire as their TTLs would, run down to 1 ms rather than slept out (a test
    gives them TTLs no loaded machine outlives before it looks); waits until Redis has dropped them."""
    for name in names:
        client.pexpire(name, 1)
    give_up = time.monotonic() + 30
    while client.exists(*names) and time.monotonic() < give_up:
        time.sleep(0.005)


class FakeTime:
    """worker.job_queue's `time` (monkeypatch it in), its monotonic clock moved only by the test
    (`now`, `advance`) and by the queue's own sleeps: what is due or waited for goes by this clock,
    whatever a loaded machine does to real time. `schedule`: (at, what to do then), run as the clock
    passes each moment (a job arriving mid-wait, say)."""

    def __init__(self, schedule=()):
        self.now = 0.0
        self.schedule = sorted(schedule, key=lambda event: event[0])
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self.schedule and self.schedule[0][0] <= self.now:
            self.schedule.pop(0)[1]()

    def __getattr__(self, name):  # anything else the module reads from `time`
        return getattr(time, name)


def die_holding(queue: JobQueue, client) -> None:
    """The worker behind `queue` dies holding its jobs: its heartbeat expires."""
    announce_worker(queue, ttl_s=0.05)
    time.sleep(0.1)


def subscribe_to(client, *job_ids: str):
    pubsub = client.pubsub()
    pubsub.subscribe(*[keys.channel(MODEL, j) for j in job_ids])
    for _ in job_ids:
        assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    return pubsub


def messages_heard(pubsub) -> list:
    """(job id, message) of everything published since, in order."""
    return [(m["channel"].decode().rsplit(":", 1)[1], decode_result(m["data"]))
            for m in iter(lambda: pubsub.get_message(timeout=0.3), None)]


def push_job(client, job: Job) -> None:
    client.rpush(keys.queue(MODEL), job.to_json())
