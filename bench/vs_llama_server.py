"""llama.cpp's llama-server and Storyteller side by side, in one run, on the same GGUF file.

Both are driven the same way: through their OpenAI HTTP APIs (/v1/completions), by the crowds of
bench.load (N players at once, each sending its requests back to back, EOS ignored so both write
exactly --tokens tokens a request: bench.client sends `ignore_eos`, a field llama-server reads
too). llama-server is the native build of bench.llama_cpp with 2 threads and 64 slots, each with
room for a prompt and its answer; Storyteller is a private stack (bench.stack) of one continuous
worker with its default settings. Both servers run side by side, and each crowd runs on one,
then on the other, --rounds times (the order swapped each round): a shared machine's memory
bandwidth moves by the minute, so the ratio of each round compares the same minutes, and the
table quotes the median of the rounds' ratios with their range. Each crowd also records both
servers' resident memory (the worker's own report in its heartbeat; llama-server's /proc VmRSS),
and a lone player's crowds their share of the memory-bandwidth bound measured just before and
after the pair, the higher of the two (bench.bandwidth).

    python -m bench.vs_llama_server --shape smollm2-1.7b
    python -m bench.vs_llama_server --shape qwen2.5-1.5b --players 1 --rounds 7
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench import bandwidth, llama_cpp
from bench.client import get_first_model
from bench.load import run_crowd
from bench.report import cell, format_row, plot_crowds, write_json
from bench.row_kernels import cpu_name
from bench.stack import log_tail, stack, stop
from bench.stats import median_of, ratio
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


@dataclass
class Server:
    """One of the two servers, started: where to send a crowd and how to read its memory."""
    label: str
    url: str
    model: str
    rss: Callable[[], int | None]
    about: dict


@contextmanager
def servers(path: Path, args):
    """The servers args.only names, started together and left running side by side: a crowd on
    one runs while the other is idle (llama-server's threads sleep between requests; the idle
    worker blocks on Redis)."""
    with ExitStack() as started:
        found = []
        if args.only in ("both", "llama"):
            url, process = started.enter_context(llama_server(path, args.tokens))
            command = " ".join(server_command(Path("llama-server"), Path(path.name), "PORT", args.tokens))
            found.append(Server("llama-server", url, get_first_model(url) or path.stem,
                                lambda: vm_rss_mb(process.pid), {"command": command}))
        if args.only in ("both", "storyteller"):
            env = {"ENGINE": "continuous", "KV_DTYPE": args.kv_dtype,
                   **({"KV_MEMORY": str(args.kv_memory)} if args.kv_memory else {})}
            running = started.enter_context(stack(env, str(path), LOGS, "vs-llama-storyteller"))
            found.append(Server("storyteller", running.url, running.model, lambda: worker_rss_mb(running),
                                {"worker": running.workers()[0] if running.workers() else None}))
        yield found


def rounds(found: list[Server], args) -> list[dict]:
    """Each crowd on each server in turn, args.rounds times, the servers' order swapped each
    round: on a shared machine the memory bandwidth moves by the minute (35 and 60 GB/s a minute
    apart on one VM), so two servers measured one after the other can differ by the minute more
    than by their code. A lone player's crowds come with the bound measured just before and
    just after the pair, the servers idle (bench.bandwidth); both players are held against the
    higher of the two. A run per server, its rows the median round's (median_row)."""
    runs = {s.label: {"label": s.label, "url": s.url, "model": s.model, "tokens": args.tokens,
                      "requests": args.requests, "ignore_eos": True, "rounds": [], **s.about} for s in found}
    for server in found:
        warm_up(server.url, server.model, max(args.players), args.tokens)
    print(f"# {args.rounds} round(s) of {args.requests} requests x {args.tokens} tokens per player", flush=True)
    print(f"{'server':>12}  {'round':>5}  " + format_row(None) + f"  {'RSS MiB':>9}", flush=True)
    for turn in range(args.rounds):
        order = found if turn % 2 == 0 else found[::-1]
        for players in args.players:
            before = bandwidth.bound(str(args.path), THREADS) if players == 1 else None
            rows = {s.label: run_crowd(s.url, s.model, players, args.requests, args.tokens) for s in order}
            if before:
                # A neighbour on a shared machine can halve the rate for a minute (13 and 20 GB/s
                # in one hour here): a bound read in such a minute made a player seem faster than
                # the bound. The higher reading is the ceiling held against.
                after = bandwidth.bound(str(args.path), THREADS)
                lone = max(before, after, key=lambda b: b["bound_tokens_per_s"])
                for row in rows.values():
                    row["bound"] = {**lone, "before_gb_s": before["bandwidth_gb_s"],
                                    "after_gb_s": after["bandwidth_gb_s"],
                                    "share": round(row["tokens_per_s"] / lone["bound_tokens_per_s"], 3)}
            for server in order:
                row = rows[server.label]
                row["round"] = turn + 1
                row["rss_mb"] = server.rss()
                # The machine's load as the crowd ends: anything else on these 2 cores (a build)
                # slows both servers' thread pools 10x and more (measured here).
                row["load_1min"] = round(os.getloadavg()[0], 2)
                runs[server.label]["rounds"].append(row)
                print(f"{server.label:>12}  {turn + 1:>5}  " + format_row(row) + f"  {cell(row['rss_mb'], 'd'):>9}",
                      flush=True)
            if before:
                b = next(iter(rows.values()))["bound"]
                print(f"  the bound: {b['bandwidth_gb_s']} GB/s (just before {b['before_gb_s']}, just after "
                      f"{b['after_gb_s']}) over {b['bytes_per_token'] / 1e9:.3f} GB a token, "
                      f"{b['bound_tokens_per_s']} tokens/s; "
                      + ", ".join(f"{label} wrote {r['bound']['share']:.0%}" for label, r in rows.items()), flush=True)
    for run in runs.values():
        run["rows"] = [median_row([r for r in run["rounds"] if r["players"] == p]) for p in args.players]
    return list(runs.values())


