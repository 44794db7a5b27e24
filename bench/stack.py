"""A private Storyteller for one benchmark configuration: a redis-server, the API and one worker.

Each configuration gets its own stack, on free ports, so configurations never share a queue or a
warm cache, and the worker's settings are nothing but environment variables: the same settings
`serve.sh` and `python -m worker` read.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import redis

from serve import free_port, wait_until_served
from shared import keys

LOG_TAIL_LINES = 30


class StackError(RuntimeError):
    """The stack did not come up (a process exited, or no worker announced itself)."""


@dataclass
class Running:
    url: str  # the API's base URL, .../v1
    model: str  # the model name the worker serves
    redis_url: str
    logs: dict[str, Path]  # process name -> its log file
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> process (its pid)

    def workers(self) -> list[dict]:
        """What the live workers announce in their heartbeats (engine, batch, dtype...), read
        straight from Redis so a benchmark records which engine really ran."""
        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2)
        registered = client.hgetall(keys.WORKERS)  # worker id -> its model
        beats = client.mget([keys.heartbeat(m.decode(), i.decode()) for i, m in registered.items()]) \
            if registered else []
        return [json.loads(b) for b in beats if b is not None]


def _wait_for_workers(running: Running, count: int, label: str, timeout_s: float = 300) -> None:
    """Until `count` workers heartbeat: the first one announcing itself is not all of them."""
    deadline = time.monotonic() + timeout_s
    while len(running.workers()) < count:
        exited = [name for name, p in running.processes.items() if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            why = f"{exited[0]} exited" if exited else f"not {count} workers within {timeout_s:g} s"
            name = exited[0] if exited else "worker"
            raise StackError(f"{label}: {why}\n--- {name} log ---\n{log_tail(running.logs[name])}")
        time.sleep(0.5)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


@contextmanager
def stack(env: dict[str, str], model: str = "smollm2", logs: Path = Path("bench/results/logs"),
          label: str = "stack", workers: int = 1, pin: Sequence[str] = (),
          worker_env: Sequence[dict] = ()):
    """Start the stack with `env` added to this process's environment; yield a Running.

    `workers` model workers (all serving `model`); with `pin`, worker i runs under
    `taskset -c pin[i % len(pin)]`, and `worker_env[i]` adds to its own environment (a metrics port).
    Logs go to <logs>/<label>-{redis,api,worker}.log (worker2, worker3... for more). Raises
    StackError if it does not come up, or if not every worker announces itself.
    `env` may name CHECKOUT, another checkout of this project (`git worktree add /tmp/before
    REV`) whose workers run instead of this one's: today's main against a change, in one run.
    """
    redis_port, api_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    # One at a time, the last of 64 players x 4 requests waits ~20 minutes: the default request
    # timeout (5 minutes) would turn that wait into errors, and throughput is what is measured.
    full_env = dict(os.environ, REQUEST_TIMEOUT="3600", MODEL=model)
    full_env.update({k: str(v) for k, v in env.items()})
    full_env.update(REDIS_URL=redis_url, PORT=str(api_port))  # always this stack's own
    logs.mkdir(parents=True, exist_ok=True)
    redis_server = shutil.which("redis-server") or sys.exit("redis-server is needed")
    commands = {"redis": [redis_server, "--port", str(redis_port), "--save", "",
                          "--appendonly", "no"],
                "api": [sys.executable, "-m", "api"]}
    envs, checkout = {}, env.get("CHECKOUT")
    for i in range(workers):
        name = "worker" if i == 0 else f"worker{i + 1}"
        taskset = ["taskset", "-c", pin[i % len(pin)]] if pin else []
        commands[name] = [*taskset, sys.executable, "-m", "worker"]
        envs[name] = {**full_env, **{k: str(v) for k, v in (worker_env[i] if i < len(worker_env) else {}).items()}}
    log_paths = {name: logs / f"{safe_name(label)}-{name}.log" for name in commands}
    processes = {}
    try:
        for name, command in commands.items():
            with open(log_paths[name], "w") as log:  # the child keeps its own copy of the fd
                processes[name] = subprocess.Popen(command, env=envs.get(name, full_env), stdout=log,
                                                   stderr=subprocess.STDOUT,
                                                   cwd=checkout if name.startswith("worker") else None)
            time.sleep(0.3)
        url = f"http://127.0.0.1:{api_port}/v1"
        try:
            served = wait_until_served(url, list(processes.values()))
        except SystemExit as exc:  # serve.py's way of saying it; here one config may fail alone
            raise StackError(f"{label}: {exc}\n--- worker log ---\n{log_tail(log_paths['worker'])}"
                             f"\n--- api log ---\n{log_tail(log_paths['api'], 10)}") from None
        running = Running(url, served[0], redis_url, log_paths, processes)
        _wait_for_workers(running, workers, label)
        yield running
    finally:
        for process in reversed(list(processes.values())):  # the workers first, Redis last
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
