"""The worker's side of Redis: take jobs reliably, publish results, heartbeat, recover dead workers.

Jobs move with BLMOVE from the model's queue into this worker's own processing list, and leave it
only once their answer is published; a worker that dies leaves its jobs there for another worker
to put back (`requeue_dead_workers`).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Iterable

import redis

from shared import keys
from shared.protocol import Failure, Job, WorkerInfo, encode_result
from worker.clock import RedisClock
from worker.sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_NORMALLY = ("stop", "length")
STAND_IN_POLL_S = 0.05
FILL_POLL_S = 0.001  # how often a filling batch looks for late arrivals
DRAINED_TTL_S = 120  # the per-second counts of jobs taken, which the API reads as a drain rate
ATTEMPTS_TTL_S = 24 * 3600

# Move up to ARGV[1] jobs, most urgent queue first and FIFO within one, into this worker's
# processing list, in one atomic step. A job on its last retry (ARGV[3] > 0 workers died holding
# it) is taken only alone (ARGV[2] = 1: this worker holds nothing) and then nothing with it, so
# that if it kills this worker too, it alone is to blame; otherwise taking stops before it, so
# priority order holds.
# KEYS: the model's queues, most urgent first, then the processing list.
# Returns {1 if the one job taken must run alone, the jobs}.
_TAKE = """
local nq = #KEYS - 1
local processing = KEYS[nq + 1]
local limit, alone_ok, last_retry = tonumber(ARGV[1]), ARGV[2] == '1', tonumber(ARGV[3])
local taken, isolated = {}, 0
for i = 1, nq do
  while #taken < limit do
    local raw = redis.call('LINDEX', KEYS[i], 0)
    if not raw then break end
    local id = string.match(raw, '^{"id":"([^"]*)"') or ''
    local tries = tonumber(redis.call('GET', ARGV[4] .. id) or '0')
    if last_retry > 0 and tries >= last_retry then
      if alone_ok and #taken == 0 then
        redis.call('LMOVE', KEYS[i], processing, 'LEFT', 'RIGHT')
        taken[1], isolated = raw, 1
      end
      limit = 0  -- nothing more now: it runs alone, or waits for a worker that holds nothing
      break
    end
    redis.call('LMOVE', KEYS[i], processing, 'LEFT', 'RIGHT')
    taken[#taken + 1] = raw
  end
end
if #taken > 0 then
  local drained = ARGV[5] .. redis.call('TIME')[1]
  redis.call('INCRBY', drained, #taken)
  redis.call('EXPIRE', drained, tonumber(ARGV[6]))
end
return {isolated, taken}
"""

# Put a dead worker's jobs back at the front of their queues, newest first so the oldest ends up
# first in line, counting the death for each; a job that has already had its ARGV[2] retries is
# answered with ARGV[1] (a Failure) instead. KEYS: the dead worker's processing list, the model's wake list.
# ARGV: the failure, max attempts, then the key prefixes. Returns {jobs requeued, jobs failed}.
_REQUEUE = """
local requeued, failed = 0, 0
while true do
  local raw = redis.call('RPOP', KEYS[1])
  if not raw then break end
  local id = string.match(raw, '^{"id":"([^"]*)"') or ''
  local priority = string.match(raw, '"priority":(-?%d+)}$') or '0'
  local tries = redis.call('INCR', ARGV[3] .. id)
  redis.call('EXPIRE', ARGV[3] .. id, tonumber(ARGV[7]))
  if tries > tonumber(ARGV[2]) then
    redis.call('SET', ARGV[4] .. id, ARGV[1], 'EX', tonumber(ARGV[6]))
    redis.call('PUBLISH', ARGV[5] .. id, ARGV[1])
    failed = failed + 1
  else
    redis.call('LPUSH', ARGV[8] .. priority, raw)
    requeued = requeued + 1
  end
end
if requeued > 0 then redis.call('LPUSH', KEYS[2], '1') end
return {requeued, failed}
"""


class JobQueue:
    def __init__(self, client: redis.Redis, worker_id: str, model: str, answer_ttl_s: int = 300,
                 max_attempts: int = 2):
        self.redis = client
        self.worker_id = worker_id
        self.model = model
        self.answer_ttl_s = answer_ttl_s
        self.max_attempts = max_attempts
        self.isolated: set[str] = set()  # held jobs that run alone: their earlier worker died
        self._wake = keys.wake(model)
        self._processing = keys.processing(worker_id)
        self._take_script = client.register_script(_TAKE)
        self._requeue_script = client.register_script(_REQUEUE)
        self._raw: dict[str, bytes] = {}  # job id -> its exact JSON, which LREM needs
        # Dead workers' jobs this worker put back / failed after max_attempts, by model (/metrics).
        self.requeued: Counter[str] = Counter()
        self.crashed: Counter[str] = Counter()
        self._tokenizer_files: dict[str, bytes] = {}
        self.clock = RedisClock()  # synced by each heartbeat

    # Taking jobs

    def take(self, limit: int, wait_s: float, block_s: float, alone_ok: bool = True) -> list[Job]:
        """Up to `limit` jobs, most urgent queue first: wait up to `block_s` for the first, then
        `wait_s` more for the rest. A job on its last retry runs alone (`alone_ok`: this worker
        holds nothing), so that if it kills this worker too, it alone is to blame."""
        if limit <= 0:
            return []
        raws = self._take_now(limit, alone_ok)
        if not raws and block_s > 0:
            self._wait_for_work(block_s)
            raws = self._take_now(limit, alone_ok)
        if not raws:
            return []
        deadline = time.monotonic() + wait_s
        while len(raws) < limit and not self.isolated:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Polled, not blocked: Redis checks a blocked client's timeout only every ~100 ms
            # (hz 10), so a 5 ms block on an empty queue can hold the whole batch for 100 ms.
            time.sleep(min(FILL_POLL_S, left))
            raws += self._take_now(limit - len(raws), alone_ok=False)
        return [job for job in map(self._parse, raws) if job is not None]

    def _take_now(self, limit: int, alone_ok: bool) -> list[bytes]:
        isolated, raws = self._take_script(
            keys=[*keys.queues(self.model), self._processing],
            args=[limit, int(alone_ok), self.max_attempts, keys.attempts(""),
                  keys.drained_prefix(self.model), DRAINED_TTL_S])
        if isolated:
            self.isolated.add(_job_id(raws[0]))
        return raws

    def _wait_for_work(self, block_s: float) -> None:
        """Block until the API pushes something (it adds a token to the wake list) or block_s."""
        started = time.monotonic()
        if self.redis.blpop([self._wake], block_s) is None and time.monotonic() - started < block_s / 2:
            # The embedded stand-in for Redis (fakeredis) answers a blocking pop at once: don't spin.
            time.sleep(min(block_s, STAND_IN_POLL_S))

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

    def publish(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """New text of each sequence; for finished ones the final answer, and the job is done.
        Returns the finished ones.

        All in one round trip. If Redis fails, nothing is marked as sent: calling again with the
        same sequences sends it all again.
        """
        pipe = self.redis.pipeline(transaction=False)
        deltas, done, finished = [], [], []
        for seq in seqs:
            delta = seq.delta() if seq.job.stream else None
            if delta is not None:
                pipe.publish(keys.channel(seq.id), encode_result(delta))
                deltas.append((seq, delta))
            if seq.finished:
                if seq.finish_reason in FINISHED_NORMALLY:
                    self._send_last(pipe, seq.id, encode_result(seq.final()))
                done.append(seq.id)
                finished.append(seq)
        self._remove(pipe, done)
        for seq, delta in deltas:
            seq.sent(delta)
        return finished

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
            self.isolated.discard(job_id)

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Jobs whose client went away."""
        if not job_ids:
            return set()
        flags = self.redis.mget([keys.cancel(j) for j in job_ids])
        return {j for j, flag in zip(job_ids, flags) if flag is not None}

    # Liveness

    def sync_clock(self) -> float:
        """Measure Redis' clock against this host's (`self.clock`); returns Redis' time."""
        sent = time.monotonic()
        seconds, microseconds = self.redis.time()
        self.clock.sync(seconds + microseconds / 1e6, sent, time.monotonic())
        return self.clock.now()

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(keys.WORKERS, self.worker_id, self.model)
        pipe.zadd(keys.MODELS, {self.model: self.sync_clock()})
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

    def count_start(self) -> None:
        """One more worker process started for this model (restarts show in /metrics)."""
        self.redis.hincrby(keys.WORKER_STARTS, self.model, 1)

    def leave(self) -> None:
        """A clean exit: nothing left in processing, so just disappear."""
        self.redis.delete(keys.heartbeat(self.worker_id))
        if not self.redis.llen(self._processing):
            self.redis.hdel(keys.WORKERS, self.worker_id)

    def requeue_dead_workers(self) -> int:
        """Put the jobs of workers without a heartbeat back in their queues; a job that has now
        lost a worker on each of its `max_attempts` retries too is failed instead, so a job that
        kills workers stops there."""
        total = 0
        crashed = encode_result(Failure(
            message=f"the request's worker died while writing it, {self.max_attempts + 1} time(s): "
                    f"it was not tried again", code="worker_crashed"))
        for worker_id, model in self.redis.hgetall(keys.WORKERS).items():
            worker_id, model = worker_id.decode(), model.decode()
            if self.redis.exists(keys.heartbeat(worker_id)):
                continue
            requeued, failed = self._requeue_script(
                keys=[keys.processing(worker_id), keys.wake(model)],
                args=[crashed, self.max_attempts, keys.attempts(""), keys.answer(""), keys.channel(""),
                      self.answer_ttl_s, ATTEMPTS_TTL_S, keys.queue_prefix(model)])
            self.redis.hdel(keys.WORKERS, worker_id)
            self.requeued[model] += requeued
            self.crashed[model] += failed
            if requeued or failed:
                log.warning("worker %s is gone: %d job(s) back in the queue, %d failed after %d "
                            "retries", worker_id, requeued, failed, self.max_attempts)
            total += requeued
        return total


def _job_id(raw: bytes) -> str:
    return json.loads(raw)["id"]
