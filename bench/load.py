"""Crowd load test: N players ask the storyteller for stories at the same time.

Run from the project root:  python -m bench.load --players 1 4 16 64
Other scripts can import run_crowd / write_results / plot to compare servers.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

WORDS = ("sword", "gate", "skeleton", "dragon", "castle", "forest", "potion", "wizard",
         "goblin", "treasure", "map", "tavern", "knight", "shield", "dungeon", "elf",
         "troll", "scroll", "amulet", "bow", "ghost", "river", "tower", "crown")
WARMUP_TOKENS = 8
MAX_ERROR_SAMPLES = 5
# Everything a request can fail with: URLError/HTTPError/timeouts/resets are
# OSErrors, truncated bodies are HTTPExceptions, bad JSON is a ValueError.
REQUEST_ERRORS = (OSError, http.client.HTTPException, ValueError, KeyError, TypeError)
COLUMNS = ("players", "ok", "errors", "wall s", "tok/s", "median s", "p95 s", "ms/tok")


def make_prompt(rng: random.Random) -> str:
    words = [("an " if w[0] in "aeiou" else "a ") + w for w in rng.sample(WORDS, 3)]
    return f"Write a short story about {words[0]}, {words[1]} and {words[2]}.\n"


def describe_error(exc: BaseException) -> str:
    # HTTPError is a URLError, so it must be checked first to keep its status.
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = json.loads(exc.read())
            message = body.get("error", {}).get("message") or body.get("detail") or body
        except Exception:  # a non-JSON error page: the reason phrase will do
            message = exc.reason
        return f"HTTP {exc.code}: {message}"
    if isinstance(exc, urllib.error.URLError):
        return f"connection failed: {exc.reason}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return f"bad response: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def get_first_model(url: str, timeout: float = 10) -> str | None:
    """The first model id the server lists, or None if it lists none."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/models", timeout=timeout) as resp:
        models = json.loads(resp.read()).get("data") or []
    return models[0]["id"] if models else None


def complete(url: str, model: str, prompt: str, tokens: int, temperature: float,
             ignore_eos: bool, timeout: float) -> tuple[float, int]:
    """One completion; returns (seconds, completion_tokens) or raises."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens,
            "temperature": temperature, "ignore_eos": ignore_eos}
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply = json.loads(resp.read())
    # Stop the clock only after the whole body is read: that is what a player waits for.
    return time.perf_counter() - start, int(reply["usage"]["completion_tokens"])


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile: the smallest value that at least 95% of
    the requests finished within (with few samples this is the maximum)."""
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def run_crowd(url: str, model: str, players: int, requests: int = 4, tokens: int = 100, *,
              temperature: float = 0.8, ignore_eos: bool = True, timeout: float = 600,
              seed: int = 0, progress: bool = True) -> dict:
    """Let `players` threads each send `requests` completions back to back and
    return one row of results (latencies in seconds, None if nothing succeeded)."""
    url, lock, go = url.rstrip("/"), threading.Lock(), threading.Event()
    done: list[tuple[float, int]] = []  # (seconds, completion tokens) per ok request
    errors: list[str] = []
    bar = tqdm(total=players * requests, desc=f"{players} players", unit="req",
               file=sys.stderr, leave=False, disable=not progress)

    def player(index: int) -> None:
        rng = random.Random(seed + index)
        go.wait()
        for _ in range(requests):
            try:
                result = complete(url, model, make_prompt(rng), tokens, temperature,
                                  ignore_eos, timeout)
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
    seconds = time.perf_counter() - start

    latencies = [s for s, _ in done]
    per_token = [s / n for s, n in done if n > 0]
    total_tokens = sum(n for _, n in done)
    def stat(func, values, digits):  # None, not a crash, when every request failed
        return round(func(values), digits) if values else None

    return {"players": players, "requests": len(done), "errors": len(errors),
            "seconds": round(seconds, 3), "tokens": total_tokens,
            "tokens_per_s": round(total_tokens / seconds, 2),
            "median_s": stat(statistics.median, latencies, 4),
            "p95_s": stat(p95, latencies, 4),
            # The slowest request explains a wall time far above p95 (one stalled request).
            "max_s": stat(max, latencies, 4),
            "median_s_per_token": stat(statistics.median, per_token, 5),
            "error_samples": list(dict.fromkeys(errors))[:MAX_ERROR_SAMPLES]}


