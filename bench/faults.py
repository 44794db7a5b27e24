"""The soak's stack and the faults done to it on a schedule.

The stack is the service as `docker compose` runs it, on this machine: a redis-server that keeps
its data (append-only file, fsync on every write, in its own directory, so a restart keeps the
queue), the API, and N model workers. Faults:

  kill   a worker SIGKILLed (no goodbye: its jobs wait in its processing list until another
         worker sees its heartbeat expire) and a new one started in its place
  term   a worker SIGTERMed (it finishes what it holds and signs off) and a new one started,
         as `docker compose up` would after a deploy
  redis  Redis stopped and started again on the same port and directory
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import redis

from serve import free_port, wait_for_redis, wait_until_served
from shared import keys

STOP_TIMEOUT_S = 60
POLL_S = 0.2


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


class SoakStack:
    """A private redis-server (persistent), the API and `workers` workers, on free ports."""

    def __init__(self, model: str, workers: int, env: dict[str, str], data_dir: Path, log_dir: Path):
        self.model_source = model
        self.count = workers
        self.data_dir, self.log_dir = data_dir, log_dir
        self.redis_port, self.api_port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.url = f"http://127.0.0.1:{self.api_port}/v1"
        self.env = dict(os.environ, MODEL=model, **env)
        self.env.update(REDIS_URL=self.redis_url, PORT=str(self.api_port))
        self.redis: Optional[subprocess.Popen] = None
        self.api: Optional[subprocess.Popen] = None
        self.workers: list[subprocess.Popen] = []
        self.model = ""  # the name the workers serve, once they do
        self._started = 0

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        self.api = self._spawn([sys.executable, "-m", "api"], "api")
        self.workers = [self.start_worker() for _ in range(self.count)]
        self.model = wait_until_served(self.url, [self.redis, self.api, *self.workers])[0]
        self.wait_for_workers(self.count, 300)

    def start_redis(self) -> None:
        binary = shutil.which("redis-server") or sys.exit("the soak needs redis-server")
        self.redis = self._spawn([binary, "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                  "--dir", str(self.data_dir), "--appendonly", "yes",
                                  "--appendfsync", "always", "--save", ""], "redis")
        wait_for_redis(self.redis_url)

    def stop_redis(self) -> None:
        _stop(self.redis)

    def start_worker(self) -> subprocess.Popen:
        self._started += 1
        return self._spawn([sys.executable, "-m", "worker"], f"worker-{self._started}")

    def _spawn(self, command: list[str], name: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_connect_timeout=2, socket_timeout=5)

    def live_workers(self) -> list[dict]:
        """(id, pid) of the workers with a live heartbeat; [] while Redis is away."""
        try:
            client = self.client()
            registered = {i.decode(): m.decode() for i, m in client.hgetall(keys.WORKERS).items()}
            ids = list(registered)
            beats = client.mget([keys.heartbeat(registered[i], i) for i in ids]) if ids else []
        except redis.RedisError:
            return []
        return [{"id": i, "pid": int(i.split("-")[-2])} for i, b in zip(ids, beats) if b is not None]

    def wait_for_workers(self, count: int, timeout: float, pid: Optional[int] = None) -> Optional[float]:
        """Seconds until `count` workers are alive (the one of `pid` among them), or None if not
        within `timeout`. A killed worker's heartbeat outlives it by seconds: count alone would
        call the service whole again before its replacement has even loaded the model."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            live = self.live_workers()
            if len(live) >= count and (pid is None or any(w["pid"] == pid for w in live)):
                return time.monotonic() - began
            time.sleep(POLL_S)
        return None

    def registered(self, pid: int) -> bool:
        """Whether a worker of this pid is still in the registry or still has a heartbeat."""
        client = self.client()
        ids = [i.decode() for i in client.hkeys(keys.WORKERS)]
        return any(f"-{pid}-" in i for i in ids) or bool(client.keys(keys.heartbeat("*", f"*-{pid}-*")))

    def queued(self) -> int:
        client = self.client()
        return sum(client.llen(q) for q in keys.queues(self.model))

    def processing(self) -> int:
        client = self.client()
        return sum(client.llen(k) for k in client.keys(keys.processing(self.model, "*")))

    def close(self) -> None:
        # A second Ctrl-C (or one forwarded by `timeout`) must not cut the clean-up short and
        # leave workers behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for worker in self.workers:  # all at once: each finishes what it holds
            if worker.poll() is None:
                worker.terminate()
        for process in [*self.workers, self.api, self.redis]:
            _stop(process)


def _stop(process: Optional[subprocess.Popen]) -> Optional[int]:
    if process is None:
        return None
    if process.poll() is None:
        process.terminate()
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


class FaultRunner(threading.Thread):
    """Does each planned fault at its time (`clock()`: seconds since the players started)."""

    def __init__(self, stack: SoakStack, faults: list[Fault], clock: Callable[[], float],
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
        index = self._kills % len(self.stack.workers)  # each worker in turn
        self._kills += 1
        victim = self.stack.workers[index]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        self.stack.workers[index] = self.stack.start_worker()
        fault.new_pid = self.stack.workers[index].pid
        fault.detail = f"worker pid {victim.pid} killed, pid {fault.new_pid} started"

    def _term(self, fault: Fault) -> None:
        index = len(self.stack.workers) - 1
        old = self.stack.workers[index]
        old.terminate()
        self.stack.workers[index] = self.stack.start_worker()  # the replacement does not wait
        fault.new_pid = self.stack.workers[index].pid
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
