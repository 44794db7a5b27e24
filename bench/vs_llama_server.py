"""llama.cpp's llama-server and Storyteller side by side, in one run, on the same GGUF file.

Both are driven the same way: through their OpenAI HTTP APIs (/v1/completions), by the crowds of
bench.load (N players at once, each sending its requests back to back, EOS ignored so both write
exactly --tokens tokens a request: bench.client sends `ignore_eos`, a field llama-server reads
too). llama-server is the native build of bench.llama_cpp with 2 threads and 64 slots, each with
room for a prompt and its answer; Storyteller is a private stack (bench.stack) of one continuous
worker with its default settings. One machine, one run, one after the other: machines are noisy,
so compare the ratio, not numbers from different runs. Each crowd also records both servers'
resident memory (the worker's own report in its heartbeat; llama-server's /proc VmRSS), and a lone
player's crowd its share of the memory-bandwidth bound measured just before and after it, the
higher of the two (bench.bandwidth).

    python -m bench.vs_llama_server --shape smollm2-1.7b
    python -m bench.vs_llama_server --model-file my.Q4_K_M.gguf --players 1 16 --only llama
    python -m bench.vs_llama_server --shape smollm2-135m --players 1 4 --requests 2 --tokens 16

Writes <out>.json and <out>.png (default docs/results/vs-llama-server-<file stem>).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from bench import bandwidth, llama_cpp
from bench.client import get_first_model
from bench.load import run_crowd
from bench.report import cell, format_row, plot_crowds, write_json
from bench.row_kernels import cpu_name
from bench.stack import log_tail, stack, stop
from bench.stats import ratio
from serve import free_port
from shared.lifetime import dies_with_parent

LOGS = Path("bench/results/logs")
SLOTS = 64  # llama-server's --parallel: the largest crowd, each player a slot of its own
PROMPT_ROOM = 64  # tokens a slot keeps for the prompt: bench.load's prompts are ~20 tokens
SLACK = 32  # and a little more, so that no slot ever runs out of context mid-answer
THREADS = 2
START_TIMEOUT_S = 600  # a 1.7B file is read from a cold disk cache


def server_command(binary: Path, model: Path, port, tokens: int) -> list[str]:
    """llama-server with SLOTS slots, each `tokens` + room for its prompt: -c is the whole cache,
    split evenly among the slots."""
    context = SLOTS * (PROMPT_ROOM + tokens + SLACK)
    return [str(binary), "-m", str(model), "-t", str(THREADS), "--parallel", str(SLOTS), "-c", str(context),
            "--host", "127.0.0.1", "--port", str(port)]


def wait_for_health(url: str, process: subprocess.Popen, log: Path) -> None:
    """Until llama-server's /health says 200 (it answers 503 while it loads the model)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited ({process.returncode}):\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503: loading
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy within {START_TIMEOUT_S} s:\n{log_tail(log)}")


@contextmanager
def llama_server(model: Path, tokens: int):
    """A started llama-server on a free port: (its /v1 base URL, its process), stopped on the way out."""
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / "llama-server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(server_command(llama_cpp.llama_server(), model, port, tokens),
                                   stdout=out, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
    try:
        wait_for_health(f"http://127.0.0.1:{port}", process, log)
        yield f"http://127.0.0.1:{port}/v1", process
    finally:
        stop(process)


def vm_rss_mb(pid: int) -> int | None:
    """A process's resident memory (VmRSS) in MiB, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb >> 10


def worker_rss_mb(running) -> int | None:
    """The worker's resident memory as it reports it in its heartbeat's stats (rss_mb). The
    heartbeat is a second old at most: wait for one sent after the crowd ended."""
    time.sleep(1.5)
    reported = [(w.get("stats") or {}).get("rss_mb") for w in running.workers()]
    return next((r for r in reported if r is not None), None)


def warm_up(url: str, model: str, players: int, tokens: int) -> None:
    """Requests until both servers run at speed: a fresh server's first passes page its mmapped
    file in and allocate its buffers (llama-server's first request measured 100x slower than its
    third), and a crowd's first wide step its own. Alone first, then the largest crowd, once each."""
    run_crowd(url, model, 1, 3, tokens, progress=False)
    run_crowd(url, model, players, 1, 8, progress=False)


