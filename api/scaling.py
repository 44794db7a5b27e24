"""python -m api.scaling: each model's load as Redis has it, and how many workers it wants.

For every model with a worker (or one seen in the last day), it prints:
  queued     jobs waiting, summed over the model's priority queues (one Redis list per priority)
  oldest     how long the job that has waited longest has waited, in Redis' clock (the jobs'
             enqueued_at is Redis' TIME, so no host's clock is compared with Redis')
  held       jobs in the workers' processing lists: taken, being written
  workers    workers with a live heartbeat taking jobs (+ those draining: stopping)
  suggested  the worker count for this load:

    suggested = clamp(ceil((queued + held) / per_worker), min, max)
    and, while the oldest job has waited over --max-wait, at least one more than are live.

`per_worker` is the jobs one worker should carry at once: what it holds plus what waits for it. The
queue alone is the wrong measure: a worker takes every job its next step can start, so jobs wait
in Redis only once every worker is full, and a count sized on the queue alone would fall to the
minimum as soon as the workers keep up, then climb again. The age rule catches what counting jobs
misses: few jobs, but long ones, on workers slower than the count assumes.

    python -m api.scaling                         # a table, once
    python -m api.scaling --json --watch 5        # a JSON line every 5 s
    python -m api.scaling --model M --suggested   # just the number, for a script (docs/scaling.md)

It only reads (no key is written), so it may run anywhere REDIS_URL reaches, as often as wanted:
one round costs 3 + 2 per worker + 42 per model commands, in three round trips (with a Redis
Cluster, a TIME per model too: each node has its own clock, and a model's jobs carry its node's).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import redis

# A model whose workers have all gone is listed as long as /metrics lists it (a day after its last
# heartbeat): "no worker" is then a 0 that a scaler can act on, not a gap.
from api.metrics import MODEL_MEMORY_S
from shared import keys
from shared.protocol import PRIORITIES, WorkerInfo
from shared.redis_client import connect, explain, is_cluster_client, masked, server_time
from shared.settings import Settings

TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Policy:
    """The rule's knobs (see the module's docstring)."""
    per_worker: int = 32  # jobs (held + waiting) one worker should carry
    min_workers: int = 1
    max_workers: int = 10
    max_wait_s: float = 30.0  # 0: no age rule

    def __post_init__(self):
        if self.per_worker < 1:
            raise ValueError("per_worker must be at least 1")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError("need 0 <= min_workers <= max_workers")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must be 0 (off) or more")


@dataclass
class ModelLoad:
    model: str
    queued: int = 0
    by_priority: dict[int, int] = field(default_factory=dict)  # only the non-empty queues
    oldest_age_s: float = 0.0  # 0: nothing waits
    held: int = 0
    workers: int = 0  # live and taking jobs
    draining: int = 0  # live, finishing what they hold, taking nothing new
    suggested: Optional[int] = None

    def as_json(self) -> dict:
        data = asdict(self)
        data["by_priority"] = {str(p): n for p, n in self.by_priority.items()}
        return data


def suggest(load: ModelLoad, policy: Policy) -> int:
    """The worker count for `load` under `policy` (the rule in the module's docstring)."""
    wanted = math.ceil((load.queued + load.held) / policy.per_worker)
    if policy.max_wait_s and load.oldest_age_s > policy.max_wait_s:
        wanted = max(wanted, load.workers + 1)
    return min(policy.max_workers, max(policy.min_workers, wanted))


def read(client: redis.Redis, policy: Policy = Policy()) -> tuple[float, list[ModelLoad]]:
    """Redis' time and every model's load, each with its suggested worker count."""
    now = _time(client, keys.MODELS)
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(keys.MODELS, "-inf", "+inf", withscores=True)
    pipe.hgetall(keys.WORKERS)
    seen, registered = pipe.execute()
    workers = {wid.decode(): model.decode() for wid, model in registered.items()}
    models = sorted({m.decode() for m, beat in seen if beat >= now - MODEL_MEMORY_S} | set(workers.values()))
    # A cluster's nodes each keep their own clock: a model's jobs were stamped by its queue's node.
    clocks = ({model: _time(client, keys.queue(model)) for model in models} if is_cluster_client(client)
              else dict.fromkeys(models, now))

    pipe = client.pipeline(transaction=False)
    for worker_id, model in workers.items():
        pipe.get(keys.heartbeat(model, worker_id))
        # A dead worker's jobs count too: the next live worker's heartbeat puts them back in the queue.
        pipe.llen(keys.processing(model, worker_id))
    for model in models:
        for queue in keys.queues(model):
            pipe.llen(queue)
            pipe.lindex(queue, 0)  # the head: the oldest job of that queue (FIFO, put-backs first)
    replies = iter(pipe.execute())

    loads = {model: ModelLoad(model) for model in models}
    for worker_id, model in workers.items():
        beat, held = next(replies), next(replies)
        load = loads[model]
        load.held += held
        if beat is not None:
            if _draining(beat):
                load.draining += 1
            else:
                load.workers += 1
    for model in models:
        load, stamps = loads[model], []
        for priority in PRIORITIES:
            length, head = next(replies), next(replies)
            if length:
                load.queued += length
                load.by_priority[priority] = length
            if head is not None:
                stamps.append(_enqueued_at(head))
        stamped = [s for s in stamps if s > 0]
        load.oldest_age_s = round(max(0.0, clocks[model] - min(stamped)), 3) if stamped else 0.0
        load.suggested = suggest(load, policy)
    return now, [loads[m] for m in models]


def _time(client: redis.Redis, near: str) -> float:
    seconds, micros = server_time(client, near)
    return seconds + micros / 1e6


def _draining(beat: bytes) -> bool:
    try:
        return WorkerInfo.from_json(beat).draining
    except (ValueError, TypeError):  # a heartbeat of another version: alive, taking jobs
        return False


def _enqueued_at(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("enqueued_at") or 0.0)
    except (ValueError, TypeError, AttributeError):  # not a job of ours: it has no age to tell
        return 0.0


HEADER = ("model", "queued", "by priority", "oldest s", "held", "workers", "suggested")


def table(loads: list[ModelLoad]) -> str:
    rows = [HEADER]
    for load in loads:
        priorities = " ".join(f"{p}:{n}" for p, n in sorted(load.by_priority.items())) or "-"
        live = f"{load.workers}" + (f" (+{load.draining} draining)" if load.draining else "")
        rows.append((load.model, str(load.queued), priorities, f"{load.oldest_age_s:.1f}",
                     str(load.held), live, str(load.suggested)))
    if len(rows) == 1:
        return "no model has a worker (nor had one in the last day)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                               enumerate(zip(r, widths))) for r in rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m api.scaling", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Each model's queued jobs, oldest job's age, jobs held, live workers and a "
                    "suggested worker count, read from Redis.",
        epilog="suggested = clamp(ceil((queued + held) / --per-worker), --min, --max), and one more "
               "than the live workers while the oldest job has waited over --max-wait.")
    Settings.from_env().add_flags(ap, ["redis_url", "redis_cluster"])
    ap.add_argument("--model", help="only this model")
    ap.add_argument("--json", action="store_true", help="one JSON object per reading")
    ap.add_argument("--suggested", action="store_true",
                    help="print only the suggested worker count (one model: --model, or the only one)")
    ap.add_argument("--watch", type=float, metavar="SECONDS", help="read again every SECONDS")
    ap.add_argument("--rounds", type=int, default=0, help="with --watch: stop after this many (0: never)")
    defaults = Policy()
    ap.add_argument("--per-worker", type=int, default=defaults.per_worker,
                    help="jobs (held + waiting) one worker should carry (default %(default)s)")
    ap.add_argument("--min", dest="min_workers", type=int, default=defaults.min_workers,
                    help="fewest workers suggested (default %(default)s; 0 lets a model scale to zero)")
    ap.add_argument("--max", dest="max_workers", type=int, default=defaults.max_workers,
                    help="most workers suggested (default %(default)s)")
    ap.add_argument("--max-wait", dest="max_wait_s", type=float, default=defaults.max_wait_s,
                    help="seconds the oldest job may wait before one more worker is suggested "
                         "(default %(default)s; 0: off)")
    return ap


