"""Every Redis key and channel name, in one place.

A request's life in Redis (m: the model's hash tag, below):
  api    RPUSH  queue(m, priority)            one JSON job per choice (a Lua script: only under the cap),
         LPUSH  wake(m)                       and a token that wakes an idle worker
  worker LMOVE  queue(m, p) -> processing(m, worker_id)   reliable pop, most urgent queue first (Lua):
                                              a dead worker's jobs stay visible
         SET    lease(m, job_id) worker_id    in the same script: who may answer the job
  worker PUBLISH channel(m, job_id)           text as it is written, then the final answer
         SETRANGE written(m, job_id)          the token ids written so far, with the text they made
  worker SET    answer(m, job_id) EX ...      the final answer again, for a subscriber that missed it
  worker LREM   processing(m, worker_id)      the job is done, its record deleted
                                              (these in one Lua script, only while the lease
                                              still names this worker)
  api    SET    cancel(m, job_id)             the client went away: stop decoding it

Hash tags (Redis Cluster). A Lua script, a MULTI and a blocking move may only touch keys of one hash
slot in a cluster, and the slot of a key is that of its {hash tag}, the part between its first { and
the next }. So everything about one model carries the model's tag, storyteller:{MODEL}:...: its
queues, wake list, drain counters, tokenizer, its workers' processing lists, heartbeats and
registry, and every per-job key (lease, attempts, written, written-by, answer, cancel, and the result
channel, which sharded pub/sub places by slot too). A job belongs to one model and a worker serves
one model, so whoever names such a key has the model at hand, and each of the worker's scripts
(worker/job_queue.py) and the API's admission script (api/admission.py) stays within one slot,
deriving the per-job names it builds inside from prefixes that carry the same tag. The cost: one
model's traffic lives on one node; a cluster spreads the load of several models, not of one.

Keys used only outside scripts need no tag (the worker set, the models, the rate counters), except
where a MULTI spans two keys: a batch's record and its results, a file's record and its content,
tagged with the batch or file id. The names are the same whatever the Redis (one server, Sentinel,
Cluster). They changed when the tags came in: old and new processes do not share a queue.
"""

from shared.protocol import PRIORITIES, PRIORITY_DEFAULT

PREFIX = "storyteller"

# Hash, worker id -> the model it serves: every worker that has announced itself, for whoever needs
# them all (the API, /metrics); a member without a live heartbeat is dead.
WORKERS = f"{PREFIX}:workers"

# Sorted set, model -> the unix time of its last worker heartbeat: the models /metrics reports on,
# also while none of their workers is alive (so "no live worker" is a 0, not a missing series).
# No expiry on the key, on purpose: a model whose workers all died must stay on the dashboards; the
# API's /metrics forgets a member a day after its last heartbeat (api/metrics.py, MODEL_MEMORY_S).
MODELS = f"{PREFIX}:models"

# Hash, model -> worker processes started for it (HINCRBY at start): restarts, which a
# per-process counter would not show, since a restarted worker starts counting from scratch.
# Permanent on purpose, no expiry: a Prometheus counter must never go back to 0 by itself (rate()
# would read a reset), and it holds one number per model.
WORKER_STARTS = f"{PREFIX}:worker-starts"


def tag(model: str) -> str:
    """The model's hash tag, braces included. A model's name goes in as it is, unless it holds a
    brace (which would end or spoil the tag) or a %: then those three are percent-encoded, so that
    two names never share a tag; an empty name is '{%}'."""
    if not model:
        return "{%}"
    return "{" + model.replace("%", "%25").replace("{", "%7B").replace("}", "%7D") + "}"


def model_prefix(model: str) -> str:
    """The start of every key of the model: storyteller:{MODEL}:"""
    return f"{PREFIX}:{tag(model)}:"


def queue(model: str, priority: int = PRIORITY_DEFAULT) -> str:
    return f"{queue_prefix(model)}{priority}"


def queue_prefix(model: str) -> str:
    """The queues' common start: a Lua script that puts a job back adds the job's priority."""
    return f"{model_prefix(model)}queue:"


def queues(model: str) -> list[str]:
    """Every queue of a model, most urgent first."""
    return [queue(model, p) for p in PRIORITIES]


def wake(model: str) -> str:
    """A short list of tokens, pushed with each job: an idle worker blocks on it."""
    return f"{model_prefix(model)}wake"


def worker_wake(model: str, worker_id: str) -> str:
    """A worker's own wake list: pushed when a job is offered to it (shared/routing.py), so an idle
    worker starts it at once; it blocks on this and the model's wake list together."""
    return f"{model_prefix(model)}wake:{worker_id}"


def route_prefix(model: str) -> str:
    """+ a prompt's chain digest (shared/routing.py): the id of the worker that last answered a job
    whose prompt ended there (its prefix cache likely holds it), for ROUTE_TTL_S."""
    return f"{model_prefix(model)}route:"


def drained_prefix(model: str) -> str:
    """+ a second of Redis' clock: how many jobs of `model` workers took in that second (the
    queue's drain rate, which a 429's Retry-After is estimated from)."""
    return f"{model_prefix(model)}drained:"


def model_workers(model: str) -> str:
    """Hash, worker id -> its numerics fingerprint ('' unknown): the model's registered workers, in the
    model's slot. The script that puts a dead worker's jobs back strikes it off here in the same
    step (and stamps its fingerprint on them: written_by), and the worker's heartbeat adds it again
    in one MULTI with its heartbeat key: a worker finds it was struck off (WORKERS, global, is only
    for finding workers, and a script cannot touch it in a cluster)."""
    return f"{model_prefix(model)}workers"


