"""The worker's side of Redis: take jobs reliably, publish results, heartbeat, recover dead workers.

Jobs move with BLMOVE from the model's queue into this worker's own processing list, and leave it
only once their answer is published; a worker that dies leaves its jobs there for another worker
to put back (`requeue_dead_workers`).

A worker that is only cut off from Redis looks dead too, and its jobs go to others; each job's lease
(keys.lease: the id of the worker that took it) tells it, once its link is back, which jobs are no
longer its own: publishing checks the lease in the same script, so it sends nothing for them.

Every key a script here touches carries the model's hash tag (shared/keys.py), the per-job names it
builds inside too (from prefixes that carry it), so each script runs on one slot, as Redis Cluster
requires; there, results go by SPUBLISH on that slot's primary instead of PUBLISH (see api/broker.py).

A job's written token ids are recorded beside it (keys.written): for a stream in the same script
that publishes its text, so the text a client has is never ahead of the record; for a whole job
every RECORD_INTERVAL_S. A worker that takes the job back after its worker died gets the record in
the same take, and continues from it (worker/sequence.py) instead of writing the job again.

A take can run in Redis without its reply reaching the worker (a timeout, a cut link): its jobs
then sit in the worker's processing list under its lease, unknown to it. The worker looks there
about once a heartbeat (`adopt_stranded`) and runs them, or puts them back for another worker.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from typing import Iterable, NamedTuple, Optional

import redis

from shared import keys
from shared.protocol import Failure, Job, WorkerInfo, encode_result
from shared.redis_client import is_cluster_client, server_time
from shared.settings import Settings
from worker.clock import RedisClock
from worker.sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_NORMALLY = ("stop", "length")
STAND_IN_POLL_S = 0.05
FILL_POLL_S = 0.001  # how often a filling batch looks for late arrivals
# Redis checks a blocked client's timeout about every 100 ms (hz 10): a shorter wait is slept instead.
REDIS_BLOCK_GRAIN_S = 0.1
DRAINED_TTL_S = 120  # the per-second counts of jobs taken, which the API reads as a drain rate
ATTEMPTS_TTL_S = 24 * 3600
# Longer than any job lives (a request waits --request-timeout, 300 s by default), so a lease never
# expires under a worker that is still writing; finished or put back, the job's lease is deleted.
# A job's record of written tokens lives as long, for the same reason: its answer deletes it.
LEASE_TTL_S = 24 * 3600
# How often a whole (not streamed) job's new tokens are recorded. A stream's are, every step, in the
# publish that sends its text; a whole job publishes nothing until its answer, so recording it every
# step would add a script call (and its tokens' bytes) per step that no client is waiting for. Once a
# second, for all such jobs in one call, bounds what a worker's death costs them (a second's decoding
# each, written again) at a round trip per second (docs/scaling.md).
RECORD_INTERVAL_S = 1.0
_RECORD = re.compile(rb"(?:\d+,)*")  # keys.written: "id,id,...,"
# How long a dead worker's job waits, after it is put back, for a live worker of the dead one's
# numerics fingerprint (a worker of another passes over it meanwhile; an idle one looks again within
# its block, worker.IDLE_BLOCK_S, after that). A preference, never a condition: resuming from the
# written tokens is right on any worker, but one of the same fingerprint goes on with the numbers
# that wrote them, so the job's text is what it would have been undisturbed. Short, as it is time a
# job may wait while a worker of another fingerprint had room; measured in Redis' clock (the stamp's
# expiry). 0: no preference.
PREFER_SAME_NUMERICS_S = 2.0
# At most this many such jobs passed over in one take: beyond them, the take stops (a bound on the
# script's work while a large worker's jobs wait for their fingerprint).
PASS_OVER_AT_MOST = 16
# The finish reason of a sequence whose job another worker now holds: never published again.
LOST = "lost"

# Move up to ARGV[1] jobs, most urgent queue first and FIFO within one, into this worker's
# processing list, in one atomic step. A job on its last retry (ARGV[3] > 0 workers died holding
# it) is taken only alone (ARGV[2] = 1: this worker holds nothing) and then nothing with it, so
# that if it kills this worker too, it alone is to blame; otherwise taking stops before it, so
# priority order holds.
# A job put back after its worker died is passed over, for PREFER_SAME_NUMERICS_S after the requeue
# (its keys.written_by expires then, in Redis' clock), by a worker whose numerics fingerprint
# (ARGV[11]) is not the dead worker's, while a worker of that fingerprint is live (ARGV[13] ..
# fingerprint exists: keys.live_numerics, which those workers' heartbeats keep): that one continues
# it with the numbers that wrote it. It keeps its place; the take goes on behind it, up to ARGV[14]
# jobs passed over, and wakes nobody for those (an idle worker looks again after its block). Only a
# job that has cost a worker (its attempts key) is looked at for it.
# Each job taken gets a lease naming this worker (ARGV[8]), and comes with its record of written
# tokens (ARGV[10] the prefix; '' none), should an earlier worker have died writing it.
# A worker takes only what it will start
# (worker.py): jobs it leaves behind wake an idle worker, as the API's push did, so none sleeps
# through its block while work waits (one token, if none is there already).
# A job offered to another worker (its "offer", shared/routing.py) is passed over the same way until
# its offer_until (ms of Redis' clock), while that worker's heartbeat (ARGV[15] the prefix) is there
# and says it neither drains nor holds jobs it has not started (its stats' `waiting`: it is full).
# Then a worker that holds nothing (ARGV[2] = 1) takes it, or any worker once that worker's
# heartbeat is late (less than ARGV[16] ms left: a beat missed, as a stopped process misses it),
# after this queue's jobs offered to no one else (its own, new conversations', a dead worker's). A
# busy worker that took it read the conversation's history again while its own turns waited, and
# those lapsed in turn: in a saturated pool every lapse cost a prefill and made more (docs/scaling.md).
# Past `limit`, up to ARGV[17] more jobs offered to this worker itself are taken (Engine.held_slots:
# its prefix cache holds their conversations, so they cost a new turn each, which its scheduler
# starts before longer prompts), from the queue where the take reached its limit; the other jobs
# passed there stay where they are, and wake another worker. Not from a less urgent queue than one
# where such a job was left, so priority order holds; nor one that has cost a worker (its attempts
# key), which takes the ordinary way.
# KEYS: the model's queues, most urgent first, then the processing list, then the wake list.
# Returns {1 if the one job taken must run alone, the jobs, their records, {id, fingerprint, ...} of
# those passed over for their fingerprint, ms until the first offer passed over lapses (0: none),
# the ids of the jobs taken that a dead worker held (put back: an attempts key)}.
_TAKE = """
local nq = #KEYS - 2
local processing = KEYS[nq + 1]
local limit, alone_ok, last_retry = tonumber(ARGV[1]), ARGV[2] == '1', tonumber(ARGV[3])
local mine, most_passed, held = ARGV[11], tonumber(ARGV[14]), tonumber(ARGV[17])
local taken, isolated, written, passed, skipped, retried = {}, 0, {}, {}, {}, {}
local npassed, nleft = 0, 0  -- passed over to be left in place; left past the limit (they wake a worker)
local me_id, beat_prefix = ARGV[8], ARGV[15]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lapse = 0  -- ms until the first offer to another worker passed over here lapses
local holders = {}  -- worker id -> {ms its heartbeat has left (-2: none), whether offers to it hold}
local function holder(worker)
  if holders[worker] == nil then
    local key = beat_prefix .. worker
    local left = redis.call('PTTL', key)
    local holds = left ~= -2  -- a dead worker's offers hold nothing; nor a draining or full one's
    if holds then
      local ok, info = pcall(cjson.decode, redis.call('GET', key) or '{}')
      if ok and type(info) == 'table' then
        local stats = type(info.stats) == 'table' and info.stats or {}
        holds = info.draining ~= true and (tonumber(stats.waiting) or 0) == 0
      end
    end
    holders[worker] = {left, holds}
  end
  return holders[worker]
