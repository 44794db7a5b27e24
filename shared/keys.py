"""Every Redis key and channel name, in one place.

A request's life in Redis:
  api    RPUSH  queue(model)                  one JSON job per choice
  worker BLMOVE queue(model) -> processing(worker_id)   reliable pop: a dead worker's jobs stay visible
  worker PUBLISH channel(job_id)              text as it is written, then the final answer
  worker SET    answer(job_id) EX ...         the final answer again, for a subscriber that missed it
  worker LREM   processing(worker_id)         the job is done
  api    SET    cancel(job_id)                the client went away: stop decoding it
"""

PREFIX = "storyteller"

# Set of every worker id that has announced itself; a member without a live heartbeat is dead.
WORKERS = f"{PREFIX}:workers"


def queue(model: str) -> str:
    return f"{PREFIX}:queue:{model}"


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
