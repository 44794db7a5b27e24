"""A private Storyteller for a benchmark: a redis-server, the API and N model workers.

Every bench that needs a service starts it here, so that ports, logs, start-up checks and the
order of stopping are the same for all of them. Each stack has its own free ports, so two
configurations never share a queue or a warm cache, and the workers' settings are nothing but
environment variables: the same settings `serve.sh` and `python -m worker` read.

`stack()` is the common case (start, yield, stop). The soak holds a `Stack` itself, because it
kills and replaces workers and restarts Redis while players play; for that Redis may keep its
data (`data_dir`: append-only, fsync on every write), so a restart keeps the queue.

tests/processes.py starts the test suite's stacks; it is not reused here because it fails a
test (pytest.fail) where a bench must go on to its next configuration, and it strips the
Storyteller settings from the environment where a bench passes them on by design.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import redis

from serve import free_port, wait_for_redis, wait_until_served
from shared import keys
from shared.lifetime import dies_with_parent

LOG_TAIL_LINES = 30
STOP_TIMEOUT_S = 60
START_TIMEOUT_S = 300
POLL_S = 0.2


class StackError(RuntimeError):
    """The stack did not come up (a process exited, or no worker announced itself)."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def redis_server(port: int, log, data_dir: Optional[Path] = None) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:`port`, its output to `log` (a file or subprocess.DEVNULL).
    Without `data_dir` it keeps nothing; with one it keeps every write there (append-only,
    fsync always), so that a restart on the same port and directory finds the queue again."""
    binary = shutil.which("redis-server") or sys.exit("redis-server is needed")
    keep = (["--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", "always"] if data_dir
            else ["--appendonly", "no"])
    return subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *keep],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_dies_with_bench())


def _dies_with_bench():
    """A process started from the bench's main thread dies with the bench, also when the bench is
    killed (SIGTERM, SIGKILL, a `timeout`) and no `finally` runs: no stack is left holding the
    cores for the next measurement. Linux signals the child when the thread that forked it ends,
    so one started from another thread (the soak's faults) is left to close()."""
    return dies_with_parent() if threading.current_thread() is threading.main_thread() else None


def stop(process: Optional[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> Optional[int]:
    """SIGTERM (if still running), then SIGKILL past `timeout`; the exit status."""
    if process is None:
        return None
    if process.poll() is None:
        process.terminate()
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


class Stack:
    """A redis-server, the API and `workers` workers of `model`, with `env` added to this
    process's environment.

    With `pin`, worker i runs under `taskset -c pin[i % len(pin)]`, and `worker_env[i]` adds to
    its own environment (a metrics port). Logs go to <logs>/<label>-{redis,api,worker}.log
    (worker2, worker3... for more, and for each worker started in another's place).
    `env` may name CHECKOUT, another checkout of this project (`git worktree add /tmp/before
    REV`) whose workers run instead of this one's: today's main against a change, in one run.
    """

    def __init__(self, env: dict, model: str = "smollm2", logs: Path = Path("bench/results/logs"),
                 label: str = "stack", workers: int = 1, pin: Sequence[str] = (),
                 worker_env: Sequence[dict] = (), data_dir: Optional[Path] = None):
        self.label, self.log_dir, self.data_dir = label, Path(logs), data_dir
        self.count, self.pin, self.worker_env = workers, list(pin), list(worker_env)
        self.redis_port, self.api_port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.url = f"http://127.0.0.1:{self.api_port}/v1"  # the API's base URL
        # One at a time, the last of 64 players x 4 requests waits ~20 minutes: the default
        # request timeout (5 minutes) would turn that wait into errors, and throughput is what
        # is measured. A bench that wants the timeout (the soak) sets REQUEST_TIMEOUT itself.
        self.env = dict(os.environ, REQUEST_TIMEOUT="3600", MODEL=model)
        self.env.update({k: str(v) for k, v in env.items()})
        self.env.update(REDIS_URL=self.redis_url, PORT=str(self.api_port))  # always its own
        self.checkout = env.get("CHECKOUT")
        self.redis: Optional[subprocess.Popen] = None
        self.api: Optional[subprocess.Popen] = None
        self.worker_processes: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}  # process name -> its log file
        self.model = ""  # the name the workers serve, once they do
        self._names: dict[int, str] = {}  # pid -> process name
        self._started = 0

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """Name -> process of what runs now: redis, api, worker, worker2..."""
        running = {"redis": self.redis, "api": self.api}
        running.update({self._names[p.pid]: p for p in self.worker_processes})
        return {name: p for name, p in running.items() if p is not None}

    def start(self) -> None:
        """Start everything and wait until every worker announces itself; StackError if not."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        self.api = self._spawn([sys.executable, "-m", "api"], "api")
        for _ in range(self.count):
            self.worker_processes.append(self.start_worker())
        try:
            self.model = wait_until_served(self.url, list(self.processes.values()))[0]
        except SystemExit as exc:  # serve.py's way of saying it; here one config may fail alone
            raise StackError(f"{self.label}: {exc}\n--- worker log ---\n{log_tail(self.logs['worker'])}"
                             f"\n--- api log ---\n{log_tail(self.logs['api'], 10)}") from None
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.workers()) < self.count:  # the first one announcing itself is not all
            exited = [name for name, p in self.processes.items() if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{exited[0]} exited" if exited else \
                    f"not {self.count} workers within {START_TIMEOUT_S:g} s"
                name = exited[0] if exited else "worker"
                raise StackError(f"{self.label}: {why}\n--- {name} log ---\n{log_tail(self.logs[name])}")
            time.sleep(0.5)

    def start_redis(self) -> None:
        with self._log("redis") as log:
            self.redis = redis_server(self.redis_port, log, self.data_dir)
        try:
            wait_for_redis(self.redis_url)
        except SystemExit as exc:
            raise StackError(f"{self.label}: {exc}\n{log_tail(self.logs['redis'])}") from None

    def stop_redis(self) -> None:
        stop(self.redis)

    def start_worker(self) -> subprocess.Popen:
        """One more worker (the caller keeps it, in worker_processes or in place of another)."""
        i, self._started = self._started, self._started + 1
        name = "worker" if i == 0 else f"worker{i + 1}"
        taskset = ["taskset", "-c", self.pin[i % len(self.pin)]] if self.pin else []
        own = self.worker_env[i] if i < len(self.worker_env) else {}
        process = self._spawn([*taskset, sys.executable, "-m", "worker"], name,
                              {**self.env, **{k: str(v) for k, v in own.items()}}, self.checkout)
        self._names[process.pid] = name
        return process

    def _log(self, name: str):
        """The log file of process `name`, opened for the child (which keeps its own copy of the
        fd); a restarted Redis adds to its log."""
        path = self.log_dir / f"{safe_name(self.label)}-{name}.log"
        again = name in self.logs
        self.logs[name] = path
        return open(path, "ab" if again else "wb")

    def _spawn(self, command: list[str], name: str, env: Optional[dict] = None, cwd=None) -> subprocess.Popen:
        with self._log(name) as log:
            return subprocess.Popen(command, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                    preexec_fn=_dies_with_bench())

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_connect_timeout=2, socket_timeout=5)

    def _heartbeats(self) -> dict[str, bytes]:
        """Worker id -> its heartbeat, for each registered worker whose heartbeat is alive."""
        client = self.client()
        registered = {i.decode(): m.decode() for i, m in client.hgetall(keys.WORKERS).items()}
        ids = list(registered)
        beats = client.mget([keys.heartbeat(registered[i], i) for i in ids]) if ids else []
        return {i: b for i, b in zip(ids, beats) if b is not None}

    def workers(self) -> list[dict]:
        """What the live workers announce in their heartbeats (engine, batch, dtype...), read
        straight from Redis so a benchmark records which engine really ran."""
        return [json.loads(beat) for beat in self._heartbeats().values()]

    def live_workers(self) -> list[dict]:
        """(id, pid) of the workers with a live heartbeat; [] while Redis is away."""
        try:
            ids = list(self._heartbeats())
        except redis.RedisError:
            return []
        return [{"id": i, "pid": int(i.split("-")[-2])} for i in ids]

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
        """The workers first, all at once (each finishes what it holds), then the API, then
        Redis. A second Ctrl-C (or one forwarded by `timeout`) must not cut this short and
        leave workers behind, so SIGINT waits until it is done."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for worker in self.worker_processes:
                if worker.poll() is None:
                    worker.terminate()
            for process in [*self.worker_processes, self.api, self.redis]:
                stop(process)
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGINT, previous)


@contextmanager
def stack(env: dict, model: str = "smollm2", logs: Path = Path("bench/results/logs"),
          label: str = "stack", workers: int = 1, pin: Sequence[str] = (),
          worker_env: Sequence[dict] = ()):
    """A started Stack (see it for the arguments), stopped on the way out; StackError if it
    does not come up."""
    running = Stack(env, model, logs, label, workers, pin, worker_env)
    try:
        running.start()
        yield running
    finally:
        running.close()
