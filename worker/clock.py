"""The worker's clocks. Workers run on many machines whose clocks need not agree with each other or
with the API's, so nothing a worker decides compares its own wall clock with another host's: a
job's age is measured in Redis' clock (TIME), the one clock every host reads alike, estimated
locally from this host's monotonic clock and an offset measured once per heartbeat.
"""
from __future__ import annotations

import time
from typing import Optional

def wall(skew_s: float = 0.0) -> float:
    """This host's wall clock: only for what is shown to people (when the worker started). `skew_s`:
    the tests' fault (worker/faults.py), as if the host's clock were that far off."""
    return time.time() + skew_s


class RedisClock:
    """Redis' time, read without a round trip: Redis' clock minus this host's monotonic clock,
    measured by `sync` (within half a round trip), added to the monotonic clock."""

    def __init__(self):
        self._offset: Optional[float] = None

    @property
    def synced(self) -> bool:
        return self._offset is not None

    def sync(self, redis_time: float, sent: float, received: float) -> None:
        """`redis_time`: Redis' TIME, read between `sent` and `received` (time.monotonic())."""
        # Redis read its clock somewhere in the round trip: its middle is off by half of it at most.
        self._offset = redis_time - (sent + received) / 2

    def now(self) -> float:
        if self._offset is None:
            raise RuntimeError("Redis' clock is not known yet: sync it first")
        return time.monotonic() + self._offset


def expired(enqueued_at: float, timeout_s: float, now: float) -> bool:
    """Whether a job queued at `enqueued_at` with `timeout_s` to live is dead at `now` (all in
    Redis' clock). A job never stamped (0) has no known age: the API's cancel flag ends it."""
    return enqueued_at > 0 and now > enqueued_at + timeout_s


def queue_wait(enqueued_at: float, now: float) -> Optional[float]:
    """Seconds from its queueing to `now` (Redis' clock), or None for a job never stamped. Never
    below 0: Redis' clock may step back (NTP) between the two readings."""
    if enqueued_at <= 0:
        return None
    return max(0.0, now - enqueued_at)