def attempts(model: str, job_id: str) -> str:
    """How many workers died holding this job."""
    return f"{model_prefix(model)}attempts:{job_id}"


def rate(key_digest: str, minute: int) -> str:
    """Requests made with one API key (by its digest, never the key) during one minute."""
    return f"{PREFIX}:rate:{key_digest}:{minute}"


def lease(model: str, job_id: str) -> str:
    """The id of the worker that holds the job: only it may publish or remove it. A worker declared
    dead loses it when its jobs are put back, so one whose link to Redis comes back publishes nothing
    for them (worker/job_queue.py's scripts check it)."""
    return f"{model_prefix(model)}lease:{job_id}"


def written(model: str, job_id: str) -> str:
    """The ids of the tokens the job's worker has written so far, as "id,id,...,": a string that
    only grows (SETRANGE at its end), so each step's record costs its new tokens, not the whole
    list. A worker that takes the job back after its worker died continues from them instead of
    writing the job again (worker/job_queue.py). Kept by a requeue, deleted with the job's answer."""
    return f"{model_prefix(model)}written:{job_id}"


def written_by(model: str, job_id: str) -> str:
    """The numerics fingerprint of the worker that died holding the job, set as the job is put back
    and expiring worker/job_queue.PREFER_SAME_NUMERICS_S later: until then a worker of another
    fingerprint passes the job over while a worker of this one is live (live_numerics)."""
    return f"{model_prefix(model)}written-by:{job_id}"


def live_numerics(model: str, numerics: str) -> str:
    """Exists while a worker of this numerics fingerprint that takes jobs (not draining) has a live
    heartbeat: each one's heartbeat sets it, with its TTL (the pool's HEARTBEAT_TTL_S: where workers
    have different ones, the last beat's decides, which may end a preference early, never hold a
    job longer). What the take checks before it leaves a requeued job to such a worker (written_by)."""
    return f"{model_prefix(model)}live-numerics:{numerics}"


def processing(model: str, worker_id: str) -> str:
    """The jobs a worker of `model` holds (a worker serves one model: its list lives in the model's
    slot, with the queues it takes from)."""
    return f"{model_prefix(model)}processing:{worker_id}"


def heartbeat(model: str, worker_id: str) -> str:
    return f"{model_prefix(model)}worker:{worker_id}"


def tokenizer(model: str) -> str:
    """Hash, file name -> content: the model's tokenizer files, which the API loads to count and
    render tokens. No expiry, on purpose: every worker start rewrites it (and a heartbeat that finds
    it gone, after Redis restarted empty), so it is as fresh as the last worker; one per model ever
    served, a few MB (SmolLM2's: 3.5 MB; DEL it to retire a model)."""
    return f"{model_prefix(model)}tokenizer"


# Seconds a stored grammar outlives its last use (keys.grammar): far beyond any job's wait, so a
# queued or resumed job always finds its grammar.
ROUTE_TTL_S = 1800  # a conversation idle this long has likely left the workers' prefix caches too
GRAMMAR_TTL_S = 3600


def grammar(model: str, digest: str) -> str:
    """String: a constraint's grammar (llguidance's JSON form, api/grammars.py), stored by the API
    under the sha256 `digest` of its text, which the jobs that use it carry (params.grammar): it
    travels once, not in every job. It expires GRAMMAR_TTL_S after its last use (each request that
    uses it sets it again), so a game's few schemas stay and a one-off goes."""
    return f"{model_prefix(model)}grammar:{digest}"


def channel(model: str, job_id: str) -> str:
    return f"{model_prefix(model)}result:{job_id}"


def answer(model: str, job_id: str) -> str:
    return f"{model_prefix(model)}answer:{job_id}"


def cancel(model: str, job_id: str) -> str:
    return f"{model_prefix(model)}cancel:{job_id}"


def subscriber_home(name: str) -> str:
    """A channel an API process's subscriber always listens on (api/broker.py), so its connection is
    never without a subscription; `name` is its hash tag (with sharded pub/sub, one on each node)."""
    return f"{PREFIX}:api-subscriber:{{{name}}}"


# The batch API (api/batches.py): uploaded files, batch records, and the RQ queue batch jobs wait on.

# RQ's own queue name (RQ keeps it under rq:queue:...): `python -m batch` works it.
BATCH_QUEUE = f"{PREFIX}-batches"


def file(file_id: str) -> str:
    """A hash: the file's object (id, bytes, filename, purpose, created_at) and what it holds. Tagged
    with the file's id: written with its content in one MULTI."""
    return f"{PREFIX}:file:{{{file_id}}}"


def file_content(file_id: str) -> str:
    """The file's bytes, when files are kept in Redis (no --files-dir)."""
    return f"{PREFIX}:file-content:{{{file_id}}}"


def batch(batch_id: str) -> str:
    """A hash: the batch's fields, and its request counts (HINCRBY as requests finish). Tagged with the
    batch's id: counted with its results in one MULTI."""
    return f"{PREFIX}:batch:{{{batch_id}}}"


def batch_results(batch_id: str) -> str:
    """A hash, line index -> output line, filled as requests finish: a batch job run again after its
    RQ worker died skips what is there, and the output file is written from it in input order."""
    return f"{PREFIX}:batch-results:{{{batch_id}}}"
