"""python -m worker.health: exit 0 when a worker in this container is serving, 1 and the reason if not.

Docker's HEALTHCHECK runs it (Dockerfile.worker) beside the worker, so both see the same hostname.
Serving means:
  - a worker on this host has a live heartbeat in Redis: it has loaded its model and its loop runs
    (a dead worker's heartbeat expires within HEARTBEAT_TTL_S, and one that stops cleanly deletes it);
  - it is not draining (after SIGTERM it finishes what it holds but takes no new jobs);
  - when a metrics port is set (METRICS_PORT, as in the image), its /metrics answers, since that is
    how Prometheus sees the worker.
It imports neither torch nor the model, so it takes milliseconds.
"""
from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from typing import Optional

import redis

from shared import keys
from shared.protocol import WorkerInfo
from shared.redis_client import connect, explain, get_many, masked
from shared.settings import Settings

TIMEOUT_S = 3.0


def problem(settings: Settings, host: str) -> Optional[str]:
    """Why no worker on `host` is serving, or None when one is."""
    client = None
    try:
        # (A cluster's client reads the cluster's layout as it is made: that may fail too.)
        client = connect(settings.redis_url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
        # Worker ids start with their host's name (worker/__main__.py): read only this host's beats.
        registered = {raw.decode(): model.decode() for raw, model in client.hgetall(keys.WORKERS).items()}
        mine = [(worker_id, model) for worker_id, model in registered.items() if worker_id.startswith(f"{host}-")]
        beats = get_many(client, [keys.heartbeat(model, worker_id) for worker_id, model in mine])
    except redis.RedisError as exc:
        return f"cannot read Redis at {masked(settings.redis_url)}: {explain(exc)}"
    finally:
        if client is not None:
            client.close()
    workers = [info for info in (WorkerInfo.from_json(beat) for beat in beats if beat) if info.host == host]
    if not workers:
        return f"no worker on {host} has a live heartbeat (still loading its model, or gone)"
    if all(info.draining for info in workers):
        return "the worker is draining: it is stopping and takes no new jobs"
    if settings.metrics_port:
        host = "127.0.0.1" if settings.metrics_host in ("0.0.0.0", "") else settings.metrics_host
        url = f"http://{host}:{settings.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                response.read()
        except (OSError, urllib.error.URLError) as exc:  # HTTPError (not 200) is a URLError too
            return f"its metrics at {url} do not answer: {exc}"
    return None


def main(argv=None) -> None:
    settings = Settings.parse(argv, ["redis_url", "redis_cluster", "metrics_port"],
                              "Exit 0 when a worker on this host is serving (a container's health check)")
    reason = problem(settings, socket.gethostname())
    if reason:
        print(f"unhealthy: {reason}", file=sys.stderr)
        raise SystemExit(1)
    print("healthy")


if __name__ == "__main__":
    main()
