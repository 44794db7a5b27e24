"""A worker's Prometheus metrics, served on --metrics-port.

What happens once per job (its queue wait, its time per output token, the tokens it resumed from)
or once per step (the batch size) is observed as it happens, into histograms and a counter.
Everything else (sequences running and waiting, KV-cache usage, preemptions, prefix-cache hits,
tokens generated, jobs put back) the engine and the job queue count anyway, as plain numbers: they
are read when /metrics is scraped, which costs the decode loop nothing.
"""
from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from typing import Optional

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared import metrics as names
from shared.protocol import Job
from worker import clock
from worker.engine_protocol import Engine
from worker.sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_NORMALLY = ("stop", "length")
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

QUEUE_WAIT = Histogram(names.QUEUE_WAIT, "From a job's queueing by the API to its taking by a worker "
                       "(both in Redis' clock)", ["model"], buckets=WAIT_BUCKETS)
# How long an offered job waited before it was taken: by its own worker ("own"), in a pool with room
# the step it finished first, which --affinity-wait should cover, in a saturated one mostly its time
# in line; by another ("other"), its offer, or its worker's late beat, and its share of the line
# (docs/scaling.md). Not a job a dead worker held: its wait was that worker's hold and the
# requeue's look, not its offer's. bench/conversations.py reads it.
OFFER_WAIT = Histogram(names.OFFER_WAIT, "From the queueing of a job offered to a worker (routing) to "
                       "its taking (both in Redis' clock), by that worker (own) or another (other); "
                       "not those put back after their worker died",
                       ["model", "taken_by"], buckets=WAIT_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram(names.TIME_PER_OUTPUT_TOKEN, "A finished job's time from its first "
                                  "token to its last, per token after the first", ["model"],
                                  buckets=TOKEN_BUCKETS)
BATCH_SIZE = Histogram(names.BATCH_SIZE, "Sequences computed together in one engine step", ["model"],
                       buckets=BATCH_BUCKETS)
RESUMED_TOKENS = Counter(names.RESUMED_TOKENS, "Tokens of requeued jobs taken from their record of what an "
                         "earlier worker wrote, instead of decoded again", ["model"])


class WorkerMetrics:
    """What the worker loop reports as it goes: a job taken, a step run, jobs finished."""

    def __init__(self, model: str):
        # Bound once: a step costs one histogram observation, not a label lookup too.
        self._wait = QUEUE_WAIT.labels(model)
        self._offer_wait = {by: OFFER_WAIT.labels(model, by) for by in ("own", "other")}
        self._per_token = TIME_PER_OUTPUT_TOKEN.labels(model)
        self._batch = BATCH_SIZE.labels(model)
        self._resumed = RESUMED_TOKENS.labels(model)  # bound now: exported at 0 before any resume

    def taken(self, job: Job, redis_now: float, offer: Optional[str] = None) -> None:
        """`redis_now`: Redis' time at its taking, the clock its enqueued_at was read from.
        `offer`: whose offer it was (JobQueue.offer_taken_by: "own", "other"; None: not an offer's wait)."""
        waited = clock.queue_wait(job.enqueued_at, redis_now)
        if waited is not None:
            self._wait.observe(waited)
            if offer:
                self._offer_wait[offer].observe(waited)

    def resumed(self, tokens: int) -> None:
        self._resumed.inc(tokens)

    def stepped(self, batch: int) -> None:
        if batch:
            self._batch.observe(batch)

    def finished(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            tokens = len(seq.output_ids) - seq.resumed  # written here
            if seq.finish_reason in FINISHED_NORMALLY and tokens > 1:
                self._per_token.observe((now - seq.first_token_at) / (tokens - 1))


class EngineCollector:
    """The engine's and the job queue's running counts, read at scrape time (`Engine.stats()`: a
    key an engine lacks, the static engine's KV cache, is left out)."""

    GAUGES = [("running", names.RUNNING, "Sequences in the running batch"),
              ("waiting", names.WAITING, "Sequences taken by the worker, not yet running"),
              ("kv_usage", names.KV_CACHE_USAGE, "KV-cache blocks in use / blocks in the pool")]
    COUNTERS = [("preempted", names.PREEMPTIONS, "Running sequences set back for lack of KV cache"),
                ("prefix_hit_blocks", names.PREFIX_CACHE_HITS, "Prompt KV blocks found in the cache"),
                ("prefix_hit_tokens", names.PREFIX_CACHE_HIT_TOKENS, "Prompt tokens found in the cache"),
                ("generated", names.GENERATED_TOKENS, "Tokens the engine wrote"),
                ("forced", names.FORCED_TOKENS, "Tokens a grammar forced, written without a step of their own")]

    def __init__(self, model: str, engine: Engine, requeued: Tally, crashed: Tally, left: Tally = None,
                 offers: Tally = None):
        self.model, self.engine = model, engine
        # By model: JobQueue's tallies.
        self.requeued, self.crashed, self.left = requeued, crashed, Tally() if left is None else left
        self.offers = Tally() if offers is None else offers  # JobQueue.offers: "own", "other"

    def collect(self):
        stats = self.engine.stats()
        for key, name, help_text in self.GAUGES:
            if key in stats:
                yield _one(GaugeMetricFamily(name, help_text, labels=["model"]), self.model, stats[key])
        for key, name, help_text in self.COUNTERS:
            if key in stats:
                yield _one(CounterMetricFamily(name, help_text, labels=["model"]), self.model, stats[key])
        # Put back or failed by this worker, for whichever worker died: labelled by the jobs' model.
        # Its own model always, at 0 too, so that a rate over it is 0 rather than nothing.
        for tally, name, help_text in [(self.requeued, names.REQUEUED_JOBS, "Jobs of dead workers put back"),
                                       (self.crashed, names.CRASHED_JOBS, "Jobs failed after --max-attempts"),
                                       (self.left, names.LEFT_FOR_SAME_NUMERICS, "Requeued jobs passed over for "
                                        "a moment, for a live worker of their dead worker's numerics")]:
            family = CounterMetricFamily(name, help_text, labels=["model"])
            for model in sorted({self.model, *tally}):
                family.add_metric([model], tally[model])
            yield family
        family = CounterMetricFamily(names.OFFERED_JOBS, "Jobs offered to the worker holding their conversation, "
                                     "taken by it (own) or by this one once the offer lapsed (other)",
                                     labels=["model", "taken_by"])
        for taken_by in ("own", "other"):
            family.add_metric([self.model, taken_by], self.offers[taken_by])
        yield family


def _one(family, model: str, value):
    family.add_metric([model], value)
    return family


def serve(port: int, collector: EngineCollector, host: str = "127.0.0.1") -> None:
    """Serve /metrics on `host`:`port` (--metrics-host: 0.0.0.0 in a container, whose port is
    published from there)."""
    REGISTRY.register(collector)
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise SystemExit(f"worker: --metrics-port {port}: {exc.strerror}")
    log.info("metrics on %s:%d/metrics", host, port)
