"""What one request and one generated token cost Redis, measured, and what one Redis primary carries.

    python -m bench.redis_cost --out docs/results/redis-cost                      # tiny model, then redis-benchmark
    python -m bench.redis_cost --out docs/results/redis-cost --model smollm2 --part crowd   # adds SmolLM2's runs

1. Crowds. A private stack (bench.stack: redis-server, the API, one worker) serves a fixed crowd
   (--players × --requests completions of exactly T tokens, T from --tokens), whole and streamed.
   Around each crowd, INFO (commandstats, stats, cpu, memory) is read before and after: commands
   by name (those run inside Lua scripts included, as Redis counts them), bytes in and out, Redis'
   CPU. An idle window first gives the background (heartbeats, idle polls) per second, which is
   taken off each crowd. Two lengths T give, per mode, a cost per request and a cost per token
   (each quantity = a × requests + b × tokens, solved from the two crowds). Each crowd runs again
   under MONITOR (which slows Redis and adds to its output, so it is kept out of the numbers
   above) to tell who sent what: the API, the worker, or a script (no round trip of its own).
2. redis-benchmark (Debian's) against a fresh private redis-server: the commands the service
   sends, with its own Lua scripts and payloads of its own sizes, 50 clients, no pipelining.
3. The ceiling: one Redis core's requests/s and tokens/s, from the measured CPU per request and
   per token, and again from redis-benchmark's rates for the round trips a request makes.

Everything is written to <out>.json (re-running one --part keeps the other's results) and drawn in
<out>.png. On a shared machine quote medians and compare within one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import redis

from bench.load import run_crowd
from bench.probes import (ME, cpu_by_role, delta, info_reply_bytes, is_round_trip, less_background,
                          less_idle, machine, monitored, snapshot, tiny_model, worker_steps)
from bench.redis_benchmark import run_benchmark
from bench.report import pyplot, save_figure, write_json
from bench.stack import stack
from serve import free_port


IDLE_S = 5.0


# Per request, per token, per step

DRIVERS = ("requests", "tokens", "steps")


def fit(runs: list[dict], value: Callable[[dict], float], drivers: Callable[[dict], tuple]) -> tuple:
    """(per request, per token, per engine step): least squares of value = a x requests + b x tokens
    + c x steps over a mode's crowds. Crowds of other lengths and other crowd sizes make the three
    differ (a step carries as many tokens as the batch holds); with too few, steps are left out."""
    import numpy as np
    x = np.array([drivers(r) for r in runs], dtype=float)
    y = np.array([value(r) for r in runs], dtype=float)
    if np.linalg.matrix_rank(x) < 3:
        coef = np.linalg.lstsq(x[:, :2], y, rcond=None)[0]
        return float(coef[0]), float(coef[1]), 0.0
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return tuple(float(c) for c in coef)


def per_unit(runs: list[dict]) -> dict:
    """Per request, per token and per step, over one mode's runs: every command, the round trips
    by sender, bytes, Redis' CPU, the API's and the worker's CPU."""
    out = {unit: {} for unit in ("request", "token", "step")}
    clean = lambda r: (r["requests"], r["tokens"], r["steps"])  # noqa: E731
    under_monitor = lambda r: (r["monitored"]["requests"], r["monitored"]["tokens"],  # noqa: E731
                               r["monitored"]["steps"])

    def put(name: str, value: Callable[[dict], float], drivers=clean) -> None:
        for unit, v in zip(("request", "token", "step"), fit(runs, value, drivers)):
            out[unit][name] = v

    for name in sorted({n for r in runs for n in r["redis"]["calls"]}):
        put(f"calls:{name}", lambda r, n=name: r["redis"]["calls"].get(n, 0))
    for name in sorted({n for r in runs for n in r["senders"] if n != "seconds"}):
        put(f"sent:{name}", lambda r, n=name: r["senders"].get(n, 0), under_monitor)
    put("commands", lambda r: sum(r["redis"]["calls"].values()))
    put("round_trips", lambda r: sum(v for k, v in r["senders"].items() if k != "seconds" and is_round_trip(k)),
        under_monitor)
    put("bytes_in", lambda r: r["redis"]["net_in"])
    put("bytes_out", lambda r: r["redis"]["net_out"])
    put("redis_cpu_us", lambda r: r["redis"]["cpu_s"] * 1e6)
    put("api_cpu_us", lambda r: r["cpu"]["api"] * 1e6)
    put("worker_cpu_us", lambda r: r["cpu"]["workers"] * 1e6)
    return out


