"""The API's side of Redis: which workers are alive, and a request's jobs out and results back.

A waiting request holds no Redis connection of its own. Each API process has one Subscriber: a
single pub/sub connection, read by one background thread (a greenlet under gunicorn's gevent
worker), that carries the channels of every request the process is waiting on and hands each
message to its request's inbox. So an API process opens a fixed number of Redis connections
(the pool's bound, which includes the subscriber's) however many players wait on it.

With a Redis Cluster, results travel by sharded pub/sub (SPUBLISH, SSUBSCRIBE), not plain pub/sub.
A plain PUBLISH in a cluster goes to every node over the cluster bus, so each node would carry every
message of every model however many nodes there were: the streams, most of what Redis carries here,
would not spread out with the keys. A sharded message goes only to the primary (and its replicas)
holding its channel's slot, and a job's channel has its model's hash tag (shared/keys.py): the
worker's publishing script sends it on the node it already runs on, and each API process listens on
every primary that holds a waiting request's model, with one SSUBSCRIBE connection per such primary
(`ShardedSubscriber`). One server, and Sentinel, keep plain pub/sub, which every Redis version has.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable, Iterator, Optional

import redis
from redis.client import PubSub
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from api.admission import Admission
from api.errors import ApiError, unavailable
from shared import keys
from shared.protocol import Failure, Final, Job, Result, WorkerInfo, decode_result
from shared.redis_client import get_many, is_cluster_client

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
# behind each other on the process's one subscriber (2,000 at once on 2 busy cores: past 5 s).
SUBSCRIBE_WAIT_S = 15.0
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
# With a cluster, how often at most a subscriber whose node failed it reads the cluster's layout again
# (to find where the node's slots went).
LAYOUT_EVERY_S = 1.0
# Put in a request's inbox when its channels are heard again after the subscriber reconnected:
# anything published meanwhile was dropped, so the request reads the stored answers at once.
RESUBSCRIBED = object()


class Broker:
    def __init__(self, client: redis.Redis, worker_grace_s: float = 60.0, max_queue: int = -1):
        self.redis = client
        self.worker_grace_s = worker_grace_s
        self.admission = Admission(client, max_queue)
        self.subscriber = ShardedSubscriber(client) if is_cluster_client(client) else Subscriber(client)
        # Every waiting request checks the workers' liveness each LOOK_EVERY_S: one read, shared
        # by all of them, stands for each (a read that failed, too: Redis is not asked again
        # by each of thousands of requests).
        self._workers_lock = threading.Lock()
        self._workers_read_at = float("-inf")
        self._workers: list[WorkerInfo] = []
        self._workers_error: Optional[redis.RedisError] = None

    def live_workers(self) -> list[WorkerInfo]:
        registered = self.redis.hgetall(keys.WORKERS)  # worker id -> its model, which names its heartbeat
        if not registered:
            return []
        beats = get_many(self.redis, [keys.heartbeat(m.decode(), i.decode()) for i, m in registered.items()])
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
        live = self.live_workers()
        workers = [w for w in live if not w.draining]
        if not workers and live:  # every worker is finishing what it holds: the service is stopping
            raise unavailable("every worker is stopping (finishing what it holds, taking nothing new): "
                              "try again once a worker is back", retry_after=WORKER_START_S)
        if not workers:
            raise unavailable("no worker is running: start one with `python -m worker`",
                              retry_after=WORKER_START_S)
        serving = [w for w in workers if w.model == model]
        if serving:
            return serving
        served = sorted({w.model for w in workers})
        raise ApiError(404, f"the model '{model}' does not exist; served here: {', '.join(served)}",
                       param="model", code="model_not_found")

    def submit(self, jobs: list[Job], cap: int, offer_wait_s: float = 0.0) -> "Pending":
        """Subscribe to the jobs' channels, then queue them (429 beyond `cap` waiting jobs); jobs
        offered to a worker (Job.offer) are its alone for `offer_wait_s`."""
        return Pending(self, jobs, cap, offer_wait_s)


class Inbox:
    """One request's channels and the messages the subscriber took for it."""

    def __init__(self, channels: list[bytes]):
        self.channels = channels
        self.messages: queue.SimpleQueue = queue.SimpleQueue()  # (channel, data) or RESUBSCRIBED
        self.subscribed = threading.Event()
        self.holder: Optional["Subscriber"] = None  # the subscriber carrying it now
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

    `sharded`: SSUBSCRIBE, on `client`, one node of a Redis Cluster (ShardedSubscriber's shards).
    """

    def __init__(self, client: redis.Redis, sharded: bool = False):
        self.redis = client
        self.sharded = sharded
        self._lock = threading.Lock()
        self._routes: dict[bytes, Inbox] = {}
        self._pubsub: Optional[_PubSub] = None  # None while (re)connecting
        self._generation = 0
        self._reader: Optional[threading.Thread] = None
        self._reader_pid = 0
        self._suspect = False
        self._closed = False

    def listen(self, channels: list[bytes]) -> Inbox:
        """An inbox for `channels`, once Redis has confirmed that it sends them to this process."""
        inbox = Inbox(channels)
        self.adopt(inbox)
        if not inbox.subscribed.wait(SUBSCRIBE_WAIT_S):
            (inbox.holder or self).forget(inbox)  # (a cluster's shard may have handed it on)
            self._suspect = True  # the reader asks its connection for a sign of life now
            raise redis.ConnectionError("Redis did not confirm the subscription in time")
        return inbox

    def adopt(self, inbox: Inbox) -> None:
        """Carry `inbox`'s channels from now on: subscribed, without waiting for Redis to confirm. An
        inbox another subscriber carried until now is told RESUBSCRIBED once they are confirmed here."""
        with self._lock:
            self._start_reader()
            for channel in inbox.channels:
                self._routes[channel] = inbox
            inbox.holder = self
            if self._pubsub is not None:
                try:
                    self._subscribe(self._pubsub, inbox.channels)
                except redis.RedisError:
                    pass  # the reader finds the link broken and subscribes every route again

    def forget(self, inbox: Inbox) -> None:
        with self._lock:
            for channel in inbox.channels:
                if self._routes.get(channel) is inbox:
                    del self._routes[channel]
            if self._pubsub is not None:
                try:
                    self._unsubscribe(self._pubsub, inbox.channels)
                except redis.RedisError:
                    pass  # a new connection subscribes only the routes left

    def release(self, leaving: Callable[[bytes], bool]) -> list[Inbox]:
        """Stop carrying the inboxes whose channels `leaving` picks (by their first: one request's
        channels share a slot); they are returned, for another subscriber to adopt."""
        with self._lock:
            inboxes = list({id(i): i for c, i in self._routes.items() if leaving(i.channels[0])}.values())
        for inbox in inboxes:
            self.forget(inbox)
        return inboxes

    def close(self) -> None:
        """Stop reading (a shard whose node holds no slot any more): the reader ends, its link closed."""
        with self._lock:
            self._closed = True

    def _subscribe(self, pubsub: PubSub, channels) -> None:
        if not self.sharded:
            pubsub.subscribe(*channels)
            return
        for group in _by_slot(channels):  # one SSUBSCRIBE may name channels of one slot only
            pubsub.ssubscribe(*group)

    def _unsubscribe(self, pubsub: PubSub, channels) -> None:
        if not self.sharded:
            pubsub.unsubscribe(*channels)
            return
        for group in _by_slot(channels):
            pubsub.sunsubscribe(*group)

    def _home(self) -> str:
        """The channel this subscriber always listens on."""
        return HOME_CHANNEL

    def _lost(self, error: Optional[Exception] = None) -> None:
        """The connection failed (`error`), or Redis unsubscribed a channel itself: with one server
        there is nothing to do but connect again."""

    @property
    def channels(self) -> int:
        """Channels subscribed for waiting requests (for tests and metrics)."""
        return len(self._routes)

    def _start_reader(self) -> None:
        # After a fork the thread is not there any more: each process starts its own.
        if self._closed:
            return
        if self._reader is None or self._reader_pid != os.getpid() or not self._reader.is_alive():
            self._pubsub, self._reader_pid = None, os.getpid()
            self._reader = threading.Thread(target=self._read, name="redis-subscriber", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        pubsub = None
        while not self._closed:
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
                # (A cluster node refusing a channel whose slot it no longer holds is no surprise.)
                expected = (redis.ConnectionError, redis.TimeoutError, *((redis.ResponseError,) if self.sharded
                                                                             else ()))
                if not isinstance(exc, expected):
                    log.exception("the Redis subscriber failed; connecting again")
                with self._lock:
                    self._pubsub = None
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001 - closing a broken link
                        pass
                    pubsub = None
                self._lost(exc)
                time.sleep(REDIS_RETRY_S)
        if pubsub is not None:
            pubsub.close()

    def _connect(self) -> _PubSub:
        """A new pub/sub connection subscribed to every route (confirmed as messages arrive)."""
        pubsub = _PubSub(self.redis.connection_pool)
        with self._lock:
            try:
                self._subscribe(pubsub, [self._home(), *self._routes])
            except Exception:
                pubsub.close()
                raise
            # Numbered across subscribers: an inbox moved to another one counts its confirmations anew.
            self._generation = next(_CONNECTIONS)
            self._pubsub = pubsub
        return pubsub

    def _route(self, message: dict) -> None:
        inbox = self._routes.get(message["channel"])
        if inbox is None:
            return  # the home channel, or a request that has finished
        kind = message["type"]
        if kind in ("message", "smessage"):
            inbox.messages.put((message["channel"], message["data"]))
        elif kind in ("subscribe", "ssubscribe"):
            inbox.confirmed(message["channel"], self._generation)
        elif kind == "sunsubscribe":  # not asked for (the route is still here): the slot moved
            self._lost()


# Numbers each subscriber connection made in this process (Subscriber._generation).
_CONNECTIONS = itertools.count(1)


def _by_slot(channels) -> list[list]:
    """`channels` grouped by hash slot, in their order."""
    groups: dict[int, list] = {}
    for channel in channels:
        groups.setdefault(key_slot(channel.encode() if isinstance(channel, str) else channel), []).append(channel)
    return list(groups.values())


class ShardedSubscriber:
    """This process's subscribers in a Redis Cluster: one Subscriber (SSUBSCRIBE) per primary that
    holds the slot of a waiting request's channels (one request's channels are all its model's: one
    slot), created when a request first needs it. The same interface as Subscriber.

    Should a shard's connection break (its node died; a replica is taking over) or its node
    unsubscribe a channel itself (the slot moved to another node), the cluster's layout is read again
    (at most every LAYOUT_EVERY_S) and each request whose slot another primary holds now is
    subscribed there, and told to read its stored answers once confirmed (RESUBSCRIBED), as after a
    reconnection; meanwhile, as then, its stored answers reach it each second. A shard left with no
    request on a node that is no primary any more stops.
    """

    def __init__(self, cluster):
        self.cluster = cluster
        self._lock = threading.Lock()
        self._shards: dict[str, _Shard] = {}  # node name (host:port) -> its subscriber
        self._layout_read_at = float("-inf")

    def listen(self, channels: list[bytes]) -> Inbox:
        with self._lock:
            shard = self._shard_for(channels[0])
        try:
            return shard.listen(channels)
        except redis.ConnectionError:
            self._read_layout()  # the node may be gone: the next request goes where the slot is now
            raise

    def forget(self, inbox: Inbox) -> None:
        with self._lock:  # not while the inbox moves between shards
            if inbox.holder is not None:
                inbox.holder.forget(inbox)

    @property
    def channels(self) -> int:
        with self._lock:
            return sum(shard.channels for shard in self._shards.values())

    def node_of(self, key) -> str:
        """The name of the primary holding `key`'s slot, as this process's client knows the layout."""
        try:
            return self.cluster.get_node_from_key(key).name
        except RedisClusterException as exc:  # no node holds the slot now (a fail-over under way)
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc

    def _shard_for(self, channel: bytes) -> "_Shard":
        name = self.node_of(channel)
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = _Shard(self, self.cluster.get_node(node_name=name))
        return shard

    def home(self, node_name: str) -> str:
        """A channel whose slot `node_name` holds now (its shard's home channel)."""
        for n in range(1 << 20):  # 16,384 slots: a node holding one of them is found long before
            name = keys.subscriber_home(str(n))
            if self.node_of(name) == node_name:
                return name
        raise redis.ConnectionError(f"the Redis Cluster node {node_name} holds no slot")

    def moved(self, shard: "_Shard") -> None:
        """`shard`'s node failed it: move its requests to where their slots are now."""
        if not self._read_layout():
            return  # no node answers: the shard connects again by itself meanwhile
        with self._lock:
            for inbox in shard.release(lambda channel: self.node_of(channel) != shard.name):
                self._shard_for(inbox.channels[0]).adopt(inbox)
            primaries = {node.name for node in self.cluster.get_primaries()}
            for name, idle in list(self._shards.items()):
                if name not in primaries and not idle.channels:
                    idle.close()
                    del self._shards[name]

    def _read_layout(self) -> bool:
        """Ask the cluster where its slots are, unless that was done under LAYOUT_EVERY_S ago; False
        if no node answered."""
        with self._lock:
            if time.monotonic() - self._layout_read_at < LAYOUT_EVERY_S:
                return True
            self._layout_read_at = time.monotonic()
        try:
            self.cluster.nodes_manager.initialize()
            return True
        except (redis.RedisError, RedisClusterException):
            return False


class _Shard(Subscriber):
    """The SSUBSCRIBE connection to one primary of a cluster (ShardedSubscriber)."""

    def __init__(self, parent: ShardedSubscriber, node):
        super().__init__(parent.cluster.get_redis_connection(node), sharded=True)
        self.parent, self.name = parent, node.name

    def _home(self) -> str:
        return self.parent.home(self.name)

    def _lost(self, error: Optional[Exception] = None) -> None:
        try:
            if isinstance(error, redis.exceptions.MovedError):  # a node said where a slot is now
                self.parent.cluster.nodes_manager.move_slot(error)
            self.parent.moved(self)
        except Exception as exc:  # noqa: BLE001 - the reader calling this must outlive anything
            # (The layout unknown for now, e.g. no node holds a slot during a fail-over: the next
            # failure, or request, tries again.)
            log.warning("the Redis Cluster subscriber of %s could not move its requests: %s", self.name, exc)


class Pending:
    """A request's jobs in flight. Subscribes to their channels first, then pushes them."""

    def __init__(self, broker: Broker, jobs: list[Job], cap: int, offer_wait_s: float = 0.0):
        self.broker = broker
        self.jobs = jobs
        self._index = {keys.channel(j.model, j.id).encode(): i for i, j in enumerate(jobs)}
        self._open = set(range(len(jobs)))
        # This host's own clock: the workers measure the same timeout in Redis' (Job.timeout_s).
        self.deadline = time.monotonic() + jobs[0].timeout_s
        # Pub/sub drops messages nobody listens for: listen() returns once Redis has confirmed.
        self._inbox = broker.subscriber.listen(list(self._index))
        try:
            broker.admission.push(jobs, cap, offer_wait_s)
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
        # One MGET: a request's jobs are of one model, whose keys share a slot.
        stored = self.broker.redis.mget([keys.answer(self.jobs[i].model, self.jobs[i].id) for i in open_ids])
        for index, raw in zip(open_ids, stored):
            if raw is not None:
                yield from self._take(index, decode_result(raw))

    def close(self) -> None:
        """Unsubscribe; jobs still open (client gone, timeout) are cancelled so no worker decodes them."""
        try:
            if self._open:
                pipe = self.broker.redis.pipeline(transaction=False)
                for i in self._open:
                    pipe.set(keys.cancel(self.jobs[i].model, self.jobs[i].id), 1,
                             ex=max(60, int(self.deadline - time.monotonic())))
                pipe.execute()
        finally:
            self.broker.subscriber.forget(self._inbox)
