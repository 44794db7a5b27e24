"""The API's Prometheus metrics, served at /metrics: requests by route and status, their latency, time
to first token, the tokens answered, errors by code; and the queues and workers, read from Redis.

Under gunicorn every API process counts its own requests. prometheus_client keeps each process's
numbers in files under PROMETHEUS_MULTIPROC_DIR (api/__main__.py sets it before this module is
imported) and /metrics adds them up, whichever process the scrape reaches. What is read from Redis
is read by that one process, once per scrape: were it counted in every process, each number would
come out multiplied by the number of processes.

/metrics is a WSGI mount in front of the Flask app, not a route: it is no part of the API that
clients use (nor of its OpenAPI description, nor of the requests it counts), and no API key guards it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time

import redis
from flask import Flask, Response, g, request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, make_wsgi_app, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from api.errors import ApiError
from shared import keys
from shared import metrics as names
from shared.protocol import PRIORITIES
from shared.redis_client import is_cluster_client, server_time

log = logging.getLogger(__name__)

PATH = "/metrics"
UNMATCHED = "unmatched"  # the route of every path no route matched: one label value, whatever the path
# A model whose workers have all gone is still reported (0 alive, its queue) this long after the
# last heartbeat, so that an alert on it fires; then it is forgotten (a model no longer served).
MODEL_MEMORY_S = 24 * 3600
_CODE = re.compile(r"^[a-z0-9_]{1,48}$")  # error codes are ours; anything else is one value, "other"

# Seconds: from a 429 answered at once to a long story written whole (REQUEST_TIMEOUT: 300 s).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(names.REQUESTS, "HTTP requests answered, by route (the Flask rule) and status",
                   ["route", "status"])
REQUEST_LATENCY = Histogram(names.REQUEST_LATENCY, "From a request's arrival to its last byte sent "
                            "(a stream's too), by route", ["route"], buckets=LATENCY_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram(names.TIME_TO_FIRST_TOKEN, "Streamed completions: from the request's "
                                "arrival to its first text sent", ["model"], buckets=TTFT_BUCKETS)
PROMPT_TOKENS = Counter(names.PROMPT_TOKENS, "Prompt tokens, as answered in `usage`", ["model"])
COMPLETION_TOKENS = Counter(names.COMPLETION_TOKENS, "Completion tokens, as answered in `usage`", ["model"])
ROUTED = Counter(names.ROUTED_REQUESTS, "Requests offered first to the worker that answered their "
                 "conversation's last turn (shared/routing.py)", ["model"])
ERRORS = Counter(names.ERRORS, "Errors answered, by code (an HTTP error, or one inside a stream)", ["code"])

# Series there from the start, at 0. Prometheus sees a labelled counter's first increase only if it
# saw the series before: one born at 1 has a rate of 0, and the first burst of 429s or 5xx would
# go unseen by the alerts. The codes of overload and failure, and the statuses they come with:
EXPECTED_ERRORS = ("queue_full", "rate_limit_exceeded", "service_unavailable", "timeout", "worker_error",
                   "worker_crashed", "server_error")
EXPECTED_REQUESTS = [(route, status) for route in ("/v1/completions", "/v1/chat/completions")
                     for status in ("200", "429", "500", "503", "504")]


def install(app: Flask, client: redis.Redis) -> None:
    """Count `app`'s requests, and serve /metrics. Install before anything that may refuse a
    request (API keys), so that its arrival time is taken first and its refusal counted."""
    registry = CollectorRegistry()
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        multiprocess.MultiProcessCollector(registry)
    else:  # one process (tests, or the app served some other way): its own numbers are all there is
        registry.register(_ThisProcess())
    registry.register(QueueCollector(client))
    for code in EXPECTED_ERRORS:
        ERRORS.labels(code)
    for route, status in EXPECTED_REQUESTS:
        REQUESTS.labels(route, status)
    app.before_request(_arrived)
    app.after_request(_answered)
    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {PATH: make_wsgi_app(registry)})


def _arrived() -> None:
    g.metrics_arrived = time.perf_counter()


def _answered(response: Response) -> Response:
    # A rule, not the path: "/v1/batches/<batch_id>" is one value, and unknown paths one more.
    route = request.url_rule.rule if request.url_rule is not None else UNMATCHED
    REQUESTS.labels(route, str(response.status_code)).inc()
    if response.status_code >= 400:
        ERRORS.labels(_error_code(response)).inc()
    arrived = g.get("metrics_arrived", time.perf_counter())
    # Observed when the server closes the response: after a stream's last chunk, not its first.
    response.call_on_close(lambda: REQUEST_LATENCY.labels(route).observe(time.perf_counter() - arrived))
    return response


def _error_code(response: Response) -> str:
    """The answer's OpenAI error code, or its type when it has none (a 404 path, a 405)."""
    body = response.get_json(silent=True) if not response.is_streamed else None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return f"http_{response.status_code}"
    return _bounded(error.get("code") or error.get("type"))