end
-- A heartbeat with less than ARGV[16] ms left has missed its beat: its worker may be stopped.
local function late(worker)
  local left = holder(worker)[1]
  return left >= 0 and left < tonumber(ARGV[16])
end
local live = {}  -- fingerprint -> a live worker has it
local function alive(numerics)
  if live[numerics] == nil then live[numerics] = redis.call('EXISTS', ARGV[13] .. numerics) == 1 end
  return live[numerics]
end
local function take(queue, raw, at, tries)
  if at == 0 then
    redis.call('LMOVE', queue, processing, 'LEFT', 'RIGHT')
  else  -- behind jobs passed over
    redis.call('LREM', queue, 1, raw)
    redis.call('RPUSH', processing, raw)
  end
  local id = string.match(raw, '^{"id":"([^"]*)"')
  if id then redis.call('SET', ARGV[7] .. id, ARGV[8], 'EX', tonumber(ARGV[9])) end
  if id and tries > 0 then retried[#retried + 1] = id end
  taken[#taken + 1] = raw
  written[#taken] = id and redis.call('GET', ARGV[10] .. id) or ''
end
for i = 1, nq do
  local at = 0  -- jobs passed over at the head of this queue
  local lapsed = {}  -- jobs whose offer to another live worker has lapsed: after this queue's others
  local left_here = 0  -- jobs past the limit left in this queue
  while (#taken < limit or held > 0) and npassed < most_passed and nleft < most_passed do
    local raw = redis.call('LINDEX', KEYS[i], at)
    if not raw then break end
    local id = string.match(raw, '^{"id":"([^"]*)"') or ''
    local tries = tonumber(redis.call('GET', ARGV[4] .. id) or '0')
    local by = tries > 0 and redis.call('GET', ARGV[12] .. id)
    local offer, until_ms = string.match(raw, '"offer":"([^"]+)","offer_until":(%d+)')
    if offer and offer ~= me_id and holder(offer)[2] then  -- its worker's own until the offer lapses
      npassed, at = npassed + 1, at + 1
      local wait = tonumber(until_ms) - now_ms
      if wait > 0 then
        if lapse == 0 or wait < lapse then lapse = wait end
      else
        lapsed[#lapsed + 1] = {raw, offer, tries}
      end
    elseif #taken >= limit then  -- past the limit: only a job offered here
      if offer == me_id and tries == 0 then
        take(KEYS[i], raw, at, tries)
        held = held - 1
      else
        at, nleft, left_here = at + 1, nleft + 1, left_here + 1
      end
    elseif by and by ~= mine and alive(by) then
      passed[#passed + 1] = id
      passed[#passed + 1] = by
      npassed, at = npassed + 1, at + 1
    elseif last_retry > 0 and tries >= last_retry then
      if alone_ok and #taken == 0 then
        take(KEYS[i], raw, at, tries)
        isolated = 1
      end
      limit, held = 0, 0  -- nothing more now: it runs alone, or waits for a worker that holds nothing
      break
    else
      take(KEYS[i], raw, at, tries)
    end
  end
  local left = #lapsed  -- in their place in line, behind this queue's own and shared jobs
  for _, job in ipairs(lapsed) do
    if #taken >= limit then break end
    if alone_ok or late(job[2]) then
      take(KEYS[i], job[1], 1, job[3])
      at, left = at - 1, left - 1
    end
  end
  skipped[i] = at - left - left_here  -- what is left of them wakes a worker, as a job not passed over does
  if left_here > 0 then held = 0 end  -- none from a less urgent queue
end
if #taken > 0 then
  local drained = ARGV[5] .. redis.call('TIME')[1]
  redis.call('INCRBY', drained, #taken)
  redis.call('EXPIRE', drained, tonumber(ARGV[6]))
end
if redis.call('LLEN', KEYS[nq + 2]) == 0 and npassed < most_passed then
  for i = 1, nq do
    if redis.call('LLEN', KEYS[i]) > (skipped[i] or 0) then
      redis.call('LPUSH', KEYS[nq + 2], '1')
      break
    end
  end
end
return {isolated, taken, written, passed, lapse, retried}
"""

# Put a dead worker's jobs back at the front of their queues, newest first so the oldest ends up
# first in line, counting the death for each; a job that has already had its ARGV[2] retries is
# answered with ARGV[1] (a Failure) instead, and its record of written tokens goes with it (ARGV[12]
# the prefix); one put back keeps its record, for the worker that takes it next, and is stamped with
# the dead worker's numerics fingerprint (its value in the registry) for ARGV[13] ms (ARGV[14] the
# prefix: keys.written_by), which the take prefers for it. Either way the job's
# lease goes: should the worker only have been cut off, it publishes nothing more for it. The
# heartbeat is checked here, not before, and the worker struck off in the same step: a worker whose
# heartbeat comes back meanwhile keeps its jobs.
# KEYS: the worker's processing list, the model's wake list, the worker's heartbeat, the model's
# worker registry. ARGV: the failure, max attempts, the key prefixes, the worker's id, the publishing
# command (PUBLISH, or SPUBLISH in a cluster), the record prefix, the stamp's life and prefix.
# Returns {-1 if the worker is alive, else jobs requeued; jobs failed}.
_REQUEUE = """
if redis.call('EXISTS', KEYS[3]) == 1 then return {-1, 0} end
local requeued, failed = 0, 0
local numerics = redis.call('HGET', KEYS[4], ARGV[10]) or ''
while true do
  local raw = redis.call('RPOP', KEYS[1])
  if not raw then break end
  local id = string.match(raw, '^{"id":"([^"]*)"') or ''
  local priority = string.match(raw, '"priority":(-?%d+)}$') or '0'
  redis.call('DEL', ARGV[9] .. id)
  local tries = redis.call('INCR', ARGV[3] .. id)
  redis.call('EXPIRE', ARGV[3] .. id, tonumber(ARGV[7]))
  if tries > tonumber(ARGV[2]) then
    redis.call('SET', ARGV[4] .. id, ARGV[1], 'EX', tonumber(ARGV[6]))
    redis.call(ARGV[11], ARGV[5] .. id, ARGV[1])
    redis.call('DEL', ARGV[12] .. id)
    failed = failed + 1
  else
    redis.call('LPUSH', ARGV[8] .. priority, raw)
    if numerics ~= '' and tonumber(ARGV[13]) > 0 then
      redis.call('SET', ARGV[14] .. id, numerics, 'PX', tonumber(ARGV[13]))
    end
    requeued = requeued + 1
  end
end
if requeued > 0 then redis.call('LPUSH', KEYS[2], '1') end
redis.call('HDEL', KEYS[4], ARGV[10])
return {requeued, failed}
"""

# A step's results, for jobs whose lease still names this worker (ARGV[1]): record the new tokens,
# publish the new text, store and publish the last message, take the job out of the processing list
# (KEYS[1]) and end its lease and its record. A job whose lease is gone or names another worker gets
# nothing: it is returned, lost.
# ARGV: the worker's id, the lease, channel and answer prefixes, the answer's TTL, the publishing
# command (PUBLISH, or SPUBLISH in a cluster), the record prefix and TTL, the route prefix and TTL
# (an answered job's "route" digest is noted as this worker's: shared/routing.py), then six per job: its id,
# its new text ('' none), its last message ('' none), its JSON to remove ('' not done), and where
# in its record (a byte offset) its new tokens go, and they ('' none).
_PUBLISH = """
local me, lease, channel, answer, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local publish, written, written_ttl = ARGV[6], ARGV[7], tonumber(ARGV[8])
local route, route_ttl = ARGV[9], tonumber(ARGV[10])
local lost = {}
for i = 11, #ARGV, 6 do
  local id, text, last, raw = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local at, record = tonumber(ARGV[i + 4]), ARGV[i + 5]
  if redis.call('GET', lease .. id) ~= me then
    lost[#lost + 1] = id
  else
    -- At an offset the worker knows, not APPENDed: a call sent again after its reply was lost
    -- writes the same bytes at the same place. Offset 0 replaces a record that was not resumed.
    if record ~= '' and at == 0 then
      redis.call('SET', written .. id, record, 'EX', written_ttl)
    elseif record ~= '' then
      redis.call('SETRANGE', written .. id, at, record)
    end
    if text ~= '' then redis.call(publish, channel .. id, text) end
    if last ~= '' then
      -- Stored before it is published, so a subscriber that missed the message can still read it.
      redis.call('SET', answer .. id, last, 'EX', ttl)
      redis.call(publish, channel .. id, last)
    end
    if raw ~= '' then
      redis.call('LREM', KEYS[1], 1, raw)
      redis.call('DEL', lease .. id)
      -- Answered here: this worker's prefix cache holds its prompt, for the conversation's next turn.
      local digest = string.find(last, '"type":"final"', 1, true) and string.match(raw, '"route":"(%x+)"')
      if digest then redis.call('SET', route .. digest, me, 'EX', route_ttl) end
    end
    if last ~= '' or raw ~= '' then redis.call('DEL', written .. id) end
  end
end
return lost
"""


# The jobs in this worker's processing list (KEYS[1]) that it does not hold (ARGV[4...]: the ids it
# holds) and that are leased to it (ARGV[2]; ARGV[1] the lease prefix), or have no id to lease:
# only a take whose reply never reached the worker puts such jobs there. Each with the deaths its
# job has cost workers so far (ARGV[3] the attempts prefix), which tell a last retry.
# Returns {job JSON, deaths, ...}.
_STRANDED = """
local held = {}
for i = 4, #ARGV do held[ARGV[i]] = true end
local found = {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local id = string.match(raw, '^{"id":"([^"]*)"')
  if not id then
    found[#found + 1] = raw
    found[#found + 1] = 0
  elseif not held[id] and redis.call('GET', ARGV[1] .. id) == ARGV[2] then
    found[#found + 1] = raw
    found[#found + 1] = tonumber(redis.call('GET', ARGV[3] .. id) or '0')
  end
end
return found
"""

# Put stranded jobs this worker has no room for back at the front of their queues, the last one
# first so they keep their order, and wake a worker. Only while the lease still names this worker
# (ARGV[1]), and only a job still in its processing list (KEYS[1]): a worker that was struck off
# meanwhile puts nothing back, and a copy of this script that runs again (its reply lost too)
# finds nothing left to move, so no job is ever queued twice.
# KEYS: the processing list, the model's wake list. ARGV: the worker's id, the lease and queue
# prefixes, then the jobs' JSON in the order they were taken. Returns how many went back.
_PUT_BACK = """
local back = 0
for i = #ARGV, 4, -1 do
  local raw = ARGV[i]
  local id = string.match(raw, '^{"id":"([^"]*)"') or ''
  if redis.call('GET', ARGV[2] .. id) == ARGV[1] and redis.call('LREM', KEYS[1], 1, raw) == 1 then
    local priority = string.match(raw, '"priority":(-?%d+)}$') or '0'
    redis.call('LPUSH', ARGV[3] .. priority, raw)
    redis.call('DEL', ARGV[2] .. id)
    back = back + 1
  end
end
if back > 0 then redis.call('LPUSH', KEYS[2], '1') end
return back
"""


class Published(NamedTuple):
    finished: list[Sequence]  # answered, and done
    lost: list[Sequence]  # another worker holds their jobs now: cancelled, nothing was sent


def late_beat_s(heartbeat_s: float, heartbeat_ttl_s: float) -> float:
    """The life left below which a worker's heartbeat has missed a beat: renewed to `heartbeat_ttl_s`
    every `heartbeat_s`, a live one has more than the TTL less a beat left, and half a beat more is
    slack for a beat that comes late (a busy machine)."""
    return max(0.0, heartbeat_ttl_s - 1.5 * heartbeat_s)


class JobQueue:
    def __init__(self, client: redis.Redis, worker_id: str, model: str, answer_ttl_s: int = 300,
                 max_attempts: int = 2, numerics: str = "",
                 beat_late_s: float = late_beat_s(Settings.heartbeat_s, Settings.heartbeat_ttl_s)):
        """`numerics`: the worker's numerics fingerprint (WorkerInfo.numerics), registered with its
        heartbeat: a dead worker's jobs are left a moment for a live worker of the same one.
        `beat_late_s`: another worker's heartbeat with less life left than this has missed a beat
        (`late_beat_s`): a busy worker then takes the offers to it that have lapsed."""
        self.redis = client
        self.worker_id = worker_id
        self.model = model
        self.numerics = numerics
        self.answer_ttl_s = answer_ttl_s
        self.max_attempts = max_attempts
        self.beat_late_s = beat_late_s
        self.isolated: set[str] = set()  # held jobs that run alone: their earlier worker died
        self._wake = keys.wake(model)
        self._own_wake = keys.worker_wake(model, worker_id)
        self.offer_lapses_s: Optional[float] = None  # when the last take passed over an offer to another worker
        self.offers: Counter[str] = Counter()  # offered jobs taken, by offer_taken_by: "own", "other"
        self._processing = keys.processing(model, worker_id)
        # Sharded pub/sub in a cluster: the message goes to the channel's slot's primary only
        # (api/broker.py says why); one server has no shards, and PUBLISH is what every Redis has.
        self._publish_command = "SPUBLISH" if is_cluster_client(client) else "PUBLISH"
        self._take_script = client.register_script(_TAKE)
        self._requeue_script = client.register_script(_REQUEUE)
        self._publish_script = client.register_script(_PUBLISH)
        self._stranded_script = client.register_script(_STRANDED)
        self._put_back_script = client.register_script(_PUT_BACK)
        self._registered = False  # a heartbeat has put this worker in keys.model_workers
        self._raw: dict[str, bytes] = {}  # job id -> its exact JSON, which LREM needs
        # Job id -> the tokens an earlier attempt wrote (its record), for the engine to resume from:
        # the worker takes each out as it adds the job.
        self.written: dict[str, list[int]] = {}
        # Ids of jobs taken that a dead worker held (put back), which the worker takes out the same
        # way: their queue wait counts from their first queueing, and is not an offer's (metrics.py).
        self.retried: set[str] = set()
        self._record_bytes: dict[str, int] = {}  # job id -> the length of its record in Redis
        self._whole_due = time.monotonic() + RECORD_INTERVAL_S  # when whole jobs' tokens are recorded next
        # Dead workers' jobs this worker put back / failed after max_attempts, by model (/metrics).
        self.requeued: Counter[str] = Counter()
        self.crashed: Counter[str] = Counter()
        # Requeued jobs this worker passed over for a live worker of their dead worker's fingerprint,
        # by model (/metrics), each counted (and logged) once: job id -> None, the latest few.
        self.left_for_numerics: Counter[str] = Counter()
        self._passed: dict[str, None] = {}
        self._tokenizer_files: dict[str, bytes] = {}
        self.clock = RedisClock()  # synced by each heartbeat

    # Taking jobs

    def take(self, limit: int, wait_s: float, block_s: float, alone_ok: bool = True, held: int = 0) -> list[Job]:
        """Up to `limit` jobs, most urgent queue first, and past them up to `held` offered to this
        worker (Engine.held_slots): wait up to `block_s` for the first, then `wait_s` more for the
        rest. A job on its last retry runs alone (`alone_ok`: this worker holds nothing), so that if
        it kills this worker too, it alone is to blame."""
        if limit <= 0 and held <= 0:
            return []
        taken = self._take_now(limit, alone_ok, held)
        if not taken and block_s > 0:
            block_until = time.monotonic() + block_s
            self._wait_for_work(min(block_s, self.offer_lapses_s or block_s))
            taken = self._take_now(limit, alone_ok)
            # An offer to another worker passed over is looked at again as it lapses, within the block.
            while not taken and self.offer_lapses_s and time.monotonic() < block_until:
                self._wait_for_work(min(block_until - time.monotonic(), self.offer_lapses_s))
                taken = self._take_now(limit, alone_ok)
        if not taken:
            return []
        deadline = time.monotonic() + wait_s
        while len(taken) < limit and not self.isolated:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Polled, not blocked: Redis checks a blocked client's timeout only every ~100 ms
            # (hz 10), so a 5 ms block on an empty queue can hold the whole batch for 100 ms.
            time.sleep(min(FILL_POLL_S, left))
            taken += self._take_now(limit - len(taken), alone_ok=False)
        jobs = [job for job in (self._parse(raw, record) for raw, record in taken) if job is not None]
        for job in jobs:
            taken_by = self.offer_taken_by(job)
            if taken_by:
                self.offers[taken_by] += 1
        return jobs

    def offer_taken_by(self, job: Job) -> Optional[str]:
        """For a job this worker took: "own" if it was offered here, "other" if it was offered to
        another worker and taken once the offer lapsed; None if it was offered to no one, or a dead
        worker held it (put back: its wait was that worker's hold, not its offer's)."""
        if not job.offer or job.id in self.retried:
            return None
        return "own" if job.offer == self.worker_id else "other"

    def _take_now(self, limit: int, alone_ok: bool, held: int = 0) -> list[tuple[bytes, bytes]]:
        """(job JSON, its record of written tokens) for each job taken."""
        isolated, raws, records, passed, lapse_ms, retried = self._take_script(
            keys=[*keys.queues(self.model), self._processing, self._wake],
            args=[limit, int(alone_ok), self.max_attempts, keys.attempts(self.model, ""),
                  keys.drained_prefix(self.model), DRAINED_TTL_S, keys.lease(self.model, ""), self.worker_id,
                  LEASE_TTL_S, keys.written(self.model, ""), self.numerics, keys.written_by(self.model, ""),
                  keys.live_numerics(self.model, ""), PASS_OVER_AT_MOST, keys.heartbeat(self.model, ""),
                  int(self.beat_late_s * 1000), held])
        self.offer_lapses_s = lapse_ms / 1000 if lapse_ms else None
        self.retried.update(map(_text, retried))
        if isolated:
            self.isolated.add(_job_id(raws[0]))
        for job_id, numerics in zip(map(_text, passed[::2]), map(_text, passed[1::2])):
            self._passed_over(job_id, numerics)
        return list(zip(raws, records))

    def _passed_over(self, job_id: str, numerics: str) -> None:
        """Counted and logged once a job, though a busy worker's takes pass it over every poll."""
        if job_id in self._passed:
            return
        self._passed[job_id] = None
        if len(self._passed) > 1000:
            del self._passed[next(iter(self._passed))]
        self.left_for_numerics[self.model] += 1
        log.info("job %s: left for up to %g s to a live worker of numerics %s, the fingerprint of the "
                 "worker that died writing it (this one's: %s)", job_id, PREFER_SAME_NUMERICS_S, numerics,
                 self.numerics or "none")

    def adopt_stranded(self, held: Iterable[str], room: int, alone_ok: bool = True) -> list[Job]:
        """Jobs that a take moved into this worker's processing list, leased to it, without its reply
        ever reaching it (a socket timeout while Redis stalled, a link cut with the take in flight, a
        take sent again after the first was given up on): nobody else would ever look at them while
        this worker's heartbeat lives, and their clients would wait until their deadline.

        `held`: the ids of the jobs this worker holds (they are left alone). Up to `room` of the
        others are returned, to be run as if just taken; a job on its last retry only alone
        (`alone_ok`: the worker holds nothing), as `take` would. The rest go back to the front of
        their queues for any worker, unless the worker lost their lease meanwhile."""
        found = self._stranded_script(
            keys=[self._processing],
            args=[keys.lease(self.model, ""), self.worker_id, keys.attempts(self.model, ""), *held])
        adopted, back, alone = [], [], False
        for raw, deaths in zip(found[::2], found[1::2]):
            job = self._parse(raw)  # a malformed one is dropped, as a take drops it
            if job is None:
                continue
            last_retry = 0 < self.max_attempts <= deaths
            if alone or len(adopted) >= room or (last_retry and (adopted or not alone_ok)):
                back.append(self._raw.pop(job.id))
                continue
            adopted.append(job)
            if last_retry:
                alone = True
                self.isolated.add(job.id)
        if adopted:  # their records, as a take returns them (one slot: the model's)
            records = self.redis.mget([keys.written(self.model, j.id) for j in adopted])
            for job, record in zip(adopted, records):
                self._keep_written(job.id, record)
        returned = 0
        if back:
            returned = self._put_back_script(
                keys=[self._processing, self._wake],
                args=[self.worker_id, keys.lease(self.model, ""), keys.queue_prefix(self.model), *back])
        if adopted or back:
            log.warning("found %d job(s) in this worker's processing list that a take had put there "
                        "without its reply reaching the worker: %d run here, %d back in the queue (%s)",
                        len(adopted) + len(back), len(adopted), returned,
                        ", ".join([j.id for j in adopted] + [_job_id(r) for r in back]))
        return adopted

    def _wait_for_work(self, block_s: float) -> None:
        """Block until the API pushes something (it adds a token to the wake list, and to this
        worker's own when it offers it the job) or block_s."""
        started = time.monotonic()
        if block_s < REDIS_BLOCK_GRAIN_S:  # Redis would hold a blocked client longer than asked
            time.sleep(block_s)
            return
        if self.redis.blpop([self._own_wake, self._wake], block_s) is None and time.monotonic() - started < block_s / 2:
            # The embedded stand-in for Redis (fakeredis) answers a blocking pop at once: don't spin.
            time.sleep(min(block_s, STAND_IN_POLL_S))

    def _parse(self, raw: bytes, record: Optional[bytes] = None):
        try:
            job = Job.from_json(raw)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("dropping a malformed job %r: %s", raw[:200], exc)
            self.redis.lrem(self._processing, 1, raw)
            return None
        self._raw[job.id] = raw
        self._keep_written(job.id, record)
        return job

    def _keep_written(self, job_id: str, record: Optional[bytes]) -> None:
        """What a job taken resumes from: its record's tokens, unless it has none or it is malformed
        (then, with a warning, the job is written from the start)."""
        self.written.pop(job_id, None)
        self._record_bytes.pop(job_id, None)  # anything known of an earlier hold of it is stale
        if not record:
            return
        if not _RECORD.fullmatch(record):
            log.warning("job %s: ignoring its malformed record of written tokens %r: writing it from the "
                        "start", job_id, record[:80])
            return
        self.written[job_id] = [int(t) for t in record[:-1].split(b",")]

    # Results

    def publish(self, seqs: Iterable[Sequence], check: bool = False) -> Published:
        """New text of each sequence; for finished ones the final answer, and the job is done.
        Sequences whose job another worker holds now (this one was declared dead while cut off) are
        cancelled (finish reason LOST) and nothing is sent for them, now or later. `check`: also
        look at the leases of sequences with nothing to send (otherwise, so that a step of jobs that
        do not stream costs no round trip, they are not sent to Redis).

        All in one round trip. If Redis fails, nothing is marked as sent: calling again with the
        same sequences sends it all again.
        """
        now = time.monotonic()
        whole_due = now >= self._whole_due
        entries, sending = [], []
        for seq in seqs:
            if seq.finish_reason == LOST:  # found lost before: nothing more is sent for it
                continue
            delta = seq.delta() if seq.job.stream else None
            last = encode_result(seq.final()) if seq.finish_reason in FINISHED_NORMALLY else ""
            raw = self._raw.get(seq.id, b"") if seq.finished else b""
            at, record = self._record(seq, whole_due)
            if delta is not None or last or raw or check or record:
                entries += [seq.id, encode_result(delta) if delta is not None else "", last, raw, at, record]
            sending.append((seq, delta, len(seq.output_ids) if record else 0, at + len(record)))
        lost_ids = {_text(i) for i in self._run_publish(entries)}
        if whole_due:
            self._whole_due = now + RECORD_INTERVAL_S
        published = Published([], [])
        for seq, delta, recorded, record_bytes in sending:
            if seq.id in lost_ids:
                seq.cancel(LOST)
                self._forget(seq.id)
                published.lost.append(seq)
                continue
            if recorded:
                seq.recorded, self._record_bytes[seq.id] = recorded, record_bytes
            if delta is not None:
                seq.sent(delta)
            if seq.finished:
                self._forget(seq.id)
                published.finished.append(seq)
        return published

    def fail(self, job_ids: list[str], message: str, code: str = "worker_error") -> set[str]:
        """Answer the jobs with a Failure, and they are done; returns those that were lost (another
        worker holds them now: nothing was sent for them)."""
        failure = encode_result(Failure(message=message, code=code))
        entries = []
        for job_id in job_ids:
            entries += [job_id, "", failure, self._raw.get(job_id, b""), 0, ""]
        lost = {_text(i) for i in self._run_publish(entries)}
        for job_id in job_ids:
            self._forget(job_id)
        return lost

    def _record(self, seq: Sequence, whole_due: bool) -> tuple[int, str]:
        """Where the tokens `seq` wrote since its last record go in its record (a byte offset), and
        they ('' none now): a stream's at every step, so that its text is never ahead of them, also
        when that text is held back (half a character, maybe a stop string); a whole job's when
        `whole_due`. A finished job's answer deletes its record instead."""
        if seq.finished or not (seq.job.stream or whole_due) or len(seq.output_ids) == seq.recorded:
            return 0, ""
        at = self._record_bytes.get(seq.id)
        if at is None:  # its first record, or its first since it resumed from one
            at = len(_record_text(seq.output_ids[:seq.recorded]))
        return at, _record_text(seq.output_ids[seq.recorded:])

    def _run_publish(self, entries: list) -> list:
        """`entries`: six per job (_PUBLISH says which)."""
        if not entries:
            return []
        return self._publish_script(
            keys=[self._processing],
            args=[self.worker_id, keys.lease(self.model, ""), keys.channel(self.model, ""),
                  keys.answer(self.model, ""), self.answer_ttl_s, self._publish_command,
                  keys.written(self.model, ""), LEASE_TTL_S, keys.route_prefix(self.model), keys.ROUTE_TTL_S,
                  *entries])

    def _forget(self, job_id: str) -> None:
        self._raw.pop(job_id, None)
        self.written.pop(job_id, None)
        self._record_bytes.pop(job_id, None)
        self.isolated.discard(job_id)

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Jobs whose client went away."""
        if not job_ids:
            return set()
        flags = self.redis.mget([keys.cancel(self.model, j) for j in job_ids])  # one slot: the model's
        return {j for j, flag in zip(job_ids, flags) if flag is not None}

    # Liveness

    def sync_clock(self) -> float:
        """Measure Redis' clock against this host's (`self.clock`); returns Redis' time."""
        sent = time.monotonic()
        # The clock of the node that stamps this model's jobs (a cluster's nodes each have their own).
        seconds, microseconds = server_time(self.redis, self._wake)
        self.clock.sync(seconds + microseconds / 1e6, sent, time.monotonic())
        return self.clock.now()

    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> bool:
        """Announce this worker for another `ttl_s`. True if it had been struck off meanwhile: it was
        declared dead (cut off from Redis past its heartbeat's life), and the jobs it held went back
        to the queue; their leases tell which (`publish(..., check=True)`)."""
        # Where workers are found (any slot): before the registry below, so a worker that has one
        # entry has both. Should a worker declared dead come back between the requeuing script and
        # the requeuer's HDEL of this entry, it is missing from here until its next heartbeat.
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(keys.WORKERS, self.worker_id, self.model)
        pipe.zadd(keys.MODELS, {self.model: self.sync_clock()})
        pipe.execute()
        # One transaction, in the model's slot: `requeue_dead_workers` sees this worker either struck
        # off or alive again, never registered without a heartbeat.
        pipe = self.redis.pipeline(transaction=True)
        # Its fingerprint as the value: the requeue stamps it on the jobs of this worker, should it die.
        pipe.hset(keys.model_workers(self.model), self.worker_id, self.numerics)
        pipe.set(keys.heartbeat(self.model, self.worker_id), info.to_json(), px=int(ttl_s * 1000))
        pipe.exists(keys.tokenizer(self.model))
        if self.numerics and not info.draining:  # a worker of this fingerprint takes jobs
            pipe.set(keys.live_numerics(self.model, self.numerics), 1, px=int(ttl_s * 1000))
        added, _, tokenizer_stored = pipe.execute()[:3]
        if not tokenizer_stored and self._tokenizer_files:  # Redis restarted empty
            self.store_tokenizer(self._tokenizer_files)
        struck_off, self._registered = bool(added) and self._registered, True
        return struck_off

    def others_taking(self) -> bool:
        """Whether another worker of this model takes jobs: it has a live heartbeat that does not
        announce it is draining (as the API reads them: api/broker.py workers_for). A draining worker
        asks before it leaves queued jobs to others (worker.Worker._admit)."""
        others = [w for w in self.redis.hkeys(keys.model_workers(self.model)) if _text(w) != self.worker_id]
        if not others:
            return False
        # One MGET: the registry and the heartbeats are in the model's slot.
        for beat in self.redis.mget([keys.heartbeat(self.model, _text(w)) for w in others]):
            if beat is None:  # dead, or left: its entry stays until its processing list is empty
                continue
            try:
                if not WorkerInfo.from_json(beat).draining:
                    return True
            except (ValueError, TypeError):  # a heartbeat of another version: alive, taking jobs
                return True
        return False

    def store_tokenizer(self, files: dict[str, bytes]) -> None:
        self._tokenizer_files = files
        pipe = self.redis.pipeline(transaction=True)  # (a cluster's pipeline is not one by default)
        pipe.delete(keys.tokenizer(self.model))
        pipe.hset(keys.tokenizer(self.model), mapping=files)
        pipe.execute()

    def grammar(self, digest: str) -> Optional[str]:
        """A constraint's grammar, as the API stored it under its hash (keys.grammar), or None."""
        raw = self.redis.get(keys.grammar(self.model, digest))
        return None if raw is None else raw.decode()

    def count_start(self) -> None:
        """One more worker process started for this model (restarts show in /metrics)."""
        self.redis.hincrby(keys.WORKER_STARTS, self.model, 1)

    def leave(self) -> None:
        """A clean exit: nothing left in processing, so just disappear."""
        self.redis.delete(keys.heartbeat(self.model, self.worker_id))
        if not self.redis.llen(self._processing):
            self.redis.hdel(keys.model_workers(self.model), self.worker_id)
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
            if self.redis.exists(keys.heartbeat(model, worker_id)):  # the usual case, without a script
                continue
            requeued, failed = self._requeue_script(
                keys=[keys.processing(model, worker_id), keys.wake(model), keys.heartbeat(model, worker_id),
                      keys.model_workers(model)],
                args=[crashed, self.max_attempts, keys.attempts(model, ""), keys.answer(model, ""),
                      keys.channel(model, ""), self.answer_ttl_s, ATTEMPTS_TTL_S, keys.queue_prefix(model),
                      keys.lease(model, ""), worker_id, self._publish_command, keys.written(model, ""),
                      int(PREFER_SAME_NUMERICS_S * 1000), keys.written_by(model, "")])
            if requeued < 0:  # its heartbeat came back since
                continue
            self.redis.hdel(keys.WORKERS, worker_id)  # struck off in the model's slot: off the list too
            self.requeued[model] += requeued
            self.crashed[model] += failed
            if requeued or failed:
                log.warning("worker %s is gone: %d job(s) back in the queue, %d failed after %d "
                            "retries", worker_id, requeued, failed, self.max_attempts)
            total += requeued
        return total


def _record_text(tokens: list[int]) -> str:
    """Token ids as a record holds them (keys.written)."""
    return "".join(f"{t}," for t in tokens)


def _job_id(raw: bytes) -> str:
    return json.loads(raw)["id"]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
