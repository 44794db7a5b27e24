"""The worker's side of Redis: take jobs reliably, publish results, heartbeat, recover dead workers.

Jobs move with BLMOVE from the model's queue into this worker's own processing list, and leave it
only once their answer is published; a worker that dies leaves its jobs there for another worker
to put back (`requeue_dead_workers`).
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import redis

from shared import keys
from shared.protocol import Failure, Job, WorkerInfo, encode_result
from worker.sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_NORMALLY = ("stop", "length")
STAND_IN_POLL_S = 0.05
FILL_POLL_S = 0.001  # how often a filling batch looks for late arrivals


class JobQueue:
    def __init__(self, client: redis.Redis, worker_id: str, model: str, answer_ttl_s: int = 300):
        self.redis = client
        self.worker_id = worker_id
        self.model = model
        self.answer_ttl_s = answer_ttl_s
        self._queue = keys.queue(model)
        self._processing = keys.processing(worker_id)
        self._raw: dict[str, bytes] = {}  # job id -> its exact JSON, which LREM needs
        self._tokenizer_files: dict[str, bytes] = {}

    # Taking jobs

    def take(self, limit: int, wait_s: float, block_s: float) -> list[Job]:
        """Up to `limit` jobs: wait up to `block_s` for the first, then `wait_s` more for the rest."""
        if limit <= 0:
            return []
        first = self._move(block_s)
        if first is None:
            return []
        raws = [first]
        deadline = time.monotonic() + wait_s
        while True:
            raws += self._move_queued(limit - len(raws))
            left = deadline - time.monotonic()
            if len(raws) >= limit or left <= 0:
                break
            # Polled, not a BLMOVE: Redis checks a blocked client's timeout only every ~100 ms
            # (hz 10), so a 5 ms BLMOVE on an empty queue can hold the whole batch for 100 ms.
            time.sleep(min(FILL_POLL_S, left))
        return [job for job in map(self._parse, raws) if job is not None]

    def _move_queued(self, count: int) -> list[bytes]:
        """Up to `count` jobs already queued, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for _ in range(count):
            pipe.lmove(self._queue, self._processing, "LEFT", "RIGHT")
        return [raw for raw in pipe.execute() if raw is not None]

    def _move(self, block_s: float):
        """One job from the queue into the processing list, waiting up to block_s for it."""
        if block_s <= 0:
            return self.redis.lmove(self._queue, self._processing, "LEFT", "RIGHT")
        started = time.monotonic()
        raw = self.redis.blmove(self._queue, self._processing, block_s, "LEFT", "RIGHT")
        if raw is None and time.monotonic() - started < block_s / 2:
            # The embedded stand-in for Redis (fakeredis) answers BLMOVE at once: don't spin on it.
            time.sleep(min(block_s, STAND_IN_POLL_S))
        return raw

    def _parse(self, raw: bytes):
        try:
            job = Job.from_json(raw)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("dropping a malformed job %r: %s", raw[:200], exc)
            self.redis.lrem(self._processing, 1, raw)
            return None
        self._raw[job.id] = raw
        return job

    # Results

    def publish(self, seqs: Iterable[Sequence]) -> None:
        """New text of each sequence; for finished ones the final answer, and the job is done.

        All in one round trip. If Redis fails, nothing is marked as sent: calling again with the
        same sequences sends it all again.
        """
        pipe = self.redis.pipeline(transaction=False)
        deltas, done = [], []
        for seq in seqs:
            delta = seq.delta() if seq.job.stream else None
            if delta is not None:
                pipe.publish(keys.channel(seq.id), encode_result(delta))
                deltas.append((seq, delta))
            if seq.finished:
                if seq.finish_reason in FINISHED_NORMALLY:
                    self._send_last(pipe, seq.id, encode_result(seq.final()))
                done.append(seq.id)
        self._remove(pipe, done)
        for seq, delta in deltas:
            seq.sent(delta)

    def fail(self, job_ids: list[str], message: str, code: str = "worker_error") -> None:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self._send_last(pipe, job_id, encode_result(Failure(message=message, code=code)))
        self._remove(pipe, job_ids)

    def _send_last(self, pipe, job_id: str, message: str) -> None:
        # Stored before it is published, so a subscriber that missed the message can still read it.
        pipe.set(keys.answer(job_id), message, ex=self.answer_ttl_s)
        pipe.publish(keys.channel(job_id), message)

    def _remove(self, pipe, job_ids: list[str]) -> None:
        """Take the jobs out of the processing list, with the rest of the pipeline, and run it."""
        for job_id in job_ids:
            if job_id in self._raw:
                pipe.lrem(self._processing, 1, self._raw[job_id])
        pipe.execute()
        for job_id in job_ids:
            self._raw.pop(job_id, None)

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Jobs whose client went away."""
        if not job_ids:
            return set()
        flags = self.redis.mget([keys.cancel(j) for j in job_ids])
        return {j for j, flag in zip(job_ids, flags) if flag is not None}

    # Liveness

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(keys.WORKERS, self.worker_id, self.model)
        pipe.set(keys.heartbeat(self.worker_id), info.to_json(), px=int(ttl_s * 1000))
        pipe.exists(keys.tokenizer(self.model))
        tokenizer_stored = pipe.execute()[-1]
        if not tokenizer_stored and self._tokenizer_files:  # Redis restarted empty
            self.store_tokenizer(self._tokenizer_files)

    def store_tokenizer(self, files: dict[str, bytes]) -> None:
        self._tokenizer_files = files
        pipe = self.redis.pipeline()
        pipe.delete(keys.tokenizer(self.model))
        pipe.hset(keys.tokenizer(self.model), mapping=files)
        pipe.execute()

    def leave(self) -> None:
        """A clean exit: nothing left in processing, so just disappear."""
        self.redis.delete(keys.heartbeat(self.worker_id))
        if not self.redis.llen(self._processing):
            self.redis.hdel(keys.WORKERS, self.worker_id)

    def requeue_dead_workers(self) -> int:
        """Put the jobs of workers without a heartbeat back at the front of their queues."""
        total = 0
        for worker_id, model in self.redis.hgetall(keys.WORKERS).items():
            worker_id, model = worker_id.decode(), model.decode()
            if self.redis.exists(keys.heartbeat(worker_id)):
                continue
            moved = 0
            # Newest first onto the head of the queue, so the oldest job ends up first in line.
            while self.redis.lmove(keys.processing(worker_id), keys.queue(model), "RIGHT", "LEFT"):
                moved += 1
            self.redis.hdel(keys.WORKERS, worker_id)
            if moved:
                log.warning("worker %s is gone: %d job(s) back in the queue", worker_id, moved)
            total += moved
        return total