def _bounded(code) -> str:
    return code if isinstance(code, str) and _CODE.match(code) else "other"


class Answer:
    """One completions request's own numbers, counted as its answer is written (a stream's after
    its HTTP status has gone out: its errors are counted here, not as an HTTP error)."""

    def __init__(self, model: str):
        self.model = model  # a served model (the request got past the 404): a bounded label
        self.arrived = g.get("metrics_arrived", time.perf_counter())
        self._first_text_sent = False

    def text_sent(self) -> None:
        """A streamed chunk with text went out: the first is the time to first token."""
        if not self._first_text_sent:
            self._first_text_sent = True
            TIME_TO_FIRST_TOKEN.labels(self.model).observe(time.perf_counter() - self.arrived)

    def answered(self, usage: dict) -> None:
        """The `usage` the client is told (or would be, for a stream without include_usage)."""
        PROMPT_TOKENS.labels(self.model).inc(usage["prompt_tokens"])
        COMPLETION_TOKENS.labels(self.model).inc(usage["completion_tokens"])

    def failed(self, error: ApiError) -> ApiError:
        """An error sent inside a stream; returned, to be sent."""
        ERRORS.labels(_bounded(error.code or error.body()["error"]["type"])).inc()
        return error


class _ThisProcess:
    def collect(self):
        return REGISTRY.collect()


class QueueCollector:
    """The queues and the workers as Redis has them, read when /metrics is scraped."""

    def __init__(self, client: redis.Redis):
        self.redis = client

    def collect(self):
        try:
            # Redis' clock, as the jobs' enqueued_at and the workers' heartbeat times are: no
            # host's own clock is compared with another's.
            seconds, microseconds = self.redis.time()
            families = self._read(seconds + microseconds / 1e6)
        except redis.RedisError as exc:  # the rest of /metrics still answers (errors_total shows the 503s)
            log.warning("/metrics: Redis is not readable, no queue metrics: %s", exc)
            return []
        return families

    def _read(self, now: float) -> list:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(keys.MODELS, "-inf", now - MODEL_MEMORY_S)
        pipe.zrange(keys.MODELS, 0, -1)
        pipe.hgetall(keys.WORKERS)
        pipe.hgetall(keys.WORKER_STARTS)
        _, recent, workers, starts = pipe.execute()
        workers = {wid.decode(): model.decode() for wid, model in workers.items()}
        models = sorted({m.decode() for m in recent} | set(workers.values()))

        pipe = self.redis.pipeline(transaction=False)  # (a cluster's sends each key to its node)
        for worker_id, model in workers.items():
            pipe.exists(keys.heartbeat(model, worker_id))
        for model in models:
            for queue in keys.queues(model):
                pipe.llen(queue)
                pipe.lindex(queue, 0)  # its head: the queue's oldest job (taken first)
        replies = pipe.execute()
        alive, queues = replies[:len(workers)], iter(replies[len(workers):])

        depth = GaugeMetricFamily(names.QUEUE_DEPTH, "Jobs waiting in the queue, by model and priority",
                                  labels=["model", "priority"])
        oldest = GaugeMetricFamily(names.OLDEST_JOB_AGE, "How long the oldest waiting job of the model "
                                   "has waited (0: none waits)", labels=["model"])
        for model in models:
            stamps = []
            for priority in PRIORITIES:
                length, head = next(queues), next(queues)
                depth.add_metric([model, str(priority)], length)
                if head is not None:
                    stamps.append(_enqueued_at(head))
            stamped = [s for s in stamps if s > 0]
            clock = now
            if stamped and is_cluster_client(self.redis):
                # Its jobs were stamped by its own node, whose clock is not the first one's.
                seconds, microseconds = server_time(self.redis, keys.queue(model))
                clock = seconds + microseconds / 1e6
            oldest.add_metric([model], max(0.0, clock - min(stamped)) if stamped else 0.0)

        live = GaugeMetricFamily(names.WORKERS_ALIVE, "Workers with a live heartbeat, by model",
                                 labels=["model"])
        for model in models:
            live.add_metric([model], sum(1 for (w, m), up in zip(workers.items(), alive) if m == model and up))
        started = CounterMetricFamily(names.WORKER_STARTS, "Worker processes started, by model "
                                      "(restarts included)", labels=["model"])
        for model, count in sorted(starts.items()):
            started.add_metric([model.decode()], int(count))
        return [depth, oldest, live, started]


def _enqueued_at(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("enqueued_at") or 0.0)
    except (ValueError, TypeError, AttributeError):  # not a job: not ours to judge here
        return 0.0