# The crowds

def measure_crowds(args, model_path: str, env: dict, say) -> dict:
    ports = [free_port()]
    result = {"runs": [], "model": None}
    with stack(env, model_path, Path(args.logs), f"redis-cost-{args.label or 'model'}",
               worker_env=[{"METRICS_PORT": ports[0]}]) as running:
        result["model"] = running.model
        result["workers"] = running.workers()
        client = redis.Redis.from_url(running.redis_url, client_name=ME)
        for stream in (False, True):  # warm-up: the worker's first steps, the API's first requests
            run_crowd(running.url, running.model, 4, 1, 8, progress=False, stream=stream)
        info_bytes = info_reply_bytes(client)
        before = snapshot(client)
        time.sleep(IDLE_S)
        idle = delta(before, snapshot(client), info_bytes)
        result["idle"] = idle
        idle_senders, _ = monitored(client, running.redis_url, lambda: time.sleep(IDLE_S) or {})
        result["idle_senders"] = idle_senders
        say(f"  idle: {sum(idle['calls'].values()) / idle['seconds']:.1f} commands/s "
            f"({', '.join(f'{n} {c}' for n, c in idle['calls'].items() if c)})")
        for stream in (False, True):
            for players in args.players:
                for tokens in args.tokens:
                    def crowd():
                        return run_crowd(running.url, running.model, players, args.requests // players,
                                         tokens, progress=False, stream=stream, timeout=args.timeout)
                    cpu0, steps0 = cpu_by_role(running), worker_steps(ports)
                    before = snapshot(client)
                    row = crowd()
                    measured = delta(before, snapshot(client), info_bytes)
                    cpu1, steps1 = cpu_by_role(running), worker_steps(ports)
                    senders, mrow = monitored(client, running.redis_url, crowd)
                    steps2 = worker_steps(ports)
                    run = {"stream": stream, "players": players, "max_tokens": tokens,
                           "requests": row["requests"], "errors": row["errors"] + mrow["errors"],
                           "tokens": row["tokens"], "seconds": row["seconds"],
                           "tokens_per_s": row["tokens_per_s"], "median_s": row["median_s"],
                           "steps": steps1 - steps0, "redis_raw": measured,
                           "redis": less_background(measured, idle),
                           "cpu": {k: round(cpu1[k] - cpu0[k], 4) for k in cpu1},
                           "senders": less_idle(senders, idle_senders),
                           "monitored": {"requests": mrow["requests"], "tokens": mrow["tokens"],
                                         "steps": steps2 - steps1, "seconds": mrow["seconds"]}}
                    result["runs"].append(run)
                    say(f"  {'streamed' if stream else 'whole':>8} {players:>3} players T={tokens:<4} "
                        f"{run['requests']} requests, {run['tokens']} tokens in {run['seconds']:.1f} s, "
                        f"{run['steps']} steps; Redis: {sum(measured['calls'].values())} commands, "
                        f"{measured['cpu_s']:.3f} CPU s" + (f"; {run['errors']} ERRORS" if run["errors"] else ""))
    result["per"] = {mode: per_unit([r for r in result["runs"] if r["stream"] == (mode == "streamed")])
                     for mode in ("whole", "streamed")}
    return result



# The ceiling

BENCH_FOR = {  # a round trip -> the benchmark case that stands for it
    "evalsha:admit": "EVALSHA admit (push 1 job)", "evalsha:take": "EVALSHA take (1 job)",
    "evalsha:publish": "EVALSHA publish (1 delta)", "mget": "MGET x16 (cancel flags of a step)",
    "publish": "PUBLISH (a delta, 1 subscriber)", "set": "SET ... EX (an answer)",
    "rpush": "RPUSH (a job)", "lpush": "RPUSH (a job)", "lmove": "LMOVE (a job taken)",
}
DEFAULT_CASE = "GET (a stored answer)"  # any other round trip: a small command