def crowds(label: str, url: str, model: str, args, rss) -> dict:
    """The crowds of args.players against one server, a row each, printed as they finish; `rss()`
    the server's resident memory, read after each crowd. A lone player's crowd comes with the
    bound measured just before and just after it, the server idle (bench.bandwidth): bandwidth
    varies by the hour on a shared machine, so the bound and the speed held against it come from
    the same minutes."""
    run = {"label": label, "url": url, "model": model, "tokens": args.tokens, "requests": args.requests,
           "ignore_eos": True, "rows": []}
    warm_up(url, model, max(args.players), args.tokens)
    print(f"# {label}: {args.requests} requests x {args.tokens} tokens per player")
    print(format_row(None) + f"  {'RSS MiB':>9}", flush=True)
    for players in args.players:
        before = bandwidth.bound(str(args.path), THREADS) if players == 1 else None
        row = run_crowd(url, model, players, args.requests, args.tokens)
        if before:
            # Measured again just after: a neighbour on a shared machine can halve the rate for a
            # minute (13 and 20 GB/s in one hour here), and a bound read in such a minute made a
            # player seem faster than the bound. The higher of the two is the ceiling held against.
            after = bandwidth.bound(str(args.path), THREADS)
            lone = max(before, after, key=lambda b: b["bound_tokens_per_s"])
            row["bound"] = {**lone, "before_gb_s": before["bandwidth_gb_s"], "after_gb_s": after["bandwidth_gb_s"],
                            "share": round(row["tokens_per_s"] / lone["bound_tokens_per_s"], 3)}
        row["rss_mb"] = rss()
        # The machine's load as the crowd ends: anything else on these 2 cores (a build) slows
        # both servers' thread pools 10x and more (measured here), and this shows when it ran.
        row["load_1min"] = round(os.getloadavg()[0], 2)
        run["rows"].append(row)
        print(format_row(row) + f"  {cell(row['rss_mb'], 'd'):>9}", flush=True)
        if before:
            b = row["bound"]
            print(f"  the bound: {b['bandwidth_gb_s']} GB/s (just before {b['before_gb_s']}, just after "
                  f"{b['after_gb_s']}) over {b['bytes_per_token'] / 1e9:.3f} GB a token, "
                  f"{b['bound_tokens_per_s']} tokens/s; this player wrote {b['share']:.0%} of it", flush=True)
    return run


def run_llama(path: Path, args) -> dict:
    with llama_server(path, args.tokens) as (url, process):
        run = crowds("llama-server", url, get_first_model(url) or path.stem, args, lambda: vm_rss_mb(process.pid))
        run["command"] = " ".join(server_command(Path("llama-server"), Path(path.name), "PORT", args.tokens))
        return run


def run_storyteller(path: Path, args) -> dict:
    env = {"ENGINE": "continuous", "KV_DTYPE": args.kv_dtype,
           **({"KV_MEMORY": str(args.kv_memory)} if args.kv_memory else {})}
    with stack(env, str(path), LOGS, "vs-llama-storyteller") as running:
        run = crowds("storyteller", running.url, running.model, args, lambda: worker_rss_mb(running))
        run["worker"] = running.workers()[0] if running.workers() else None
        return run


