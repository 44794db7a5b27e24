"""python -m api: the completions API under gunicorn, with a thread per waiting player."""
from __future__ import annotations

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
    _Gunicorn(settings).run()


if __name__ == "__main__":
    main()