def ceiling(per: dict, bench: list[dict], tokens: int, batch: int, worker_rates: list[float]) -> dict:
    """What one Redis core carries, for requests of `tokens` tokens written by workers whose steps
    carry `batch` tokens each: Redis' seconds per generated token are
        cost(request) / tokens + cost(token) + cost(step) / batch,
    with the costs from Redis' CPU as measured, and again from redis-benchmark's rate for each
    round trip (Redis' CPU per command under redis-benchmark; a script's own commands are inside
    its EVALSHA's)."""
    # Redis' CPU per command as redis-benchmark ran it (its client shares the cores, so its rate
    # says as much about the client as about Redis); the rate where the CPU was not read.
    cost_us = {b["label"]: b.get("redis_cpu_us") or 1e6 / b["rps"] for b in bench}
    out = {}
    # A delta more in one publish script: what 16 deltas cost over 1, per extra one.
    extra_delta_us = max(0.0, (cost_us.get("EVALSHA publish (16 deltas)", 0)
                               - cost_us.get("EVALSHA publish (1 delta)", 0)) / 15) if bench else 0.0
    for mode, unit in per.items():
        def per_token(cost: Callable[[str], float]) -> float:
            # A cost the fit puts below zero is noise around nothing: counted as nothing.
            return max(0.0, cost("request")) / tokens + max(0.0, cost("token")) + max(0.0, cost("step")) / batch

        cpu_s = per_token(lambda u: unit[u]["redis_cpu_us"]) / 1e6
        entry = {"redis_us_per_token": round(cpu_s * 1e6, 3)}
        if bench:
            def round_trips(u: str) -> float:
                seconds = 0.0
                for name, n in unit[u].items():
                    if name.startswith("sent:") and is_round_trip(name.removeprefix("sent:")):
                        command = name.split(":", 2)[2]
                        seconds += max(0.0, n) * cost_us.get(BENCH_FOR.get(command, DEFAULT_CASE),
                                                             cost_us[DEFAULT_CASE]) / 1e6
                # The deltas a publish script sends beyond its first (a step's streams, each one).
                seconds += max(0.0, unit[u].get("sent:script:publish:publish", 0)) * extra_delta_us / 1e6
                return seconds * 1e6
            entry["bench_us_per_token"] = round(per_token(round_trips), 3)
        for key, prefix in (("redis_us_per_token", ""), ("bench_us_per_token", "bench_")):
            if entry.get(key, 0) > 0:
                tps = 1e6 / entry[key]
                entry[f"{prefix}tokens_per_s"] = round(tps)
                entry[f"{prefix}requests_per_s"] = round(tps / tokens)
                entry[f"{prefix}workers"] = {str(w): round(tps / w, 1) for w in worker_rates}
        out[mode] = entry
    return out


# Report

def cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def show_units(name: str, result: dict) -> str:
    sizes = sorted({(r["players"], r["max_tokens"]) for r in result["runs"]})
    lines = [f"{name}: per request, per generated token and per engine step (least squares over crowds of "
             f"{', '.join(f'{p} players x {t} tokens' for p, t in sizes)}; {result['runs'][0]['requests']} "
             f"requests each)"]
    columns = [(mode, unit) for mode in ("whole", "streamed") for unit in ("request", "token", "step")]
    lines.append(f"  {'':<34}" + "".join(f"{m[:6] + ' /' + u[:4]:>13}" for m, u in columns))
    per = result["per"]
    names = ["commands", "round_trips", "bytes_in", "bytes_out", "redis_cpu_us", "api_cpu_us", "worker_cpu_us"]
    calls = sorted({n for mode in per.values() for n in mode["request"] if n.startswith(("calls:", "sent:"))})
    for key in names + calls:
        values = [per[m][u].get(key) for m, u in columns]
        if key in calls and all(v is None or abs(v) < 0.01 for v in values):
            continue
        lines.append(f"  {key:<34}" + "".join(f"{cell(v):>13}" for v in values))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(20, 6.5), layout="constrained")
    ceil = report.get("ceiling", {})
    label = ceil.get("model") or next(iter(report.get("models", {})), None)
    if label:  # 1: round trips per request, per 100 tokens and per 10 steps, by sender and command
        per = report["models"][label]["per"]
        names = sorted({n for m in per.values() for u in m.values() for n in u
                        if n.startswith("sent:") and is_round_trip(n.removeprefix("sent:"))})
        scales = {"request": 1, "token": 100, "step": 10}
        shown = [n for n in names
                 if max(abs(per[m][u].get(n, 0)) * scales[u] for m in per for u in scales) >= 0.05]
        bars = [(m, u) for m in ("whole", "streamed") for u in scales]
        width = 0.8 / len(bars)
        for i, (mode, unit) in enumerate(bars):
            axes[0].barh([y + (i - (len(bars) - 1) / 2) * width for y in range(len(shown))],
                         [per[mode][unit].get(n, 0) * scales[unit] for n in shown], width,
                         label=(f"{mode}, per {unit}" if scales[unit] == 1
                                else f"{mode}, per {scales[unit]} {unit}s"))
        axes[0].set_yticks(range(len(shown)), [n.removeprefix("sent:") for n in shown], fontsize=8)
        axes[0].set(title=f"Round trips to Redis ({label})", xlabel="calls")
        axes[0].legend(fontsize=7)
        axes[0].grid(True, axis="x", alpha=0.3)
    bench = report.get("benchmark", {}).get("results", [])
    if bench:
        axes[1].barh([b["label"] for b in bench], [b["rps"] for b in bench], color="tab:gray")
        for y, b in enumerate(bench):
            cpu = f" ({b['redis_cpu_us']:.0f} us of Redis CPU)" if b.get("redis_cpu_us") else ""
            axes[1].text(b["rps"], y, f" {b['rps']:,.0f}{cpu}", va="center", fontsize=8)
        axes[1].set_xlim(right=max(b["rps"] for b in bench) * 1.5)
        axes[1].set(title=f"redis-benchmark ({report['benchmark']['clients']} clients, no pipelining)",
                    xlabel="commands / s")
        axes[1].tick_params(axis="y", labelsize=8)
        axes[1].invert_yaxis()
        axes[1].grid(True, axis="x", alpha=0.3)
    if ceil:
        for batch, style in zip(ceil["batches"], ("-", "--", ":")):
            for mode, colour in (("whole", "tab:blue"), ("streamed", "tab:red")):
                points = ceil["by_batch"][str(batch)]
                tokens = sorted(int(t) for t in points)
                axes[2].plot(tokens, [points[str(t)][mode].get("tokens_per_s") for t in tokens], style,
                             marker="o", color=colour, label=f"{mode}, {batch} tokens per step: measured")
                bench_line = [points[str(t)][mode].get("bench_tokens_per_s") for t in tokens]
                if any(bench_line):
                    axes[2].plot(tokens, bench_line, style, marker="s", color=colour, alpha=0.35,
                                 label=f"{mode}, {batch} tokens per step: redis-benchmark")
        axes[2].set(title=f"One Redis core's ceiling (costs measured on {label})", xlabel="tokens per request",
                    ylabel="generated tokens / s")
        axes[2].set_xscale("log")
        axes[2].set_yscale("log")
        from matplotlib.ticker import FuncFormatter, NullFormatter
        axes[2].set_xticks(tokens, [str(t) for t in tokens])
        axes[2].xaxis.set_minor_formatter(NullFormatter())
        axes[2].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        axes[2].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        axes[2].grid(True, which="both", alpha=0.3)
        axes[2].legend(fontsize=8)
    fig.suptitle("Storyteller: what Redis spends per request, per token and per step")
    save_figure(fig, path, dpi=110)



