"""python -m batch: RQ's worker on the batch queue; each job runs one batch (batch/job.py).

Any number may run, on any machine that reaches Redis and the API: each batch is one RQ job, taken
by one of them. A worker stopped with SIGTERM finishes its batch first (RQ's warm shutdown); one
killed mid-batch leaves its job to RQ, which runs it again (up to api.batches.RQ_RETRIES times)
once its heartbeat has expired, and the rerun sends only the requests that had no answer yet.
"""
from __future__ import annotations

import logging

from rq import Queue, Worker

from batch import job
from shared import keys
from shared.lifetime import forks_die_with_parent
from shared.redis_client import connect, is_cluster, masked
from shared.settings import Settings

FLAGS = ["redis_url", "redis_cluster", "api_url", "batch_concurrency", "files_dir", "request_timeout", "api_keys",
         "api_keys_file"]
# How soon a batch whose RQ worker died runs again: its job's heartbeat outlives the worker by 90 s
# (RQ's), then another worker finds it when it next looks: after a job, or on waking while idle
# (every ~7 minutes, RQ's worker TTL), at most once a minute here (RQ's default: 10 minutes).
# Batches have hours: a few minutes before a rerun is no loss.
MAINTENANCE_INTERVAL_S = 60


def main(argv=None) -> None:
    settings = Settings.parse(argv, FLAGS, "Storyteller batch worker: runs batches (RQ jobs) through the API")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for chatty in ("httpx", "httpx2"):  # a line per request sent: the batch job logs what matters
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if is_cluster(settings.redis_url):  # RQ's worker wants one server's connection pool
        raise SystemExit(f"batch: RQ does not work with a Redis Cluster ({masked(settings.redis_url)}): "
                         f"the batch API needs one Redis or Sentinel")
    job.configure(settings)  # before RQ forks a process per job, which inherits it
    # That process (RQ's "work horse", in a process group of its own) dies with this worker: killed
    # outright (serve.py's stop timeout, serve.py itself killed, whose parent-death signal ends this
    # worker), it must not go on sending a batch nobody watches; RQ runs the batch again (above).
    forks_die_with_parent()
    connection = connect(settings.redis_url)
    worker = Worker([Queue(keys.BATCH_QUEUE, connection=connection)], connection=connection,
                    maintenance_interval=MAINTENANCE_INTERVAL_S)
    print(f"Storyteller batch worker on RQ queue {keys.BATCH_QUEUE} (Redis {masked(settings.redis_url)}), "
          f"sending to {settings.api_url}, {settings.batch_concurrency} requests at once", flush=True)
    worker.work(logging_level="INFO")


if __name__ == "__main__":
    main()