def side_by_side(runs: list[dict]) -> list[dict]:
    """A row per crowd: both servers' tokens/s and Storyteller's as a multiple of llama-server's."""
    by_label = {run["label"]: {row["players"]: row for row in run["rows"]} for run in runs}
    llama, ours = by_label.get("llama-server", {}), by_label.get("storyteller", {})
    rows = []
    for players in sorted(set(llama) | set(ours)):
        a, b = llama.get(players, {}), ours.get(players, {})
        rows.append({"players": players, "llama_tokens_per_s": a.get("tokens_per_s"),
                     "storyteller_tokens_per_s": b.get("tokens_per_s"),
                     "ratio": None if (r := ratio(b.get("tokens_per_s"), a.get("tokens_per_s"))) is None
                     else round(r, 3),
                     "llama_of_bound": (a.get("bound") or {}).get("share"),
                     "storyteller_of_bound": (b.get("bound") or {}).get("share"),
                     "llama_rss_mb": a.get("rss_mb"), "storyteller_rss_mb": b.get("rss_mb"),
                     "errors": a.get("errors", 0) + b.get("errors", 0)})
    return rows


def print_table(rows: list[dict]) -> None:
    header = ("players", "llama tok/s", "storyteller tok/s", "ratio", "llama of bound", "ours of bound",
              "llama RSS MiB", "worker RSS MiB")
    share = lambda s: "-" if s is None else f"{s:.0%}"  # noqa: E731
    print("\n" + "  ".join(f"{h:>17}" for h in header))
    for r in rows:
        cells = (r["players"], cell(r["llama_tokens_per_s"], ".1f"), cell(r["storyteller_tokens_per_s"], ".1f"),
                 "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", share(r["llama_of_bound"]),
                 share(r["storyteller_of_bound"]), cell(r["llama_rss_mb"], "d"), cell(r["storyteller_rss_mb"], "d"))
        print("  ".join(f"{c:>17}" for c in cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model-file", type=Path, help="a GGUF file (default: --shape's file)")
    which.add_argument("--shape", choices=llama_cpp.SHAPE_NAMES, default=llama_cpp.PACKAGED_SHAPE,
                       help="a Q4_K_M file made by bench.llama_cpp (made once if missing)")
    ap.add_argument("--players", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request (EOS ignored)")
    ap.add_argument("--only", choices=("both", "llama", "storyteller"), default="both")
    ap.add_argument("--kv-memory", type=int, default=0,
                    help="MiB of KV cache for Storyteller's worker (default: its own, 1 GiB). llama-server's "
                         "cache holds every slot's tokens; 1 GiB may hold fewer players' tokens")
    ap.add_argument("--kv-dtype", default="auto", help="Storyteller's KV cache element type (--kv-dtype: auto is "
                                                       "float16 where the engine computes in float32)")
    ap.add_argument("--out", help="writes <out>.json and <out>.png "
                                  "(default docs/results/vs-llama-server-<file stem>)")
    args = ap.parse_args(argv)
    if max(args.players) > SLOTS:
        ap.error(f"--players: at most {SLOTS} (llama-server's slots)")
    path = args.path = (args.model_file or llama_cpp.model_file(args.shape)).resolve()
    out = args.out or f"docs/results/vs-llama-server-{path.stem}"
    print(f"file: {path}", flush=True)

    runs = []
    if args.only in ("both", "llama"):
        runs.append(run_llama(path, args))
    if args.only in ("both", "storyteller"):
        runs.append(run_storyteller(path, args))
    rows = side_by_side(runs)
    print_table(rows)
    write_json(out + ".json", {"file": path.name, "shape": None if args.model_file else args.shape,
                               "machine": {"cpu": cpu_name(),
                                           "llama_cpp": f"llama-cpp-python {llama_cpp.gguf_files.CONVERTER_VERSION}"
                                                        f" vendored, GGML_NATIVE=ON, -t 2 ({llama_cpp.build_name()})"},
                               "storyteller_kv_memory_mib": args.kv_memory or None,
                               "storyteller_kv_dtype": args.kv_dtype, "rows": rows, "runs": runs})
    plot_crowds(runs, out + ".png")
    print(f"wrote {out}.json and {out}.png")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
