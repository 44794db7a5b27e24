"""python -m api: the completions API under gunicorn: a greenlet per waiting player (gevent), or a
thread per waiting player (gthread)."""
from __future__ import annotations

import atexit
import os
import resource
import shutil
import sys
import tempfile
import warnings

from gunicorn.app.base import BaseApplication

from api.auth import load_keys
from shared.redis_client import masked
from shared.settings import Settings

FLAGS = ["host", "port", "redis_url", "redis_cluster", "api_worker_class", "api_connections", "threads",
         "api_workers", "redis_connections", "request_timeout", "max_queue", "worker_grace", "affinity_wait", "api_keys",
         "api_keys_file", "rate_limit", "lenient", "open_objects", "files_dir", "batch_file_limit"]
WORKER_CLASSES = ("gevent", "gthread")


class _Gunicorn(BaseApplication):
    def __init__(self, settings: Settings):
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        url = f"http://{s.host}:{s.port}/v1"
        options = {
            "bind": f"{s.host}:{s.port}",
            "workers": s.api_workers,
            # A waiting player holds a greenlet (gevent: gunicorn monkey-patches the process, so
            # redis-py's sockets and the broker's threads and queues become cooperative) or a thread
            # (gthread): api_connections or threads is how many wait at once per process without
            # queueing at the socket. Either way, none holds a Redis connection while it waits.
            # gevent: gunicorn's own worker, but for its quick stop's traceback (api/gevent_worker.py).
            "worker_class": "api.gevent_worker.GeventWorker" if s.api_worker_class == "gevent" else s.api_worker_class,
            "worker_connections": s.api_connections,
            "threads": s.threads,
            "backlog": max(2048, s.api_connections),
            "timeout": 60,  # a worker process silent this long is restarted; request threads don't count
            "graceful_timeout": 30,
            "keepalive": 5,
            "accesslog": None,
            "child_exit": _child_exit,
            "when_ready": lambda server: print(f"Storyteller API listening on {url} "
                                                f"(Redis {masked(s.redis_url)})", flush=True),
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        # Imported here, in each gunicorn worker process, so no Redis connection crosses a fork.
        from api.app import create_app
        return create_app(self.settings)


def main(argv=None) -> None:
    settings = Settings.parse(argv, FLAGS, "Storyteller completions API (OpenAI's shape)")
    if settings.api_worker_class not in WORKER_CLASSES:
        raise SystemExit(f"--api-worker-class {settings.api_worker_class!r}: expected one of "
                         f"{', '.join(WORKER_CLASSES)}")
    load_keys(settings)  # an unreadable keys file stops us here, not in every gunicorn worker
    _raise_open_files(settings)
    # gevent's worker patches the standard library once forked, after this process imported ssl
    # (redis-py does, here through shared.settings). gevent then warns, naming the modules that
    # hold ssl's names from before the patch: redis-py's asyncio client alone, which the API never
    # uses (its sync client looks ssl's names up when it connects). Only that exact warning is
    # silenced: another module in the list would show it.
    warnings.filterwarnings("ignore", message=r"Monkey-patching ssl after ssl has already been imported"
                            r".*\(NOT patched\): \['redis\.asyncio\.connection \([^)]*\)'\]\.")
    _metrics_dir()
    _Gunicorn(settings).run()


def _raise_open_files(settings: Settings) -> None:
    """Each held player is a socket: lift the soft limit on open files (often 1024) as far as the
    hard limit allows, for the gunicorn processes forked from this one (the limit is per process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    players = settings.api_connections if settings.api_worker_class == "gevent" else settings.threads
    want = players + settings.redis_connections + 256  # and the listening socket, logs, metrics files
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _metrics_dir() -> None:
    """Where the API processes keep their metrics for /metrics to add up (api/metrics.py):
    PROMETHEUS_MULTIPROC_DIR if set, emptied of an earlier run's numbers, else a new temporary
    directory, removed when this process (gunicorn's arbiter, not its forked workers) exits.

    prometheus_client decides when it is imported whether to count in files: so before that.
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set: "
                           "each API process would report only its own requests")
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not given:
        made, arbiter = tempfile.mkdtemp(prefix="storyteller-metrics-"), os.getpid()
        atexit.register(lambda: os.getpid() == arbiter and shutil.rmtree(made, ignore_errors=True))
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = made
        return
    os.makedirs(given, exist_ok=True)
    for name in os.listdir(given):
        if name.endswith(".db"):
            os.remove(os.path.join(given, name))


def _child_exit(server, worker) -> None:
    """A gunicorn process died: its gauges stop counting (its counters stay, as counters must)."""
    from prometheus_client import multiprocess  # in the arbiter, after _metrics_dir()
    multiprocess.mark_process_dead(worker.pid)


if __name__ == "__main__":
    main()