def render(now: float, loads: list[ModelLoad], args, policy: Policy) -> str:
    if args.suggested:
        if len(loads) != 1:
            named = ", ".join(load.model for load in loads) or "none"
            raise SystemExit(f"--suggested needs one model: name it with --model (models: {named})")
        return str(loads[0].suggested)
    if args.json:
        return json.dumps({"time": now, "policy": asdict(policy),
                           "models": [load.as_json() for load in loads]}, separators=(",", ":"))
    if args.watch is not None:  # rounds apart, each with its time (Redis' clock, UTC)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now))
        return f"# {stamp} UTC\n{table(loads)}\n"
    return table(loads)


def main(argv: Optional[list[str]] = None, client: Optional[redis.Redis] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        policy = Policy(args.per_worker, args.min_workers, args.max_workers, args.max_wait_s)
    except ValueError as exc:
        ap.error(str(exc))
    given = {name: getattr(args, name) for name in ("redis_url", "redis_cluster")
             if getattr(args, name) is not None}
    try:  # the environment, then the flags; REDIS_CLUSTER=1 makes the URL a cluster's
        url = replace(Settings.from_env(), **given).redis_url
    except ValueError as exc:
        ap.error(str(exc))
    client = client or connect(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
    rounds = 0
    while True:
        try:
            now, loads = read(client, policy)
        except redis.RedisError as exc:
            message = f"cannot read Redis at {masked(url)}: {explain(exc)}"
            if args.watch is None:
                raise SystemExit(message)
            print(message, file=sys.stderr, flush=True)  # watching: Redis may come back
        else:
            if args.model:
                # A model not seen yet is an empty one: the scaler may keep its minimum.
                loads = [next((ld for ld in loads if ld.model == args.model), None)
                         or _empty(args.model, policy)]
            print(render(now, loads, args, policy), flush=True)
        rounds += 1
        if args.watch is None or (args.rounds and rounds >= args.rounds):
            return 0
        time.sleep(args.watch)


def _empty(model: str, policy: Policy) -> ModelLoad:
    load = ModelLoad(model)
    load.suggested = suggest(load, policy)
    return load


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C ends a --watch: no traceback
        sys.exit(130)
