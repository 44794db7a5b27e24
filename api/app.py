"""The Flask app: its routes, its errors in OpenAI's shape, and its Redis client.

A completions or chat request's path, from its body to its answer, is api/answer.py's.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import redis
from flask import Flask, jsonify
from flask.json.provider import DefaultJSONProvider
from redis.exceptions import RedisClusterException
from redis.sentinel import SentinelConnectionPool
from werkzeug.exceptions import HTTPException

from api import auth, batches, metrics
from api.answer import Answerer
from api.broker import Broker
from api.errors import ApiError, unavailable
from api.openapi import document
from api.tokenizers import TokenizerCache
from shared.protocol import WorkerInfo
from shared.redis_client import connect, is_cluster, is_sentinel, unavailable_because
from shared.settings import Settings

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(settings: Optional[Settings] = None, client: Optional[redis.Redis] = None) -> Flask:
    settings = settings or Settings.from_env()
    client = client or redis_client(settings)
    broker = Broker(client, settings.worker_grace, settings.max_queue)
    answerer = Answerer(settings, client, broker, TokenizerCache(client))  # the pipeline: api/answer.py
    app = Flask(__name__)
    app.json = _JsonProvider(app)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    metrics.install(app, client)  # first: a request refused by auth is counted too
    auth.install(app, settings, client)
    app.register_blueprint(batches.blueprint(settings, client))  # the batch API: api/batches.py

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError):
        return exc.response()

    @app.errorhandler(redis.RedisError)
    @app.errorhandler(RedisClusterException)  # a cluster's own (a pipeline's: no node holds a slot)
    def redis_down(exc):
        return unavailable(unavailable_because(exc)).response()

    @app.errorhandler(LookupError)
    def tokenizer_missing(exc):
        return unavailable(f"the worker has not stored its tokenizer in Redis yet: {exc}").response()

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        body, status, headers = ApiError(exc.code or 500, exc.description or exc.name).response()
        # A 405 must name the methods the path takes (RFC 9110): werkzeug's Allow header is kept.
        headers.update((name, value) for name, value in exc.get_headers() if name == "Allow")
        return body, status, headers

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    description = document()

    @app.get("/openapi.json")
    def openapi():
        return jsonify(description)

    @app.get("/health")
    def health():
        client.ping()
        workers = broker.live_workers()
        return jsonify({"status": "ok", "workers": len(workers), "models": sorted({w.model for w in workers})})

    @app.get("/v1/models")
    def models():
        by_model: dict[str, list[WorkerInfo]] = {}
        for worker in broker.live_workers():
            if worker.draining:
                continue
            by_model.setdefault(worker.model, []).append(worker)
        data = [{"id": model, "object": "model", "created": int(min(w.started for w in workers)),
                 "owned_by": "storyteller", "context_window": workers[0].context_window,
                 "workers": len(workers), "numerics": sorted({w.numerics for w in workers if w.numerics})}
                for model, workers in sorted(by_model.items())]
        return jsonify({"object": "list", "data": data})

    @app.post("/v1/completions")
    def completions():
        return answerer.answer(chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return answerer.answer(chat=True)

    return app


# How long a Redis command waits for one of the process's connections when all are in use: a burst
# of thousands on a starved CPU holds them longer than Redis takes (2,000 players arriving at once on
# 2 busy cores waited past 10 s, tests/test_many_streams.py), and a request would rather wait than
# get a 503 from a Redis that is up. Redis down fails each connection in a second (its connect
# timeout), which frees the pool.
POOL_WAIT_S = 30


def redis_client(settings: Settings) -> redis.Redis:
    """This API process's Redis client: at most settings.redis_connections connections.

    A waiting request holds none of them (it waits on the process's one subscriber: api/broker.py),
    so a few dozen carry thousands of players; a burst that wants more at once waits for a free
    one (redis-py's BlockingConnectionPool) rather than failing. Each connection is named after
    the process (CLIENT LIST shows which process holds what).
    """
    # Short timeouts: with Redis down, a request must get its 503 in a second or two, not hang.
    options = dict(socket_connect_timeout=1, socket_timeout=5, max_connections=settings.redis_connections,
                   client_name=f"storyteller-api-{os.getpid()}")
    if is_sentinel(settings.redis_url):
        # connect() hands these options to redis-py's Sentinel.master_for, which takes the pool's class.
        return connect(settings.redis_url, connection_pool_class=_WaitingSentinelPool, timeout=POOL_WAIT_S,
                       **options)
    if is_cluster(settings.redis_url):
        # A pool per node, each of this bound (the subscriber's connection to a node counts in that
        # node's); redis-py hands the pool class no options of its own, so the wait is the class's.
        return connect(settings.redis_url, connection_pool_class=_WaitingNodePool, **options)
    client = connect(settings.redis_url, **options)
    pool = client.connection_pool  # redis-py's plain pool, which fails past its bound: made waiting
    return redis.Redis(connection_pool=redis.BlockingConnectionPool(
        max_connections=settings.redis_connections, timeout=POOL_WAIT_S,
        connection_class=pool.connection_class, **pool.connection_kwargs))


class _WaitingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool of connections to the current primary that, past its bound, waits for a free
    connection as BlockingConnectionPool does (redis-py has no such pool of its own)."""


class _WaitingNodePool(redis.BlockingConnectionPool):
    """A Redis Cluster node's pool that waits POOL_WAIT_S for a free connection past its bound."""

    def __init__(self, **options):
        super().__init__(timeout=POOL_WAIT_S, **options)


class _JsonProvider(DefaultJSONProvider):
    """Flask's JSON, except that a body nested deeper than Python's stack ([[[[...]]]]) is invalid
    JSON, which every route answers with a 400, not a RecursionError's 500; and keys keep their
    order (Flask sorts them by default): completions' top_logprobs list the likeliest token first,
    as OpenAI's do."""

    sort_keys = False

    def loads(self, s, **kwargs):
        try:
            return super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("the JSON nests too deeply") from None

