"""The API's side of Redis: which workers are alive, and a request's jobs out and results back."""
from __future__ import annotations

import time
from typing import Iterator

import redis

from api.admission import Admission
from api.errors import ApiError, unavailable
from shared import keys
from shared.protocol import Failure, Final, Job, Result, WorkerInfo, decode_result

# How often a waiting request, between messages, reads the stored answers and checks its deadline
# and the workers' liveness. A message wakes it at once whatever this is.
LOOK_EVERY_S = 1.0
# Retry-After for a request that finds no worker: about what a worker takes to start.
WORKER_START_S = 10
# A waiting request rides out Redis being away this long (a restart: the queue and the answers
# survive it when Redis keeps them on disk) before it gives up with 503.
REDIS_OUTAGE_S = 30
REDIS_RETRY_S = 0.5


class Broker:
    def __init__(self, client: redis.Redis, worker_grace_s: float = 60.0, max_queue: int = -1):
        self.redis = client
        self.worker_grace_s = worker_grace_s
        self.admission = Admission(client, max_queue)

    def live_workers(self) -> list[WorkerInfo]:
        ids = self.redis.hkeys(keys.WORKERS)
        if not ids:
            return []
        beats = self.redis.mget([keys.heartbeat(i.decode()) for i in ids])
        return [WorkerInfo.from_json(b) for b in beats if b is not None]

    def workers_for(self, model: str) -> list[WorkerInfo]:
        """The live workers of `model` that take jobs: 503 if none at all, 404 if none serves it."""
        workers = [w for w in self.live_workers() if not w.draining]
        if not workers:
            raise unavailable("no worker is running: start one with `python -m worker`",
                              retry_after=WORKER_START_S)
        serving = [w for w in workers if w.model == model]
        if serving:
            return serving
        served = sorted({w.model for w in workers})
        raise ApiError(404, f"the model '{model}' does not exist; served here: {', '.join(served)}",
                       param="model", code="model_not_found")

    def submit(self, jobs: list[Job], cap: int) -> "Pending":
        """Subscribe to the jobs' channels, then queue them (429 beyond `cap` waiting jobs)."""
        return Pending(self, jobs, cap)


class Pending:
    """A request's jobs in flight. Subscribes to their channels first, then pushes them."""

    def __init__(self, broker: Broker, jobs: list[Job], cap: int):
        self.broker = broker
        self.jobs = jobs
        self._index = {keys.channel(j.id).encode(): i for i, j in enumerate(jobs)}
        self._open = set(range(len(jobs)))
        # This host's own clock: the workers measure the same timeout in Redis' (Job.timeout_s).
        self.deadline = time.monotonic() + jobs[0].timeout_s
        self._pubsub = broker.redis.pubsub()
        try:
            self._subscribe()
            broker.admission.push(jobs, cap)
        except Exception:
            self._pubsub.close()
            raise

    def _subscribe(self) -> None:
        # Pub/sub drops messages nobody listens for: wait until Redis confirms every subscription.
        self._pubsub.subscribe(*self._index)
        confirmed, give_up = 0, time.monotonic() + 2.0
        while confirmed < len(self._index):
            message = self._pubsub.get_message(timeout=max(0.0, give_up - time.monotonic()))
            if message is None and time.monotonic() >= give_up:
                raise redis.ConnectionError("Redis did not confirm the subscription in time")
            if message and message["type"] == "subscribe":
                confirmed += 1

    def results(self) -> Iterator[tuple[int, Result]]:
        """(choice index, result) as they come, until every job has its Final or Failure."""
        model, deadline = self.jobs[0].model, self.deadline
        next_look, alone_since, redis_lost_since = time.monotonic() + LOOK_EVERY_S, None, None
        while self._open:
            try:
                if redis_lost_since is not None:  # back, maybe: listen again, then read what was missed
                    self._resubscribe()
                    next_look = time.monotonic()
                wait = max(0.0, next_look - time.monotonic())
                message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                redis_lost_since = None
                if message and message["type"] == "message":
                    yield from self._take(self._index[message["channel"]], decode_result(message["data"]))
                if time.monotonic() < next_look:
                    continue
                next_look = time.monotonic() + LOOK_EVERY_S
                yield from self._read_stored_answers()
                workers = self.broker.live_workers()
            except (redis.ConnectionError, redis.TimeoutError):
                # The worker holding the job goes on writing and publishes once Redis is back; the
                # final answer is stored, so nothing said meanwhile is lost to a whole answer.
                redis_lost_since = redis_lost_since or time.monotonic()
                if time.monotonic() - redis_lost_since > REDIS_OUTAGE_S or time.monotonic() > deadline:
                    raise
                time.sleep(REDIS_RETRY_S)
                continue
            if time.monotonic() > deadline:
                raise ApiError(504, "the request timed out before its answer was written", code="timeout")
            # A draining worker still counts: it finishes what it holds. With none at all, the
            # jobs wait in the queue for a restarted worker, for a grace period.
            if any(w.model == model for w in workers):
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > self.broker.worker_grace_s:
                raise unavailable(f"no worker has served {model} for {self.broker.worker_grace_s:g} s",
                                  retry_after=WORKER_START_S)

    def _resubscribe(self) -> None:
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass
        self._pubsub = self.broker.redis.pubsub()
        self._subscribe()

    def _take(self, index: int, result: Result) -> Iterator[tuple[int, Result]]:
        if index not in self._open:
            return  # already answered, from the stored copy
        if isinstance(result, (Final, Failure)):
            self._open.discard(index)
        yield index, result

    def _read_stored_answers(self) -> Iterator[tuple[int, Result]]:
        open_ids = sorted(self._open)
        stored = self.broker.redis.mget([keys.answer(self.jobs[i].id) for i in open_ids])
        for index, raw in zip(open_ids, stored):
            if raw is not None:
                yield from self._take(index, decode_result(raw))

    def close(self) -> None:
        """Unsubscribe; jobs still open (client gone, timeout) are cancelled so no worker decodes them."""
        try:
            if self._open:
                pipe = self.broker.redis.pipeline(transaction=False)
                for i in self._open:
                    pipe.set(keys.cancel(self.jobs[i].id), 1, ex=max(60, int(self.deadline - time.monotonic())))
                pipe.execute()
        finally:
            self._pubsub.close()
