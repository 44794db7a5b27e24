"""The faults the soak does to its stack on a schedule.

The stack (bench.stack.Stack) is the service as `docker compose` runs it, on this machine: a
redis-server that keeps its data (append-only file, fsync on every write, in its own directory,
so a restart keeps the queue), the API, and N model workers. Faults:

  kill   a worker SIGKILLed (no goodbye: its jobs wait in its processing list until another
         worker sees its heartbeat expire) and a new one started in its place
  term   a worker SIGTERMed (it finishes what it holds and signs off) and a new one started,
         as `docker compose up` would after a deploy
  redis  Redis stopped and started again on the same port and directory
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import redis

from bench.stack import STOP_TIMEOUT_S, Stack


@dataclass
class Fault:
    at: float  # planned, in seconds since the players started
    kind: str  # kill | term | redis
    started: Optional[float] = None  # when it was done (same clock)
    ended: Optional[float] = None
    detail: str = ""
    recovered_s: Optional[float] = None  # until the new worker announced itself (kill, term)
    new_pid: Optional[int] = None

    def label(self) -> str:
        return {"kill": "worker SIGKILL + restart", "term": "worker SIGTERM + new one",
                "redis": "Redis restart"}[self.kind]

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label()}


def plan(duration: float, every: float, settle: float = 20) -> list[Fault]:
    """A kill every `every` seconds; the SIGTERM half-way through the first interval, the Redis
    restart half-way through the interval nearest the middle. None later than `settle` seconds
    before the end, so the last one's aftermath is measured too."""
    last = duration - settle
    faults = [Fault(at=k * every, kind="kill") for k in range(1, int(last // every) + 1)]
    halves = [(k + 0.5) * every for k in range(1, int(last // every) + 1) if (k + 0.5) * every <= last]
    if len(halves) < 2:
        raise SystemExit(f"--duration {duration:g} is too short for --fault-every {every:g}: the "
                         f"SIGTERM and the Redis restart need two half-way points, each at least "
                         f"{settle:g} s before the end (try --duration {2.5 * every + settle:g})")
    term = halves[0]
    middle = min(halves[1:], key=lambda t: abs(t - duration / 2))
    faults += [Fault(at=term, kind="term"), Fault(at=middle, kind="redis")]
    return sorted(faults, key=lambda f: f.at)


class FaultRunner(threading.Thread):
    """Does each planned fault at its time (`clock()`: seconds since the players started)."""

    def __init__(self, stack: Stack, faults: list[Fault], clock: Callable[[], float],
                 redis_down_s: float, log: Callable[[str], None] = print):
        super().__init__(name="faults", daemon=True)
        self.stack, self.faults, self.clock = stack, faults, clock
        self.redis_down_s = redis_down_s
        self.log = log
        self.errors: list[str] = []
        self._kills = 0
        self._drains: list[threading.Thread] = []

    def run(self) -> None:
        for index, fault in enumerate(self.faults):
            time.sleep(max(0.0, fault.at - self.clock()))
            fault.started = self.clock()
            try:
                getattr(self, f"_{fault.kind}")(fault)
            except Exception as exc:  # recorded: one fault going wrong must not end the soak unseen
                fault.detail += f" FAILED: {type(exc).__name__}: {exc}"
                self.errors.append(f"{fault.label()} at {fault.at:g} s: {exc}")
            fault.ended = self.clock()
            self.log(f"[{fault.started:6.1f} s] {fault.label()}: {fault.detail}")
            if fault.kind in ("kill", "term"):
                upcoming = self.faults[index + 1].at if index + 1 < len(self.faults) else fault.at + 60
                fault.recovered_s = self._recovery(fault, upcoming)
        for drain in self._drains:
            drain.join()

    def _recovery(self, fault: Fault, give_up_at: float) -> Optional[float]:
        """Seconds from the fault until its new worker is serving."""
        waited = self.stack.wait_for_workers(self.stack.count, max(0.0, give_up_at - self.clock()),
                                             fault.new_pid)
        return None if waited is None else round(self.clock() - fault.started, 2)

    def _kill(self, fault: Fault) -> None:
        index = self._kills % len(self.stack.worker_processes)  # each worker in turn
        self._kills += 1
        victim = self.stack.worker_processes[index]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        self.stack.worker_processes[index] = self.stack.start_worker()
        fault.new_pid = self.stack.worker_processes[index].pid
        fault.detail = f"worker pid {victim.pid} killed, pid {fault.new_pid} started"

    def _term(self, fault: Fault) -> None:
        index = len(self.stack.worker_processes) - 1
        old = self.stack.worker_processes[index]
        old.terminate()
        self.stack.worker_processes[index] = self.stack.start_worker()  # the replacement does not wait
        fault.new_pid = self.stack.worker_processes[index].pid
        fault.detail = f"worker pid {old.pid} sent SIGTERM, pid {fault.new_pid} started"

        def drained():
            began = time.monotonic()
            try:
                code = old.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                fault.detail += f"; still running after {STOP_TIMEOUT_S} s: killed"
                old.kill()
                return
            try:
                left = "still registered" if self.stack.registered(old.pid) else "signed off"
            except redis.RedisError:  # the Redis restart may fall here
                left = "registration unknown (Redis away)"
            fault.detail += f"; exited {code} after {time.monotonic() - began:.1f} s, {left}"

        self._drains.append(threading.Thread(target=drained, daemon=True))
        self._drains[-1].start()

    def _redis(self, fault: Fault) -> None:
        # Jobs queued or held by workers: the append-only file must bring them back (the workers
        # may take or finish some in the moment before they are counted again).
        before = self.stack.queued() + self.stack.processing()
        self.stack.stop_redis()
        time.sleep(self.redis_down_s)
        self.stack.start_redis()
        after = self.stack.queued() + self.stack.processing()
        fault.detail = f"down {self.clock() - fault.started:.1f} s; jobs queued or held: {before} " \
                       f"before, {after} right after"
