"""Soak: a crowd of players for minutes while workers are killed and Redis restarts; nothing may be lost.

    python -m bench.soak --duration 600            # 64 players, 2 workers of SmolLM2, ~11 minutes
    python -m bench.soak --model DIR --duration 120 --fault-every 30 --out /tmp/soak/reliability

A fresh stack of its own (bench/stack.py; the faults: bench/faults.py): a persistent redis-server
in a temporary directory, the API, and the workers. First a reference answer is taken for each distinct request, whole,
before any fault. Then the players send those requests for --duration seconds, some streamed,
some hanging up after a few chunks, while the faults happen on their schedule. Every request ends
answered, hung up on purpose, failed with a clear error, or lost (bench/soak_client.py).

Duplicated stream text is detected honestly: the workers decode greedily in float32 with the
int4 kernel off, where the continuous engine writes the same text whatever the batch, so every
answer must be its reference exactly, and a client that hung up must have received a prefix of
it. A worker that dies after streaming part of an answer, and a second one that writes it again
from the start, would show as a mismatch.

Output (bench/soak_report.py): the tables printed, <out>.json, <out>.png, and the soak's section
of --page. By default the data goes to docs/results/ and the section into docs/reliability.md, the
prose around it; with an --out of its own the page is <out>.md, beside the data, so a trial run
leaves the documents alone. Exit status 1 when anything was lost or a stream's text was unlike its
reference.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from bench.faults import FaultRunner, plan
from bench.prompts import RequestShape
from bench.soak_client import ANSWERED, FAILED, LOST, Attempt, compare, send
from bench.soak_report import passed, summarize, write
from bench.stack import Stack, StackError

PROGRESS_EVERY_S = 10
# The results live apart from the prose that reads them (docs/results/, docs/reliability.md).
OUT, PAGE = "docs/results/reliability", "docs/reliability.md"
REFERENCE_THREADS = 16


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds the players play (default 600)")
    ap.add_argument("--fault-every", type=float, default=60, help="seconds between worker kills (default 60)")
    ap.add_argument("--players", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face model directory")
    ap.add_argument("--distinct", type=int, default=48, help="distinct requests the players draw from")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(20, 600), metavar=("MIN", "MAX"),
                    help="half the requests have lore prompts of this many (approximate) tokens; "
                         "the other half the classic one-line request")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 160), metavar=("MIN", "MAX"))
    ap.add_argument("--stream-share", type=float, default=0.5, help="share of requests streamed")
    ap.add_argument("--hang-up-share", type=float, default=0.25,
                    help="share of the streamed requests whose client closes the stream early")
    ap.add_argument("--hang-up-chunks", type=int, default=4, help="they close it after 1 to this many chunks")
    ap.add_argument("--request-timeout", type=float, default=120,
                    help="the API's REQUEST_TIMEOUT: past it a request gets a clear 504")
    ap.add_argument("--client-timeout", type=float,
                    help="seconds a player waits before it calls a request lost (default: request "
                         "timeout + 30, so the server's own timeout always answers first)")
    ap.add_argument("--backoff", type=float, default=1.0,
                    help="seconds a player waits after a failed request, as a real client would")
    ap.add_argument("--redis-down", type=float, default=2.0, help="seconds Redis stays down in its restart")
    ap.add_argument("--dtype", default="float32", help="the workers' dtype (float32: batch-invariant text)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=OUT, help="writes <out>.json and <out>.png")
    ap.add_argument("--page", help="the Markdown page whose soak section is rewritten (default: "
                                   f"{PAGE} for the default --out, else <out>.md)")
    ap.add_argument("--logs", help="directory for the processes' logs (default: bench/results/soak-logs)")
    args = ap.parse_args(argv)
    args.client_timeout = args.client_timeout or args.request_timeout + 30
    args.page = args.page or (PAGE if args.out == OUT else args.out + ".md")
    return args


def make_pool(args) -> list[tuple[str, int]]:
    """The distinct (prompt, max_tokens) the players send: half one-line requests, half lore."""
    rng = random.Random(args.seed)
    shapes = [RequestShape(max_tokens=tuple(args.max_tokens)),
              RequestShape(max_tokens=tuple(args.max_tokens), prompt_tokens=tuple(args.prompt_tokens))]
    pool: dict[tuple[str, int], None] = {}
    while len(pool) < args.distinct:
        pool[shapes[len(pool) % 2].draw(rng)] = None
    return list(pool)


def take_references(stack: Stack, pool: list[tuple[str, int]], timeout: float) -> list[str]:
    """Each request's answer, whole, before any fault: what every later answer must be."""
    began = time.monotonic()

    def one(item: int) -> Attempt:
        prompt, max_tokens = pool[item]
        attempt = Attempt(player=-1, item=item, stream=False, hang_up_after=0, sent=time.monotonic() - began)
        return send(stack.url, stack.model, prompt, max_tokens, attempt, timeout, lambda: time.monotonic() - began)

    with ThreadPoolExecutor(REFERENCE_THREADS) as threads:
        answers = list(threads.map(one, range(len(pool))))
    bad = [a for a in answers if a.outcome != ANSWERED]
    if bad:
        raise SystemExit(f"{len(bad)} of {len(pool)} reference requests failed before any fault, e.g. "
                         f"{bad[0].detail!r} (prompt {len(pool[bad[0].item][0])} chars): choose "
                         f"--prompt-tokens / --max-tokens the model's context window holds")
    return [a.text for a in answers]


