"""A long prompt arrives while players stream: how long do their streams stall?

16 players stream stories back to back. Once every one of them is reading tokens, we wait a
couple of seconds (the "before" period), then send one request with a ~2,000-token prompt. Until
its first token arrives its prompt is being prefilled (the "while" period); we keep watching for
as long again afterwards ("after"). Each player's gaps between chunks are sorted into those
periods. An engine that prefills the whole long prompt in one step stalls everyone for that step
(max gap >> median gap); one that splits the prefill into chunks, or keeps decoding alongside it,
does not. A static-batching engine does not stall the streams at all, but makes the long request
(and the players' next requests) wait for the running batch to finish: see its TTFTs.

    python -m bench.interference --url http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from bench.client import REQUEST_ERRORS, Outcome, describe_error, get_first_model, stream_complete
from bench.prompts import make_prompt, sized_prompt
from bench.report import cell, write_json
from bench.stats import gap_summary, overlaps, ratio, rounded, timed_gaps

PERIODS = ("before", "while", "after")
READY_TIMEOUT_S = 600  # the players' first tokens: a slow CPU prefilling 16 prompts at once
MAX_ERROR_SAMPLES = 5


def round2(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 2)


def period_windows(ready: float, sent: float, first: float, stop: float) -> dict:
    """The periods, as (start, end) times: before the long request (once every player was
    streaming), while its prompt is prefilled (until its first token), and after."""
    return {"before": (ready, sent), "while": (sent, first), "after": (first, stop)}


def classify_gaps(streams: list[list[float]], windows: dict) -> dict[str, list[float]]:
    """Each gap between chunks of each stream, in seconds, sorted into the periods.

    A gap that overlaps the "while" window counts there even if it began before or ended after
    it: the stall a prefill causes straddles its edges. Other gaps count in "before" or "after"
    only if they lie wholly inside it, so a period holds no gap that also belongs to another.
    """
    out: dict[str, list[float]] = {name: [] for name in PERIODS}
    for times in streams:
        for span in timed_gaps(times):
            if overlaps(span, windows["while"]):
                out["while"].append(span[1] - span[0])
            else:
                for name in ("before", "after"):
                    start, end = windows[name]
                    if start <= span[0] and span[1] <= end:
                        out[name].append(span[1] - span[0])
    return out


def run_interference(url: str, model: str, players: int = 16, tokens: int = 100, *,
                     long_prompt_tokens: int = 2000, long_max_tokens: int = 16,
                     delay: float = 2.0, temperature: float = 0.8, timeout: float = 600,
                     seed: int = 0, log=print) -> dict:
    """Run the scenario once; return its periods' gap statistics and the long request's timings.
    `log` gets a line at each step (None: quiet)."""
    say = log or (lambda *_: None)
    url, lock, stop = url.rstrip("/"), threading.Lock(), threading.Event()
    outcomes: list[Outcome] = []
    errors: list[str] = []
    started: set[int] = set()  # players that have read a token (or failed trying)
    everyone_started = threading.Event()

    def mark_started(index: int) -> None:
        with lock:
            started.add(index)
            if len(started) == players:
                everyone_started.set()

    def player(index: int) -> None:
        rng = random.Random(seed + index)
        while not stop.is_set():
            try:
                outcome = stream_complete(url, model, make_prompt(rng), tokens, temperature, True,
                                          timeout, stop)
            except REQUEST_ERRORS as exc:
                with lock:
                    errors.append(describe_error(exc))
                mark_started(index)
                time.sleep(0.5)  # a server that fails at once must not be hammered in a loop
                continue
            with lock:
                outcomes.append(outcome)
            if outcome.chunk_times:
                mark_started(index)

    threads = [threading.Thread(target=player, args=(i,), daemon=True) for i in range(players)]
    begin = time.perf_counter()
    for t in threads:
        t.start()
    say(f"  {players} players streaming {tokens}-token stories back to back...")
    everyone_started.wait(READY_TIMEOUT_S)
    ready = time.perf_counter()
    time.sleep(delay)

    long_prompt = sized_prompt(random.Random(seed - 1), long_prompt_tokens)
    say(f"  +{time.perf_counter() - begin:.1f} s: sending a ~{long_prompt_tokens}-token prompt")
    sent = time.perf_counter()
    long: Optional[Outcome] = None
    long_error = None
    try:
        long = stream_complete(url, model, long_prompt, long_max_tokens, temperature, True, timeout)
    except REQUEST_ERRORS as exc:
        long_error = describe_error(exc)
    first = long.chunk_times[0] if long and long.chunk_times else time.perf_counter()
    say(f"  +{first - begin:.1f} s: its first token" if long and long.chunk_times else
        f"  the long request failed: {long_error}")
    # Watch the recovery for as long as the calm before (at least a second).
    time.sleep(max(delay, 1.0))
    end = time.perf_counter()
    stop.set()
    for t in threads:
        while t.is_alive():
            t.join(0.2)

    windows = period_windows(ready, sent, first, end)
    gaps = classify_gaps([o.chunk_times for o in outcomes], windows)
    periods = {}
    for name in PERIODS:
        summary = gap_summary(gaps[name])
        summary["seconds"] = round(windows[name][1] - windows[name][0], 3)
        summary["max_over_median"] = round2(ratio(summary["gap_max_ms"],
                                                  summary["gap_median_ms"]))
        periods[name] = summary
    # Players' requests that were sent while the long prompt was waiting or being prefilled:
    # static batching makes these wait too, which no gap shows.
    ttfts = [o.ttft for o in outcomes if o.ttft is not None and sent <= o.sent_at <= first]
    before_median = periods["before"]["gap_median_ms"]
    return {"players": players, "tokens": tokens, "long_prompt_tokens": long_prompt_tokens,
            "long_max_tokens": long_max_tokens, "delay_s": delay,
            "long_prompt_tokens_reported": long.prompt_tokens if long else None,
            "long_ttft_s": round(long.ttft, 4) if long and long.ttft is not None else None,
            "long_seconds": round(long.seconds, 4) if long else None,
            "long_error": long_error,
            "periods": periods,
            # The headline: the worst stall during the prefill against a normal gap before it.
            "stall_ratio": round2(ratio(periods["while"]["gap_max_ms"], before_median)),
            "player_ttft_while_count": len(ttfts),
            "player_ttft_while_max_s": rounded(max, ttfts, 4),
            "player_requests": len(outcomes), "errors": len(errors),
            "error_samples": list(dict.fromkeys(errors))[:MAX_ERROR_SAMPLES]}


def format_result(result: dict) -> str:
    lines = [f"{'period':>8}  {'seconds':>8}  {'gaps':>6}  {'median ms':>10}  {'p95 ms':>8}  "
             f"{'max ms':>8}  {'max/med':>8}"]
    for name in PERIODS:
        p = result["periods"][name]
        lines.append(f"{name:>8}  {cell(p['seconds'], '.2f'):>8}  {p['gap_count']:>6}  "
                     f"{cell(p['gap_median_ms'], '.1f'):>10}  {cell(p['gap_p95_ms'], '.1f'):>8}  "
                     f"{cell(p['gap_max_ms'], '.1f'):>8}  {cell(p['max_over_median'], '.1f'):>8}")
    lines.append(f"long prompt: {cell(result['long_prompt_tokens_reported'], 'd')} tokens, "
                 f"TTFT {cell(result['long_ttft_s'], '.2f')} s; worst stall while prefilling = "
                 f"{cell(result['stall_ratio'], '.1f')}x the median gap before; players' requests "
                 f"sent meanwhile: {result['player_ttft_while_count']}, max TTFT "
                 f"{cell(result['player_ttft_while_max_s'], '.2f')} s; errors {result['errors']}")
    lines += [f"    error: {e}" for e in result["error_samples"]]
    if result["long_error"]:
        lines.append(f"    long request error: {result['long_error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API base URL")
    ap.add_argument("--model", help="model id (default: first from GET {url}/models)")
    ap.add_argument("--players", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens of the players' requests")
    ap.add_argument("--long-prompt-tokens", type=int, default=2000)
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--delay", type=float, default=2.0,
                    help="seconds of streaming before the long prompt is sent")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/interference", help="writes <out>.json")
    args = ap.parse_args(argv)
    try:
        model = args.model or get_first_model(args.url)
    except REQUEST_ERRORS as exc:
        sys.exit(f"error: GET {args.url}/models failed ({describe_error(exc)})")
    result = run_interference(args.url, model, args.players, args.tokens,
                              long_prompt_tokens=args.long_prompt_tokens,
                              long_max_tokens=args.long_max_tokens, delay=args.delay,
                              timeout=args.timeout, seed=args.seed)
    print(format_result(result))
    path = Path(args.out + ".json")
    write_json(path, result)
    print(f"wrote {path}")
    return 1 if result["errors"] or result["long_error"] else 0


if __name__ == "__main__":
    sys.exit(main())
