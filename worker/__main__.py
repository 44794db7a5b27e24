"""python -m worker: load the model once, then serve its queue until SIGTERM."""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import redis

from shared.protocol import WorkerInfo
from shared.settings import Settings
from worker import model_loader
from worker.job_queue import JobQueue
from worker.static_engine import StaticEngine
from worker.worker import Worker

FLAGS = ["redis_url", "model", "model_name", "batch", "wait_ms", "dtype", "device"]


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    settings = Settings.parse(argv, FLAGS, "Storyteller model worker")
    if settings.batch < 1:
        raise SystemExit("--batch must be at least 1")
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    client.ping()  # fail now, with a clear error, rather than after loading the model

    loaded = model_loader.load(settings.model, settings.model_name, settings.dtype, settings.device)
    files = model_loader.tokenizer_files(loaded.tokenizer)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    queue = JobQueue(client, worker_id, loaded.name, settings.answer_ttl_s)
    queue.store_tokenizer(files)
    engine = StaticEngine(loaded, capacity=settings.batch)
    info = WorkerInfo(
        id=worker_id, model=loaded.name, context_window=loaded.context_window, engine=engine.name,
        batch=settings.batch, device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
        tokenizer_digest=model_loader.digest(files),
        pid=os.getpid(), host=socket.gethostname(), started=time.time())
    worker = Worker(queue, engine, info, settings)
    worker.install_signal_handlers()
    logging.info("serving %s (%s, %s, context %d) with batches of up to %d, waiting %g ms to fill",
                 info.model, info.device, info.dtype, info.context_window, settings.batch, settings.wait_ms)
    worker.run()


if __name__ == "__main__":
    main()
