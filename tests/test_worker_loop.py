"""The worker's loop on its own, with stand-ins for Redis and the engine: how it stops."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import redis

from shared.protocol import WorkerInfo
from shared.settings import Settings
from worker import worker as worker_module
from worker.worker import Worker


class RedisGone:
    """A JobQueue whose Redis went away after the worker announced itself."""
    isolated: set = set()

    def count_start(self) -> None:
        pass

    def heartbeat(self, info, ttl_s) -> None:
        pass

    def __getattr__(self, name):
        def unreachable(*args, **kwargs):
            raise redis.ConnectionError("Connection refused")
        return unreachable


class IdleEngine:
    busy = False

    def free_slots(self) -> int:
        return 4

    def sequences(self) -> list:
        return []

    def stats(self) -> dict:
        return {}


def test_a_stopping_worker_whose_redis_is_gone_leaves_after_a_while(monkeypatch):
    monkeypatch.setattr(worker_module, "STOPPING_REDIS_WAIT_S", 0.5)
    monkeypatch.setattr(worker_module, "REDIS_RETRY_S", 0.05)
    info = WorkerInfo(id="w", model="m", context_window=8, engine="test", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    queue = RedisGone()
    worker = Worker(queue, IdleEngine(), info, Settings(heartbeat_s=0.05))
    # An answer it could not send before Redis went.
    worker._unpublished = [SimpleNamespace(id="job-0", finished=True, finish_reason="length")]
    worker.stop()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.run(), done.set()), daemon=True).start()
    started = time.monotonic()
    assert done.wait(10), "the worker never left"
    assert 0.5 <= time.monotonic() - started < 5