def format_row(row: dict | None) -> str:
    if row is None:  # the header
        cells = COLUMNS
    else:
        def num(value, fmt):
            return "-" if value is None else format(value, fmt)
        ms_tok = row["median_s_per_token"] and row["median_s_per_token"] * 1000
        cells = (row["players"], row["requests"], row["errors"], num(row["seconds"], ".2f"),
                 num(row["tokens_per_s"], ".1f"), num(row["median_s"], ".3f"),
                 num(row["p95_s"], ".3f"), num(ms_tok, ".1f"))
    return "  ".join(f"{c:>9}" for c in cells)


def load_runs(path: str | Path) -> list[dict]:
    path = Path(path)
    return json.loads(path.read_text())["runs"] if path.exists() else []


def merge_run(runs: list[dict], run: dict) -> list[dict]:
    """Replace any run with the same label, so re-running a config updates it."""
    return [r for r in runs if r["label"] != run["label"]] + [run]


def write_results(runs: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


def plot(runs: list[dict], path: str | Path) -> None:
    # Imported here so scripts that only run crowds don't pay for matplotlib.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        rows = [r for r in run["rows"] if r["median_s"] is not None]
        xs = [r["players"] for r in rows]
        ax_tps.plot(xs, [r["tokens_per_s"] for r in rows], "o-", color=colour, label=run["label"])
        ax_lat.plot(xs, [r["median_s"] for r in rows], "o-", color=colour, label=run["label"])
        ax_lat.plot(xs, [r["p95_s"] for r in rows], "s--", color=colour, alpha=0.7)

    ticks = sorted({r["players"] for run in runs for r in run["rows"]})
    for ax, title, ylabel in ((ax_tps, "Throughput", "output tokens / s (all players)"),
                              (ax_lat, "Request latency", "seconds per request")):
        ax.set(title=title, ylabel=ylabel, xlabel="players (concurrent clients)")
        ax.set_xscale("log", base=2)
        # Label exactly the crowd sizes measured, not powers of two matplotlib picks.
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
    ax_tps.set_ylim(bottom=0)
    # Waits range from seconds to minutes between configurations: a log scale shows both.
    ax_lat.set_yscale("log")
    ax_tps.legend(title="run")
    # Colour says which run, line style says which statistic; say so once in the legend.
    handles, _ = ax_lat.get_legend_handles_labels()
    handles += [Line2D([], [], color="grey", ls="-", label="median"),
                Line2D([], [], color="grey", ls="--", label="p95")]
    ax_lat.legend(handles=handles)
    if runs:
        desc = {f"{r['tokens']} tokens x {r['requests']} requests per player" for r in runs}
        fig.suptitle("Storyteller crowd load: " + "; ".join(sorted(desc)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API base URL")
    ap.add_argument("--model", help="model id (default: first from GET {url}/models)")
    ap.add_argument("--players", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens per request")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="ask for exactly --tokens tokens so every config does equal work")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--label", default="server", help="name of this configuration")
    ap.add_argument("--out", default="bench/results/load", help="writes <out>.json and <out>.png")
    ap.add_argument("--append", action="store_true",
                    help="add to <out>.json (replacing a run with the same label)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
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
    run = {"label": args.label, "url": url, "model": model, "tokens": args.tokens,
           "requests": args.requests, "ignore_eos": args.ignore_eos,
           "temperature": args.temperature, "rows": []}
    print(f"# {args.label}: {model} at {url}, {args.requests} requests x "
          f"{args.tokens} tokens per player")
    print(format_row(None), flush=True)
    interrupted = False
    try:
        for players in args.players:
            row = run_crowd(url, model, players, args.requests, args.tokens,
                            temperature=args.temperature, ignore_eos=args.ignore_eos,
                            timeout=args.timeout, seed=args.seed)
            run["rows"].append(row)
            print(format_row(row), flush=True)
            for message in row["error_samples"]:
                print(f"    error: {message}", flush=True)
            write_results(merge_run(previous, run), json_path)
    except KeyboardInterrupt:
        print("interrupted; keeping the crowds that finished", file=sys.stderr)
        interrupted = True
    runs = merge_run(previous, run)
    if run["rows"]:
        write_results(runs, json_path)
        plot(runs, png_path)
        print(f"wrote {json_path} and {png_path}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the crowds start: no traceback
        sys.exit(130)