def play(stack: Stack, pool, args, clock) -> list[Attempt]:
    """Every player sends requests back to back until --duration; returns every attempt."""
    attempts: list[Attempt] = []
    lock = threading.Lock()

    def player(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        while clock() < args.duration:
            item = rng.randrange(len(pool))
            stream = rng.random() < args.stream_share
            hang_up = rng.randint(1, args.hang_up_chunks) if stream and rng.random() < args.hang_up_share else 0
            prompt, max_tokens = pool[item]
            attempt = send(stack.url, stack.model, prompt, max_tokens,
                           Attempt(index, item, stream, hang_up, sent=clock()), args.client_timeout, clock)
            with lock:
                attempts.append(attempt)
            if attempt.outcome in (FAILED, LOST):
                time.sleep(args.backoff)

    threads = [threading.Thread(target=player, args=(i,), daemon=True) for i in range(args.players)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        time.sleep(PROGRESS_EVERY_S)
        with lock:
            outcomes = [a.outcome for a in attempts]
        print(f"[{clock():6.1f} s] {len(outcomes)} done: {outcomes.count(ANSWERED)} answered, "
              f"{outcomes.count(FAILED)} failed, {outcomes.count(LOST)} lost; "
              f"{len(stack.live_workers())} worker(s) alive", flush=True)
    return attempts


def main(argv=None) -> int:
    args = parse(argv)
    faults = plan(args.duration, args.fault_every)
    pool = make_pool(args)
    logs = Path(args.logs or "bench/results/soak-logs")
    env = {"DTYPE": args.dtype, "INT4_ROWS": "0", "INT4_HEAD": "0", "REQUEST_TIMEOUT": str(args.request_timeout),
           # Workers on one machine share its cores (as serve.py splits them).
           "TORCH_THREADS": os.environ.get("TORCH_THREADS") or str(max(1, (os.cpu_count() or 1) // args.workers))}
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"soak: {args.players} players for {args.duration:g} s against {args.workers} worker(s) of "
          f"{args.model}; faults at " + ", ".join(f"{f.at:g} s ({f.kind})" for f in faults) +
          f"; logs in {logs}", flush=True)
    with tempfile.TemporaryDirectory(prefix="storyteller-soak-") as data:
        stack = Stack(env, args.model, logs, "soak", args.workers, data_dir=Path(data))
        try:
            try:
                stack.start()
            except StackError as exc:
                raise SystemExit(f"the soak's stack did not start: {exc}") from None
            print(f"stack up at {stack.url} ({stack.model}); taking {len(pool)} references", flush=True)
            references = take_references(stack, pool, args.client_timeout)
            zero = time.monotonic()
            clock = lambda: time.monotonic() - zero  # noqa: E731 (the soak's one clock)
            runner = FaultRunner(stack, faults, clock, args.redis_down)
            runner.start()
            attempts = play(stack, pool, args, clock)
            runner.join()
            # Whatever is still queued or held once every player has its answer was abandoned.
            leftover = {"queued_after": stack.queued(), "processing_after": stack.processing()}
        finally:
            stack.close()
    for attempt in attempts:
        compare(attempt, references[attempt.item])
    config = {"started": started, "model": stack.model, "workers": args.workers, "players": args.players,
              "duration": args.duration, "fault_every": args.fault_every, "distinct": len(pool),
              "prompts": "one line or ~{}-{} tokens".format(*args.prompt_tokens),
              "max_tokens": "{}-{}".format(*args.max_tokens), "dtype": args.dtype,
              "stream_share": args.stream_share, "hang_up_share": args.hang_up_share,
              "hang_up_chunks": args.hang_up_chunks, "request_timeout": args.request_timeout,
              "client_timeout": args.client_timeout, "redis_down_s": args.redis_down, "seed": args.seed}
    summary = summarize(attempts, [f.to_dict() for f in faults], config,
                        {**leftover, "fault_errors": runner.errors})
    print("\n" + write(summary, Path(args.out), Path(args.page)))
    print(f"wrote {args.out}.json, {args.out}.png and the soak's section of {args.page}", flush=True)
    for error in runner.errors:
        print(f"fault not done as planned: {error}", file=sys.stderr)
    return 0 if passed(summary) and not runner.errors else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
