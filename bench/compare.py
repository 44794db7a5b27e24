"""Batched against one-at-a-time, in one run: the same crowds against a worker per --batch value.

For each batch size this starts a private redis-server, the API and one worker with that batch
size, runs the crowds of bench.load against it, and stops them; then it prints each crowd's
tokens/s as a ratio to the first batch size, and writes JSON and a chart of all runs.

    python -m bench.compare --batches 1 16 64 --players 1 4 16 64 --out docs/serving
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.load import format_row, plot, run_crowd, write_results
from serve import free_port, wait_until_served


@contextmanager
def stack(batch: int, model: str, wait_ms: float, logs: Path):
    """A private redis-server, the API and one worker; yields the API's base URL and model name."""
    redis_port, api_port = free_port(), free_port()
    # One at a time, the last of 64 players x 4 requests waits ~20 minutes: the default request
    # timeout (5 minutes) would turn that wait into errors, and throughput is what is measured.
    env = dict(os.environ, REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", PORT=str(api_port),
               MODEL=model, BATCH=str(batch), WAIT_MS=str(wait_ms), REQUEST_TIMEOUT="3600")
    logs.mkdir(parents=True, exist_ok=True)
    commands = [[shutil.which("redis-server") or sys.exit("redis-server is needed"), "--port",
                 str(redis_port), "--save", "", "--appendonly", "no"],
                [sys.executable, "-m", "api"], [sys.executable, "-m", "worker"]]
    processes = []
    try:
        for name, command in zip(("redis", "api", "worker"), commands):
            log = open(logs / f"batch{batch}-{name}.log", "w")
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.3)
        url = f"http://127.0.0.1:{api_port}/v1"
        yield url, wait_until_served(url, processes)[0]
    finally:
        for process in reversed(processes):  # the worker first, Redis last
            process.terminate()
            process.wait(60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--players", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens per request (ignore_eos)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--wait", type=float, default=5.0, help="worker --wait, ms")
    ap.add_argument("--out", default="bench/results/compare", help="writes <out>.json and <out>.png")
    args = ap.parse_args(argv)

    runs = []
    for batch in args.batches:
        with stack(batch, args.model, args.wait, Path("bench/results/logs")) as (url, model):
            run = {"label": f"--batch {batch}", "batch": batch, "url": url, "model": model,
                   "tokens": args.tokens, "requests": args.requests, "ignore_eos": True, "rows": []}
            run_crowd(url, model, 1, 1, 8, progress=False)  # warm-up: the first pass is slower
            print(f"# --batch {batch}: {model}, {args.requests} requests x {args.tokens} tokens per player")
            print(format_row(None), flush=True)
            for players in args.players:
                row = run_crowd(url, model, players, args.requests, args.tokens)
                run["rows"].append(row)
                print(format_row(row), flush=True)
            runs.append(run)

    base = runs[0]
    print(f"\ntokens/s as a multiple of {base['label']}")
    print(f"{'players':>9}" + "".join(f"{r['label']:>14}" for r in runs))
    for i, players in enumerate(args.players):
        ratios = [r["rows"][i]["tokens_per_s"] / base["rows"][i]["tokens_per_s"] for r in runs]
        for run, ratio in zip(runs, ratios):
            run["rows"][i]["ratio_to_first"] = round(ratio, 2)
        print(f"{players:>9}" + "".join(f"{x:>13.1f}x" for x in ratios))
    errors = sum(row["errors"] for run in runs for row in run["rows"])
    print(f"errors: {errors}")
    write_results(runs, args.out + ".json")
    plot(runs, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
