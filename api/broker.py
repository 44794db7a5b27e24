"""The API's side of Redis: which workers are alive, and a request's jobs out and results back.

A waiting request holds no Redis connection of its own. Each API process has one Subscriber: a
single pub/sub connection, read by one background thread (a greenlet under gunicorn's gevent
worker), that carries the channels of every request the process is waiting on and hands each
message to its request's inbox. So an API process opens a fixed number of Redis connections
(the pool's bound, which includes the subscriber's) however many players wait on it.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Iterator, Optional

import redis
from redis.client import PubSub

from api.admission import Admission
from api.errors import ApiError, unavailable
from shared import keys
from shared.protocol import Failure, Final, Job, Result, WorkerInfo, decode_result

log = logging.getLogger(__name__)

# How often a waiting request, between messages, reads the stored answers and checks its deadline
# and the workers' liveness. A message wakes it at once whatever this is.
LOOK_EVERY_S = 1.0
# Retry-After for a request that finds no worker: about what a worker takes to start.
WORKER_START_S = 10
# A waiting request rides out Redis being away this long (a restart: the queue and the answers
# survive it when Redis keeps them on disk) before it gives up with 503.
REDIS_OUTAGE_S = 30
REDIS_RETRY_S = 0.5
# How long a request waits for Redis to confirm its subscriptions before its 503: longer than a
# connection of its own would need, as the confirmations of a crowd arriving at once queue up
# behind each other on the process's one subscriber.
SUBSCRIBE_WAIT_S = 5.0
# The subscriber's longest wait on its connection: how often it looks whether it was reconnected.
READ_WAIT_S = 1.0
# A link cut without a reset (a network partition) leaves a quiet connection that neither reads nor
# fails: after this long without a word from Redis the subscriber sends a PING, and connects again
# if no answer comes within PONG_WAIT_S. (A request's other reads time out on their own.)
PING_AFTER_S = 5.0
PONG_WAIT_S = 5.0
# A channel the subscriber always listens on, so its connection is never without a subscription
# (redis-py reads nothing from a pub/sub connection that has none).
HOME_CHANNEL = f"{keys.PREFIX}:api-subscriber"
# Put in a request's inbox when its channels are heard again after the subscriber reconnected:
# anything published meanwhile was dropped, so the request reads the stored answers at once.
RESUBSCRIBED = object()


class Broker:
    def __init__(self, client: redis.Redis, worker_grace_s: float = 60.0, max_queue: int = -1):
        self.redis = client
        self.worker_grace_s = worker_grace_s
        self.admission = Admission(client, max_queue)
        self.subscriber = Subscriber(client)
        # Every waiting request checks the workers' liveness each LOOK_EVERY_S: one read, shared
        # by all of them, stands for each (a read that failed, too: Redis is not asked again
        # by each of thousands of requests).
        self._workers_lock = threading.Lock()
        self._workers_read_at = float("-inf")
        self._workers: list[WorkerInfo] = []
        self._workers_error: Optional[redis.RedisError] = None

    def live_workers(self) -> list[WorkerInfo]:
        ids = self.redis.hkeys(keys.WORKERS)
        if not ids:
            return []
        beats = self.redis.mget([keys.heartbeat(i.decode()) for i in ids])
        return [WorkerInfo.from_json(b) for b in beats if b is not None]

    def recent_workers(self, max_age_s: float = LOOK_EVERY_S / 2) -> list[WorkerInfo]:
        """live_workers() as read at most `max_age_s` ago by this process (raising as it did)."""
        with self._workers_lock:
            if time.monotonic() - self._workers_read_at >= max_age_s:
                try:
                    self._workers, self._workers_error = self.live_workers(), None
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._workers_error = exc
                self._workers_read_at = time.monotonic()
            if self._workers_error is not None:
                raise self._workers_error
            return self._workers

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


class Inbox:
    """One request's channels and the messages the subscriber took for it."""

    def __init__(self, channels: list[bytes]):
        self.channels = channels
        self.messages: queue.SimpleQueue = queue.SimpleQueue()  # (channel, data) or RESUBSCRIBED
        self.subscribed = threading.Event()
        self._generation = -1  # the subscriber connection whose confirmations are being counted
        self._unconfirmed: set[bytes] = set()

    def confirmed(self, channel: bytes, generation: int) -> None:
        """Redis confirmed `channel` on the subscriber's connection number `generation`."""
        if generation != self._generation:
            self._generation, self._unconfirmed = generation, set(self.channels)
        if channel not in self._unconfirmed:
            return  # a second confirmation on one connection: two SUBSCRIBEs crossed
        self._unconfirmed.discard(channel)
        if self._unconfirmed:
            return
        if self.subscribed.is_set():
            self.messages.put(RESUBSCRIBED)
        else:
            self.subscribed.set()


