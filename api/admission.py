"""Backpressure: a cap on the jobs waiting per model, checked and pushed in one atomic step.

A read-then-push from Python would let a burst through (every API thread reads "room for one",
then all push), so the check and the push are one Lua script, which Redis runs alone. Beyond the
cap a request gets 429 with a Retry-After estimated from how fast workers have been taking jobs.
"""
from __future__ import annotations

import math

import redis

from api.errors import too_many
from shared import keys
from shared.protocol import Job, WorkerInfo

RATE_WINDOW_S = 30  # the drain rate is the jobs taken over this many seconds
RETRY_MIN_S, RETRY_MAX_S = 1, 60
RETRY_STALLED_S = 10  # nothing taken lately (workers busy with long answers, or starting)
AUTO_CAP_PER_SLOT = 4  # --max-queue -1: this many waiting jobs per job the live workers hold at once

# KEYS: the model's queues, most urgent first; the one to push onto; the wake list; the wake list of
# the worker the jobs are offered to (shared/routing.py; the model's wake list again when none).
# ARGV: cap (0: none), jobs the request needs, drain prefix, window, the offer's wait in ms (0: no
# offer), then the jobs (none: only look), each with enqueued_at 0.0 and offer_until 0, which the
# script stamps.
# Returns {accepted, jobs waiting before, jobs taken in the window}.
_ADMIT = """
local nq = #KEYS - 3
local waiting = 0
for i = 1, nq do waiting = waiting + redis.call('LLEN', KEYS[i]) end
local cap, needed = tonumber(ARGV[1]), tonumber(ARGV[2])
if cap > 0 and waiting + needed > cap then
  local now, taken = tonumber(redis.call('TIME')[1]), 0
  for s = now - tonumber(ARGV[4]) + 1, now do
    taken = taken + tonumber(redis.call('GET', ARGV[3] .. s) or '0')
  end
  return {0, waiting, taken}
end
if #ARGV > 5 then
  -- Stamped here, in Redis' clock, which every host reads alike (Job.enqueued_at): the job is
  -- built with 0.0, and a JSON string cannot hold the key's unescaped quotes, so this is the field.
  local t = redis.call('TIME')
  local stamp = '"enqueued_at":' .. t[1] .. string.format('.%06d', tonumber(t[2]))
  local wait = tonumber(ARGV[5])
  local offered = '"offer_until":' .. string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + wait)
  local jobs = {}
  for i = 6, #ARGV do
    local job = string.gsub(ARGV[i], '"enqueued_at":0%.0([,}])', stamp .. '%1', 1)
    if wait > 0 then job = string.gsub(job, '"offer_until":0([,}])', offered .. '%1', 1) end
    jobs[#jobs + 1] = job
  end
  redis.call('RPUSH', KEYS[nq + 1], unpack(jobs))
  redis.call('LPUSH', KEYS[nq + 2], '1')
  redis.call('LTRIM', KEYS[nq + 2], 0, 63)
  if wait > 0 then  -- the worker it is offered to starts it now, were it idle
    redis.call('LPUSH', KEYS[nq + 3], '1')
    redis.call('LTRIM', KEYS[nq + 3], 0, 63)
  end
end
return {1, waiting, 0}
"""


class Admission:
    def __init__(self, client: redis.Redis, max_queue: int):
        self.max_queue = max_queue
        self._script = client.register_script(_ADMIT)

    def cap(self, workers: list[WorkerInfo]) -> int:
        """Jobs that may wait for `workers`' model: the setting, or sized from what they hold."""
        if self.max_queue >= 0:
            return self.max_queue
        return AUTO_CAP_PER_SLOT * max(1, sum(max(1, w.batch) for w in workers))

    def check(self, model: str, needed: int, cap: int) -> None:
        """429 now if `needed` more jobs would not fit: before tokenizing, to answer a crowd fast."""
        self._run(model, needed, cap, [], push_to=keys.queue(model))

    def push(self, jobs: list[Job], cap: int, offer_wait_s: float = 0.0) -> None:
        """Queue the jobs, all or none: 429 if they would not fit under the cap. Jobs offered to a
        worker (Job.offer, all the same one) are its own for `offer_wait_s` from now."""
        model, offer = jobs[0].model, jobs[0].offer
        self._run(model, len(jobs), cap, [j.to_json() for j in jobs], push_to=keys.queue(model, jobs[0].priority),
                  offer=offer, offer_wait_ms=round(offer_wait_s * 1000) if offer else 0)

    def _run(self, model: str, needed: int, cap: int, jobs: list[str], push_to: str, offer: str = "",
             offer_wait_ms: int = 0) -> None:
        accepted, waiting, taken = self._script(
            keys=[*keys.queues(model), push_to, keys.wake(model),
                  keys.worker_wake(model, offer) if offer else keys.wake(model)],
            args=[cap, needed, keys.drained_prefix(model), RATE_WINDOW_S, offer_wait_ms, *jobs])
        if not accepted:
            wait = retry_after(waiting + needed - cap, taken / RATE_WINDOW_S)
            raise too_many(f"{waiting} jobs are already waiting for {model} (at most {cap}): "
                           f"try again in {wait} s", code="queue_full", retry_after=wait)


def retry_after(excess: int, jobs_per_s: float) -> int:
    """Seconds until the queue has drained by `excess` jobs at the recent rate, within bounds."""
    if jobs_per_s <= 0:
        return RETRY_STALLED_S
    return min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(excess / jobs_per_s)))

