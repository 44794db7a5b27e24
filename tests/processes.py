"""Starting and stopping real processes in tests: a private redis-server, the service's own
(`python -m api`, `python -m worker`), and waiting on them.

Every test against real processes builds its stack from these pieces, so that a port, a log or a
stop works the same in all of them, and looks at its workers the same way (which are live, what
each holds, one paused while it still looks alive). `free_port` comes from here too: serve.py,
which owns it, may move it without touching every test.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

import openai
import pytest
import redis

from serve import free_port, wait_for_redis
from shared import keys
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"  # what a tiny_worker of the tiny Llama serves: a worker names it after its directory


class RedisServer:
    """A private redis-server on a free port, which a test may stop and start again.

    `url` and `extra_args` (appended, so they win) make another kind: one with a password
    (`--requirepass`), or TLS on the URL's port (`--port 0 --tls-port ...`). Its output: `log`.
    """

    def __init__(self, directory: str, url: Optional[str] = None, extra_args: Sequence[str] = ()):
        self.url = url or f"redis://127.0.0.1:{free_port()}/0"
        self.port = urlparse(self.url).port
        self.directory = directory
        self.extra_args = list(extra_args)
        self.log = Path(directory) / "redis-server.log"
        self.process = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (the test command installs it: see .ci/run)")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self.directory, *self.extra_args], stdout=log, stderr=subprocess.STDOUT)
        wait_for_redis(self.url)

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def _env(**extra) -> dict:
    """The environment without any Storyteller setting (a stray PORT or MODEL must not leak in).
    `extra` adds to it; a name given None is left out (OMP_NUM_THREADS=None: torch's own thread
    count, one per core, instead of the one thread set here)."""
    env = dict(os.environ)
    for f in fields(Settings):
        env.pop(f.metadata.get("env") or f.name.upper(), None)
    # One torch thread: the machine has 2 cores and the tiny model gains nothing from more.
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(extra)
    return {name: value for name, value in env.items() if value is not None}


def start(args: list[str], log_dir: Path, name: str, **env) -> subprocess.Popen:
    """`python -m ...` from the repository root, its stdout and stderr in log_dir/name.{out,err};
    `env` as _env takes it (None: that variable unset)."""
    out, err = open(log_dir / f"{name}.out", "wb"), open(log_dir / f"{name}.err", "wb")
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=_env(**env), stdout=out, stderr=err)
    proc.log_files = (log_dir / f"{name}.out", log_dir / f"{name}.err")
    out.close(), err.close()
    return proc


def default_worker(redis_url: str, log_dir: Path, name: str, *flags: str, **env) -> subprocess.Popen:
    """The worker a new user gets: no --model, no --dtype (the packaged SmolLM2 GGUF, the default
    dtype and kernels); `flags` only for what does not touch its numbers (a metrics port)."""
    return start(["worker", *flags], log_dir, name, REDIS_URL=redis_url, **env)


def tiny_worker(model_dir: str, server: RedisServer, log_dir: Path, name: str, *flags: str, **env
                ) -> subprocess.Popen:
    """A worker on one of the tiny models (tests/tiny_models.py), in float32, that waits up to
    5 ms for a batch to fill; `flags` add to its command line."""
    return start(["worker", "--model", model_dir, "--dtype", "float32", "--wait", "5", *flags], log_dir, name,
                 REDIS_URL=server.url, **env)


def start_api(server: RedisServer, log_dir: Path, name: str, *flags: str, **env) -> tuple[int, subprocess.Popen]:
    """The API on a free port, on the server's Redis: (its port, its process)."""
    port = free_port()
    return port, start(["api", "--port", str(port), "--redis-url", server.url, *flags], log_dir, name, **env)


def stop(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def logs(*procs: subprocess.Popen) -> str:
    parts = []
    for proc in procs:
        for path in proc.log_files:
            text = path.read_text(errors="replace")[-3000:]
            parts.append(f"----- {path.name} (exit {proc.poll()}) -----\n{text}")
    return "\n".join(parts)


def get_json(url: str, timeout: float = 5) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def wait_until(ready, procs, what: str, timeout: float = 90) -> None:
    """Poll ready() until true; fail with every process's log if it takes too long or one dies."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a process exited while waiting for {what}\n{logs(*procs)}")
        try:
            if ready():
                return
        except (OSError, ValueError):  # not listening yet, or not answering JSON yet
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}\n{logs(*procs)}")


def wait_for_servers(ready, what: str, log_files: list[Path], timeout: float = 30) -> None:
    """Poll ready() (Redis errors count as not yet) until true; fail with the tail of each server's log."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            if ready():
                return
        except redis.RedisError:
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n" + "\n".join(
        f"----- {log.name} -----\n{log.read_text(errors='replace')[-2000:]}" for log in log_files))


def models_served(port: int) -> set[str]:
    return {m["id"] for m in get_json(f"http://127.0.0.1:{port}/v1/models")[1]["data"]}


def make_client(port: int, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=60)


def live_worker_ids(client, model: str = MODEL) -> list[str]:
    """Ids of the registered workers of `model` whose heartbeat is alive."""
    ids = [i.decode() for i in client.hkeys(keys.WORKERS)]
    beats = client.mget([keys.heartbeat(model, i) for i in ids]) if ids else []
    return [i for i, beat in zip(ids, beats) if beat is not None]


class Paused:
    """A worker stopped with SIGSTOP whose heartbeat the test keeps alive: to the API it is a live
    worker that takes nothing, so the queue fills as it would behind a worker that is busy."""

    def __init__(self, proc, client):
        self.proc, self.client = proc, client
        (self.worker_id,) = live_worker_ids(client)
        self.beat = client.get(keys.heartbeat(MODEL, self.worker_id))
        self.done = threading.Event()
        proc.send_signal(signal.SIGSTOP)
        self.thread = threading.Thread(target=self._keep_alive, daemon=True)
        self.thread.start()

    def _keep_alive(self) -> None:
        while not self.done.wait(0.3):
            self.client.set(keys.heartbeat(MODEL, self.worker_id), self.beat, px=3000)

    def resume(self) -> None:
        self.done.set()
        self.thread.join()
        self.proc.send_signal(signal.SIGCONT)


def holding(client, model: str) -> dict[int, int]:
    """pid -> how many jobs each live worker of `model` holds."""
    held = {}
    for worker_id in [i.decode() for i in client.hkeys(keys.WORKERS)]:
        beat = client.get(keys.heartbeat(model, worker_id))
        if beat:
            held[json.loads(beat)["pid"]] = client.llen(keys.processing(model, worker_id))
    return held