class _PubSub(PubSub):
    connects = 0  # times redis-py connected this pub/sub's connection (not counting a pooled one)

    def on_connect(self, connection) -> None:
        # redis-py would subscribe its own list of channels again from whichever thread noticed
        # the broken link; the Subscriber does it itself, from its reader, under its lock.
        self.connects += 1


class Subscriber:
    """This process's one pub/sub connection, carrying every waiting request's channels.

    A request registers its inbox (`listen`), which returns once Redis has confirmed all its
    channels; `forget` unsubscribes them. A reader thread owns the connection's reading: it routes
    each message to its inbox, and when the connection breaks it connects again (every
    REDIS_RETRY_S while Redis is away), subscribes every registered channel again and, once they are
    confirmed, tells each inbox (RESUBSCRIBED). Sends from requests and from the reader go under
    one lock, so no two write to the connection at once.
    """

    def __init__(self, client: redis.Redis):
        self.redis = client
        self._lock = threading.Lock()
        self._routes: dict[bytes, Inbox] = {}
        self._pubsub: Optional[_PubSub] = None  # None while (re)connecting
        self._generation = 0
        self._reader: Optional[threading.Thread] = None
        self._reader_pid = 0
        self._suspect = False

    def listen(self, channels: list[bytes]) -> Inbox:
        """An inbox for `channels`, once Redis has confirmed that it sends them to this process."""
        inbox = Inbox(channels)
        with self._lock:
            self._start_reader()
            for channel in channels:
                self._routes[channel] = inbox
            if self._pubsub is not None:
                try:
                    self._pubsub.subscribe(*channels)
                except redis.RedisError:
                    pass  # the reader finds the link broken and subscribes every route again
        if not inbox.subscribed.wait(SUBSCRIBE_WAIT_S):
            self.forget(inbox)
            self._suspect = True  # the reader asks its connection for a sign of life now
            raise redis.ConnectionError("Redis did not confirm the subscription in time")
        return inbox

    def forget(self, inbox: Inbox) -> None:
        with self._lock:
            for channel in inbox.channels:
                if self._routes.get(channel) is inbox:
                    del self._routes[channel]
            if self._pubsub is not None:
                try:
                    self._pubsub.unsubscribe(*inbox.channels)
                except redis.RedisError:
                    pass  # a new connection subscribes only the routes left

    @property
    def channels(self) -> int:
        """Channels subscribed for waiting requests (for tests and metrics)."""
        return len(self._routes)

    def _start_reader(self) -> None:
        # After a fork the thread is not there any more: each process starts its own.
        if self._reader is None or self._reader_pid != os.getpid() or not self._reader.is_alive():
            self._pubsub, self._reader_pid = None, os.getpid()
            self._reader = threading.Thread(target=self._read, name="redis-subscriber", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        pubsub = None
        while True:
            try:
                if pubsub is None:
                    pubsub = self._connect()
                    connects, heard_at, pinged_at = pubsub.connects, time.monotonic(), None
                message = pubsub.get_message(timeout=READ_WAIT_S)
                if pubsub.connects > connects:  # redis-py reconnected by itself: no subscriptions
                    raise redis.ConnectionError("the subscriber's connection was re-established")
                now = time.monotonic()
                if message is not None:  # any word from Redis (a pong too): the link is alive
                    heard_at, pinged_at = now, None
                    self._route(message)
                elif pinged_at is not None:
                    if now - pinged_at > PONG_WAIT_S:
                        raise redis.ConnectionError("the subscriber's connection did not answer a PING")
                elif now - heard_at > PING_AFTER_S or self._suspect:
                    self._suspect = False
                    with self._lock:
                        pubsub.ping()
                    pinged_at = now
            except Exception as exc:  # noqa: BLE001 - the reader must outlive anything
                if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                    log.exception("the Redis subscriber failed; connecting again")
                with self._lock:
                    self._pubsub = None
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001 - closing a broken link
                        pass
                    pubsub = None
                time.sleep(REDIS_RETRY_S)

    def _connect(self) -> _PubSub:
        """A new pub/sub connection subscribed to every route (confirmed as messages arrive)."""
        pubsub = _PubSub(self.redis.connection_pool)
        with self._lock:
            try:
                pubsub.subscribe(HOME_CHANNEL, *self._routes)
            except Exception:
                pubsub.close()
                raise
            self._generation += 1
            self._pubsub = pubsub
        return pubsub

    def _route(self, message: dict) -> None:
        inbox = self._routes.get(message["channel"])
        if inbox is None:
            return  # the home channel, or a request that has finished
        if message["type"] == "message":
            inbox.messages.put((message["channel"], message["data"]))
        elif message["type"] == "subscribe":
            inbox.confirmed(message["channel"], self._generation)


class Pending:
    """A request's jobs in flight. Subscribes to their channels first, then pushes them."""

    def __init__(self, broker: Broker, jobs: list[Job], cap: int):
        self.broker = broker
        self.jobs = jobs
        self._index = {keys.channel(j.id).encode(): i for i, j in enumerate(jobs)}
        self._open = set(range(len(jobs)))
        # This host's own clock: the workers measure the same timeout in Redis' (Job.timeout_s).
        self.deadline = time.monotonic() + jobs[0].timeout_s
        # Pub/sub drops messages nobody listens for: listen() returns once Redis has confirmed.
        self._inbox = broker.subscriber.listen(list(self._index))
        try:
            broker.admission.push(jobs, cap)
        except Exception:
            broker.subscriber.forget(self._inbox)
            raise

    def results(self) -> Iterator[tuple[int, Result]]:
        """(choice index, result) as they come, until every job has its Final or Failure."""
        model, deadline = self.jobs[0].model, self.deadline
        next_look, alone_since, redis_lost_since = time.monotonic() + LOOK_EVERY_S, None, None
        while self._open:
            try:
                item = self._inbox.messages.get(timeout=max(0.0, next_look - time.monotonic()))
            except queue.Empty:
                item = None
            if item is RESUBSCRIBED:
                next_look = time.monotonic()  # listening again: read what was said meanwhile
            elif item is not None:
                channel, data = item
                yield from self._take(self._index[channel], decode_result(data))
            if time.monotonic() < next_look:
                continue
            next_look = time.monotonic() + LOOK_EVERY_S
            try:
                yield from self._read_stored_answers()
                workers = self.broker.recent_workers()
                redis_lost_since = None
            except (redis.ConnectionError, redis.TimeoutError):
                # The worker holding the job goes on writing and publishes once Redis is back; the
                # final answer is stored, so nothing said meanwhile is lost to a whole answer. The
                # subscriber listens again by itself and says so (RESUBSCRIBED).
                redis_lost_since = redis_lost_since or time.monotonic()
                if time.monotonic() - redis_lost_since > REDIS_OUTAGE_S or time.monotonic() > deadline:
                    raise
                next_look = time.monotonic() + REDIS_RETRY_S
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
            self.broker.subscriber.forget(self._inbox)
