"""python -m api: the completions API under gunicorn, with a thread per waiting player."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from gunicorn.app.base import BaseApplication

from api.auth import load_keys
from shared.redis_client import masked
from shared.settings import Settings

FLAGS = ["host", "port", "redis_url", "threads", "api_workers", "request_timeout", "max_queue", "worker_grace",
         "api_keys", "api_keys_file", "rate_limit", "files_dir", "batch_file_limit"]


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
            # gthread: each request holds a thread while it waits on Redis, so the thread count is
            # the number of players that can wait at once without queueing at the socket.
            "worker_class": "gthread",
            "threads": s.threads,
            "backlog": 2048,
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
    load_keys(settings)  # an unreadable keys file stops us here, not in every gunicorn worker
    _metrics_dir()
    _Gunicorn(settings).run()


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
