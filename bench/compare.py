"""Batched against one-at-a-time, in one run: the same crowds against a worker per --batch value.

For each batch size this starts a private redis-server, the API and one worker with that batch
size, runs the crowds of bench.load against it, and stops them; then it prints each crowd's
tokens/s as a ratio to the first batch size, and writes JSON and a chart of all runs.

    python -m bench.compare --batches 1 16 64 --players 1 4 16 64 --out docs/results/serving
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.stack import stack
from bench.load import run_crowd
from bench.report import format_row, plot_crowds, write_runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--players", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens per request (ignore_eos)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--wait", type=float, default=5.0, help="worker --wait, ms")
    ap.add_argument("--engine", default="static",
                    help="worker ENGINE: this sweep of --batch was measured on the static one "
                         "(bench.engines compares engines)")
    ap.add_argument("--out", default="bench/results/compare", help="writes <out>.json and <out>.png")
    args = ap.parse_args(argv)

    runs = []
    for batch in args.batches:
        env = {"ENGINE": args.engine, "BATCH": str(batch), "WAIT_MS": str(args.wait)}
        with stack(env, args.model, Path("bench/results/logs"), f"{args.engine}-batch{batch}") as running:
            url, model = running.url, running.model
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
    write_runs(runs, args.out + ".json")
    plot_crowds(runs, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
