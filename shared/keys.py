"""Every Redis key and channel name, in one place.

A request's life in Redis:
  api    RPUSH  queue(model, priority)        one JSON job per choice (a Lua script: only under the cap),
         LPUSH  wake(model)                   and a token that wakes an idle worker
  worker LMOVE  queue(model, p) -> processing(worker_id)   reliable pop, most urgent queue first (Lua):
                                              a dead worker's jobs stay visible
         SET    lease(job_id) worker_id       in the same script: who may answer the job
  worker PUBLISH channel(job_id)              text as it is written, then the final answer
  worker SET    answer(job_id) EX ...         the final answer again, for a subscriber that missed it
  worker LREM   processing(worker_id)         the job is done
                                              (these three in one Lua script, only while the lease
                                              still names this worker)
  api    SET    cancel(job_id)                the client went away: stop decoding it
"""

from shared.protocol import PRIORITIES, PRIORITY_DEFAULT

PREFIX = "storyteller"

# Set of every worker id that has announced itself; a member without a live heartbeat is dead.
WORKERS = f"{PREFIX}:workers"

# Sorted set, model -> the unix time of its last worker heartbeat: the models /metrics reports on,
# also while none of their workers is alive (so "no live worker" is a 0, not a missing series).
MODELS = f"{PREFIX}:models"

# Hash, model -> worker processes started for it (HINCRBY at start): restarts, which a
# per-process counter would not show, since a restarted worker starts counting from scratch.
WORKER_STARTS = f"{PREFIX}:worker-starts"


def queue(model: str, priority: int = PRIORITY_DEFAULT) -> str:
    return f"{queue_prefix(model)}{priority}"


def queue_prefix(model: str) -> str:
    """The queues' common start: a Lua script that puts a job back adds the job's priority."""
    return f"{PREFIX}:queue:{model}:"


def queues(model: str) -> list[str]:
    """Every queue of a model, most urgent first."""
    return [queue(model, p) for p in PRIORITIES]


def wake(model: str) -> str:
    """A short list of tokens, pushed with each job: an idle worker blocks on it."""
    return f"{PREFIX}:wake:{model}"


def drained_prefix(model: str) -> str:
    """+ a second of Redis' clock: how many jobs of `model` workers took in that second (the
    queue's drain rate, which a 429's Retry-After is estimated from)."""
    return f"{PREFIX}:drained:{model}:"


def attempts(job_id: str) -> str:
    """How many workers died holding this job."""
    return f"{PREFIX}:attempts:{job_id}"


def rate(key_digest: str, minute: int) -> str:
    """Requests made with one API key (by its digest, never the key) during one minute."""
    return f"{PREFIX}:rate:{key_digest}:{minute}"


def lease(job_id: str) -> str:
    """The id of the worker that holds the job: only it may publish or remove it. A worker declared
    dead loses it when its jobs are put back, so one whose link to Redis comes back publishes nothing
    for them (worker/job_queue.py's scripts check it)."""
    return f"{PREFIX}:lease:{job_id}"


def processing(worker_id: str) -> str:
    return f"{PREFIX}:processing:{worker_id}"


def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def tokenizer(model: str) -> str:
    return f"{PREFIX}:tokenizer:{model}"


def channel(job_id: str) -> str:
    return f"{PREFIX}:result:{job_id}"


def answer(job_id: str) -> str:
    return f"{PREFIX}:answer:{job_id}"


def cancel(job_id: str) -> str:
    return f"{PREFIX}:cancel:{job_id}"


# The batch API (api/batches.py): uploaded files, batch records, and the RQ queue batch jobs wait on.

# RQ's own queue name (RQ keeps it under rq:queue:...): `python -m batch` works it.
BATCH_QUEUE = f"{PREFIX}-batches"


def file(file_id: str) -> str:
    """A hash: the file's object (id, bytes, filename, purpose, created_at) and what it holds."""
    return f"{PREFIX}:file:{file_id}"


def file_content(file_id: str) -> str:
    """The file's bytes, when files are kept in Redis (no --files-dir)."""
    return f"{PREFIX}:file-content:{file_id}"


def batch(batch_id: str) -> str:
    """A hash: the batch's fields, and its request counts (HINCRBY as requests finish)."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_results(batch_id: str) -> str:
    """A hash, line index -> output line, filled as requests finish: a batch job run again after its
    RQ worker died skips what is there, and the output file is written from it in input order."""
    return f"{PREFIX}:batch-results:{batch_id}"
