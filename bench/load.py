"""Crowd load test: N players ask the storyteller for stories at the same time.

Run from the project root:  python -m bench.load --players 1 4 16 64
Other benches import run_crowd to send a crowd; its rows are printed and drawn by bench.report.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from bench.client import (REQUEST_ERRORS, Outcome, complete, describe_error, get_first_model,
                          request)
from bench.prompts import WORDS, RequestShape, make_prompt  # noqa: F401 (this module's old API)
from bench.report import format_row, load_runs, merge_run, plot_crowds, write_runs
from bench.stats import gap_summary, gaps, p95, rounded

WARMUP_TOKENS = 8
MAX_ERROR_SAMPLES = 5


def summarize(players: int, outcomes: list[Outcome], errors: list[str], seconds: float,
              stream: bool = False) -> dict:
    """One row of results from a crowd's outcomes (latencies in seconds, gaps in ms; None where
    nothing succeeded). Tokens are the completion tokens the server reported, so a crowd that
    honours EOS is credited only with what it really wrote."""
    latencies = [o.seconds for o in outcomes]
    per_token = [o.seconds / o.completion_tokens for o in outcomes if o.completion_tokens > 0]
    prompt_tokens = [o.prompt_tokens for o in outcomes if o.prompt_tokens is not None]
    total_tokens = sum(o.completion_tokens for o in outcomes)
    row = {"players": players, "requests": len(outcomes), "errors": len(errors),
           "seconds": round(seconds, 3), "tokens": total_tokens,
           "tokens_per_s": round(total_tokens / seconds, 2) if seconds > 0 else None,
           "median_s": rounded(statistics.median, latencies, 4),
           "p95_s": rounded(p95, latencies, 4),
           # The slowest request explains a wall time far above p95 (one stalled request).
           "max_s": rounded(max, latencies, 4),
           "median_s_per_token": rounded(statistics.median, per_token, 5),
           "prompt_tokens_median": rounded(statistics.median, prompt_tokens, 1),
           "stream": stream,
           "error_samples": list(dict.fromkeys(errors))[:MAX_ERROR_SAMPLES]}
    if stream:
        ttfts = [o.ttft for o in outcomes if o.ttft is not None]
        row["ttft_median_s"] = rounded(statistics.median, ttfts, 4)
        row["ttft_p95_s"] = rounded(p95, ttfts, 4)
        # Gaps within each request only: the wait before a request's first token is its TTFT.
        row.update(gap_summary(g for o in outcomes for g in gaps(o.chunk_times)))
    return row


def run_crowd(url: str, model: str, players: int, requests: int = 4, tokens: int = 100, *,
              temperature: float = 0.8, ignore_eos: bool = True, timeout: float = 600,
              seed: int = 0, progress: bool = True, shape: RequestShape | None = None,
              stream: bool = False, extra=None) -> dict:
    """Let `players` threads each send `requests` completions back to back and return one row
    of results. Each request is drawn from `shape` (default: the classic short prompt and
    exactly `tokens` tokens), with player i's own random.Random(seed + i); `extra(rng)`, when
    given, draws more fields for it (bench/structured.py: one of its schemas)."""
    shape = shape or RequestShape.fixed(tokens)
    url, lock, go = url.rstrip("/"), threading.Lock(), threading.Event()
    done: list[Outcome] = []
    errors: list[str] = []
    bar = tqdm(total=players * requests, desc=f"{players} players", unit="req",
               file=sys.stderr, leave=False, disable=not progress)

    def player(index: int) -> None:
        rng = random.Random(seed + index)
        go.wait()
        for _ in range(requests):
            prompt, max_tokens = shape.draw(rng)
            fields = extra(rng) if extra else None
            try:
                result = request(url, model, prompt, max_tokens, temperature=temperature,
                                 ignore_eos=ignore_eos, timeout=timeout, stream=stream, extra=fields)
            except REQUEST_ERRORS as exc:
                with lock:
                    errors.append(describe_error(exc))
            else:
                with lock:
                    done.append(result)
            bar.update()

    # Daemon threads so Ctrl-C in the main thread ends the process at once.
    threads = [threading.Thread(target=player, args=(i,), daemon=True) for i in range(players)]
    for t in threads:
        t.start()
    # Release everyone together so the crowd really arrives at once.
    start = time.perf_counter()
    go.set()
    try:
        for t in threads:
            # A timed join keeps the main thread responsive to KeyboardInterrupt.
            while t.is_alive():
                t.join(0.2)
    finally:
        # Closing also silences the bar for players still running after Ctrl-C.
        bar.close()
    return summarize(players, done, errors, time.perf_counter() - start, stream)


def shape_from_args(args) -> RequestShape:
    tokens = tuple(args.max_tokens) if args.max_tokens else (args.tokens, args.tokens)
    return RequestShape(max_tokens=tokens,
                        prompt_tokens=tuple(args.prompt_tokens) if args.prompt_tokens else None,
                        system_tokens=args.system_prompt_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API base URL")
    ap.add_argument("--model", help="model id (default: first from GET {url}/models)")
    ap.add_argument("--players", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens of every request")
    ap.add_argument("--max-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="max_tokens drawn at random per request, instead of --tokens")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="prompts of a random length in this range, in approximate tokens "
                         "(default: a one-line request of ~20 tokens)")
    ap.add_argument("--system-prompt-tokens", type=int, default=0, metavar="N",
                    help="every prompt starts with the same ~N-token lore text (a shared prefix)")
    eos = ap.add_mutually_exclusive_group()
    eos.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                     help="ask for exactly max_tokens tokens so every config does equal work")
    eos.add_argument("--honor-eos", dest="ignore_eos", action="store_false",
                     help="let answers end at end-of-text (same as --no-ignore-eos); tokens/s "
                          "then counts the tokens really written")
    ap.add_argument("--stream", action="store_true",
                    help="stream the answers and report time to first token and the gaps "
                         "between chunks")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--label", default="server", help="name of this configuration")
    ap.add_argument("--out", default="bench/results/load", help="writes <out>.json and <out>.png")
    ap.add_argument("--append", action="store_true",
                    help="add to <out>.json (replacing a run with the same label)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0, help="player i draws its requests from seed + i")
    args = ap.parse_args(argv)
    try:
        shape = shape_from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    url = args.url.rstrip("/")
    json_path, png_path = Path(args.out + ".json"), Path(args.out + ".png")

    step = f"GET {url}/models"
    try:
        model = args.model or get_first_model(url)
        if not model:
            sys.exit(f"error: {url}/models lists no models; pass --model")
        step = f"warm-up POST {url}/completions"
        complete(url, model, "Tell a one-line story.\n", WARMUP_TOKENS, args.temperature,
                 args.ignore_eos, args.timeout)
    except REQUEST_ERRORS as exc:
        sys.exit(f"error: {step} failed ({describe_error(exc)}); is the server running?")

    # Read earlier runs once, then rewrite after every crowd so an interrupted
    # benchmark still leaves its finished rows on disk.
    previous = load_runs(json_path) if args.append else []
    low, high = shape.max_tokens
    run = {"label": args.label, "url": url, "model": model,
           "tokens": low if low == high else f"{low}-{high}", "requests": args.requests,
           "ignore_eos": args.ignore_eos, "temperature": args.temperature,
           "prompt_tokens": shape.prompt_tokens, "system_prompt_tokens": shape.system_tokens,
           "stream": args.stream, "seed": args.seed, "rows": []}
    print(f"# {args.label}: {model} at {url}, {args.requests} requests per player, "
          f"{shape.describe()}, EOS {'ignored' if args.ignore_eos else 'honoured'}"
          f"{', streamed' if args.stream else ''}")
    print(format_row(None, args.stream), flush=True)
    interrupted = False
    try:
        for players in args.players:
            row = run_crowd(url, model, players, args.requests, args.tokens,
                            temperature=args.temperature, ignore_eos=args.ignore_eos,
                            timeout=args.timeout, seed=args.seed, shape=shape,
                            stream=args.stream)
            run["rows"].append(row)
            print(format_row(row), flush=True)
            for message in row["error_samples"]:
                print(f"    error: {message}", flush=True)
            write_runs(merge_run(previous, run), json_path)
    except KeyboardInterrupt:
        print("interrupted; keeping the crowds that finished", file=sys.stderr)
        interrupted = True
    runs = merge_run(previous, run)
    if run["rows"]:
        write_runs(runs, json_path)
        plot_crowds(runs, png_path)
        print(f"wrote {json_path} and {png_path}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the crowds start: no traceback
        sys.exit(130)