def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/redis-cost", help="writes <out>.json and <out>.png")
    ap.add_argument("--part", choices=("all", "crowd", "benchmark", "report"), default="all",
                    help="what to measure (report: nothing, the ceiling and the chart again from <out>.json)")
    ap.add_argument("--model", default="tiny", help="'tiny' (the tests' random Llama: the worker is never "
                                                    "the limit), 'smollm2', or a model directory")
    ap.add_argument("--label", help="the model's name in the report (default: from --model)")
    ap.add_argument("--players", type=int, nargs="+", default=[8, 32], help="crowd sizes")
    ap.add_argument("--requests", type=int, default=128, help="requests per crowd, shared by its players")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128], help="answer lengths")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="worker settings")
    ap.add_argument("--logs", default="bench/results/logs")
    ap.add_argument("--redis-benchmark", default="/usr/bin/redis-benchmark")
    ap.add_argument("--bench-n", type=int, default=100_000, help="commands per redis-benchmark run")
    ap.add_argument("--bench-clients", type=int, default=50)
    ap.add_argument("--bench-repeats", type=int, default=3)
    ap.add_argument("--ceiling-tokens", type=int, nargs="+", default=[16, 100, 400],
                    help="request lengths the ceiling is given for")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64],
                    help="tokens per engine step (the workers' batch) the ceiling is given for")
    ap.add_argument("--worker-tokens-per-s", type=float, nargs="+", default=[550.0],
                    help="a worker's tokens/s, to say how many workers the ceiling is")
    args = ap.parse_args(argv)
    out = Path(args.out)
    json_path = out.with_suffix(".json")
    report = json.loads(json_path.read_text()) if json_path.exists() else {}
    report.setdefault("models", {})

    def say(line: str) -> None:
        print(line, flush=True)

    def save() -> None:
        write_json(json_path, report, indent=1)

    if args.part in ("all", "crowd"):
        env = dict(item.split("=", 1) for item in args.env)
        with tempfile.TemporaryDirectory() as tmp:
            if args.model == "tiny":
                model_path, label = tiny_model(Path(tmp)), args.label or "tiny-llama"
                env.setdefault("TORCH_THREADS", "1")
            else:
                model_path, label = args.model, args.label or Path(args.model).name
            args.label = label
            say(f"# crowds on {label}: {args.requests} requests from {' or '.join(map(str, args.players))} "
                f"players, {' or '.join(map(str, args.tokens))} tokens each, whole and streamed")
            result = measure_crowds(args, model_path, env, say)
        result.update(env=env, machine=machine())
        report["models"][label] = result
        save()
    if args.part in ("all", "benchmark"):
        say(f"# redis-benchmark: {args.bench_n:,} commands x {args.bench_repeats}, {args.bench_clients} clients")
        report["benchmark"] = {"results": run_benchmark(args, say), "n": args.bench_n,
                               "clients": args.bench_clients, "machine": machine()}
        save()
    if report["models"]:
        # The ceiling from the most realistic crowds measured: SmolLM2's when there are some.
        label = next((m for m in report["models"] if "smol" in m.lower()), next(iter(report["models"])))
        bench = report.get("benchmark", {}).get("results", [])
        per = report["models"][label]["per"]
        report["ceiling"] = {"model": label, "worker_tokens_per_s": args.worker_tokens_per_s,
                             "batches": args.batches,
                             "by_batch": {str(b): {str(t): ceiling(per, bench, t, b, args.worker_tokens_per_s)
                                                   for t in args.ceiling_tokens} for b in args.batches}}
        save()
        for name, result in report["models"].items():
            print()
            print(show_units(name, result))
        print()
        print(f"One Redis core, {label}'s costs: generated tokens/s (requests/s) at saturation")
        for batch, by_tokens in report["ceiling"]["by_batch"].items():
            for t, modes in by_tokens.items():
                for mode, e in modes.items():
                    print(f"  {batch:>3} tokens/step, {t:>4} tokens/request, {mode:<8}: "
                          f"{e['redis_us_per_token']:.2f} us/token -> {e.get('tokens_per_s', 0):>9,} tok/s "
                          f"({e.get('requests_per_s', 0):,} req/s)"
                          + (f"; redis-benchmark: {e['bench_tokens_per_s']:,} tok/s "
                             f"({e['bench_requests_per_s']:,} req/s)" if e.get("bench_tokens_per_s") else ""))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {json_path} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
