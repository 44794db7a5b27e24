"""Run the whole service on this machine: Redis, the API and the workers, until Ctrl-C.

Redis: the one at REDIS_URL if it answers; otherwise a redis-server started here when one is
installed; otherwise an embedded stand-in (fakeredis' TCP server) inside this process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from urllib.parse import urlparse

import redis

from shared.settings import Settings

READY_TIMEOUT_S = 300


def ensure_redis(url: str) -> tuple[str, list[subprocess.Popen]]:
    """Make sure something answers at `url`; say what it is, and return any process started."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return f"Redis already running at {url}", []
    except redis.RedisError:
        pass
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    binary = shutil.which("redis-server")
    if binary:
        # Its own session: Ctrl-C in the terminal must not stop Redis before the workers are done.
        process = subprocess.Popen([binary, "--bind", host, "--port", str(port), "--save", "",
                                    "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                   start_new_session=True)
        wait_for_redis(url)
        return f"started redis-server at {url}", [process]
    from fakeredis import TcpFakeServer  # a stand-in: fine for trying things out, not for production

    server = TcpFakeServer((host, port), server_type="redis")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    wait_for_redis(url)
    return f"no redis-server installed: embedded stand-in (fakeredis) at {url}", []


def free_port() -> int:
    """A TCP port nobody listens on now, for a private Redis or API."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_redis(url: str) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    for _ in range(100):
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.1)
    raise SystemExit(f"Redis did not come up at {url}")


def wait_until_served(base_url: str, processes: list[subprocess.Popen]) -> list[str]:
    """The models listed by the API, once at least one worker has announced itself."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise SystemExit("a process of the service exited during start-up: see its output above")
        try:
            with urllib.request.urlopen(f"{base_url}/models", timeout=2) as response:
                models = [m["id"] for m in json.load(response)["data"]]
            if models:
                return models
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no worker announced itself within {READY_TIMEOUT_S} s")


def main() -> None:
    parser = argparse.ArgumentParser(description="Run Storyteller locally: Redis, API and workers.")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", 1)),
                        help="model workers to start (env WORKERS, default 1)")
    settings = Settings.from_env()  # passed on to the children through their environment
    for flag, env in [("--port", "PORT"), ("--model", "MODEL"), ("--batch", "BATCH"), ("--engine", "ENGINE"),
                      ("--redis-url", "REDIS_URL"), ("--host", "HOST")]:
        parser.add_argument(flag, dest=env, help=f"env {env}")
    args = parser.parse_args()
    env = dict(os.environ)
    env.update({k: str(v) for k, v in vars(args).items() if v is not None and k.isupper()})
    redis_url = env.get("REDIS_URL", settings.redis_url)
    env["REDIS_URL"] = redis_url
    if args.workers > 1 and not env.get("TORCH_THREADS"):
        # Workers on one machine share its cores: torch's threads wait on each other when two
        # processes each want all of them (steps measured many times slower here).
        env["TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))

    redis_note, processes = ensure_redis(redis_url)
    print(redis_note, flush=True)
    python = sys.executable
    processes.append(subprocess.Popen([python, "-m", "api"], env=env))
    processes += [subprocess.Popen([python, "-m", "worker"], env=env) for _ in range(args.workers)]

    def shut_down(*_):
        # In reverse order of start: workers finish what they hold, then the API, then Redis.
        for p in reversed(processes):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    host = env.get("HOST", settings.host)
    base_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{env.get('PORT', settings.port)}/v1"
    models = wait_until_served(base_url, processes)
    print(f"\nStoryteller is ready at {base_url} serving {', '.join(models)} with {args.workers} "
          f"worker(s). Try:\n  curl {base_url}/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{models[0]}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 40}}'\n"
          f"Ctrl-C stops everything.", flush=True)
    while all(p.poll() is None for p in processes):
        time.sleep(1)
    print("a process of the service exited: stopping the rest", flush=True)
    shut_down()


if __name__ == "__main__":
    main()