def median_row(rows: list[dict]) -> dict:
    """The round whose tokens/s is the median (the lower of the middle two), with every round's
    tokens/s and share of the bound beside it: a row some round really measured, not a blend."""
    middle = sorted(rows, key=lambda r: r["tokens_per_s"] or 0)[(len(rows) - 1) // 2]
    shares = [r["bound"]["share"] for r in rows if r.get("bound")]
    return {**middle, "tokens_per_s_rounds": [r["tokens_per_s"] for r in rows],
            **({"bound": {**middle["bound"], "share": median_of(shares), "share_rounds": shares}} if shares else {})}


def side_by_side(runs: list[dict]) -> list[dict]:
    """A row per crowd: both servers' median tokens/s, and Storyteller's as a multiple of
    llama-server's, the median of the rounds' ratios (each from the same minutes) with its range."""
    by_label = {run["label"]: run for run in runs}
    llama, ours = by_label.get("llama-server", {}), by_label.get("storyteller", {})
    medians = [{r["players"]: r for r in run.get("rows", [])} for run in (llama, ours)]
    rows = []
    for players in sorted(set(medians[0]) | set(medians[1])):
        a, b = (m.get(players, {}) for m in medians)
        ratios = [ratio(o["tokens_per_s"], l["tokens_per_s"])
                  for l in llama.get("rounds", []) for o in ours.get("rounds", [])
                  if l["players"] == o["players"] == players and l["round"] == o["round"]]
        ratios = [r for r in ratios if r is not None]
        rows.append({"players": players, "llama_tokens_per_s": a.get("tokens_per_s"),
                     "storyteller_tokens_per_s": b.get("tokens_per_s"),
                     "ratio": None if not ratios else round(median_of(ratios), 3),
                     "ratio_rounds": [round(r, 3) for r in ratios],
                     "llama_of_bound": (a.get("bound") or {}).get("share"),
                     "storyteller_of_bound": (b.get("bound") or {}).get("share"),
                     "llama_rss_mb": a.get("rss_mb"), "storyteller_rss_mb": b.get("rss_mb"),
                     "errors": sum(r["errors"] for run in (llama, ours) for r in run.get("rounds", [])
                                   if r["players"] == players)})
    return rows


def print_table(rows: list[dict]) -> None:
    """Medians over the rounds; the ratio's range over the rounds in brackets."""
    header = ("players", "llama tok/s", "storyteller tok/s", "ratio (range)", "llama of bound", "ours of bound",
              "llama RSS MiB", "worker RSS MiB")
    share = lambda s: "-" if s is None else f"{s:.0%}"  # noqa: E731
    print("\n" + "  ".join(f"{h:>17}" for h in header))
    for r in rows:
        spread = f" ({min(r['ratio_rounds']):.2f}-{max(r['ratio_rounds']):.2f})" if len(r["ratio_rounds"]) > 1 else ""
        cells = (r["players"], cell(r["llama_tokens_per_s"], ".1f"), cell(r["storyteller_tokens_per_s"], ".1f"),
                 "-" if r["ratio"] is None else f"{r['ratio']:.2f}x{spread}", share(r["llama_of_bound"]),
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
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each crowd runs on each server, in turn (the medians are reported)")
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

    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    with servers(path, args) as found:
        runs = rounds(found, args)
    rows = side_by_side(runs)
    print_table(rows)
    write_json(out + ".json", {"file": path.name, "shape": None if args.model_file else args.shape,
                               "machine": {"cpu": cpu_name(),
                                           "llama_cpp": f"llama-cpp-python {llama_cpp.gguf_files.CONVERTER_VERSION}"
                                                        f" vendored, GGML_NATIVE=ON, -t 2 ({llama_cpp.build_name()})"},
                               "storyteller_kv_memory_mib": args.kv_memory or None,
                               "storyteller_kv_dtype": args.kv_dtype, "rounds": args.rounds, "rows": rows, "runs": runs})
    plot_crowds(runs, out + ".png")
    print(f"wrote {out}.json and {out}.png")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
