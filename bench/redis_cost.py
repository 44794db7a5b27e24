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
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import psutil
import redis

from bench.load import run_crowd
from bench.stack import Stack, redis_server, stack
from serve import free_port, wait_for_redis
from shared import keys
from shared.protocol import Final, Job, SamplingParams, TextDelta, encode_result

ME = "redis-cost"  # this script's own connections, named so that MONITOR's counts leave them out
# Commands this script sends to measure (INFO, CLIENT LIST...): never counted as the service's.
OWN = {"info", "config|resetstat", "client|list", "client|setname", "monitor", "echo", "hello",
       "script|load", "command|docs", "select"}
STOP_MARK = "redis-cost-stop"


def _lua_scripts() -> dict[str, str]:
    """Every Lua script of the service, by name (_TAKE -> take): MONITOR shows only their SHA."""
    import api.admission
    import api.batch_store
    import worker.job_queue
    found = {}
    for module in (api.admission, api.batch_store, worker.job_queue):
        for name, value in vars(module).items():
            if name.startswith("_") and name.isupper() and isinstance(value, str) and "redis.call" in value:
                found[name.strip("_").lower()] = value
    return found


SCRIPTS = _lua_scripts()
SCRIPT_BY_SHA = {hashlib.sha1(text.encode()).hexdigest(): name for name, text in SCRIPTS.items()}
IDLE_S = 5.0


# Reading Redis' own counters

def snapshot(client: redis.Redis) -> dict:
    info = client.execute_command("INFO", "commandstats", "stats", "cpu", "memory")
    calls, usec = {}, {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            name = key.removeprefix("cmdstat_")
            if name not in OWN:
                calls[name], usec[name] = int(value["calls"]), int(value["usec"])
    return {"calls": calls, "usec": usec, "net_in": int(info["total_net_input_bytes"]),
            "net_out": int(info["total_net_output_bytes"]),
            "cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "memory": int(info["used_memory"]), "at": time.perf_counter()}


def delta(before: dict, after: dict, info_bytes: int = 0) -> dict:
    """What happened between two snapshots; `info_bytes`: one INFO reply, which is ours, not the
    service's output."""
    names = set(before["calls"]) | set(after["calls"])
    return {"calls": {n: after["calls"].get(n, 0) - before["calls"].get(n, 0) for n in sorted(names)},
            "usec": {n: after["usec"].get(n, 0) - before["usec"].get(n, 0) for n in sorted(names)},
            "net_in": after["net_in"] - before["net_in"],
            "net_out": after["net_out"] - before["net_out"] - info_bytes,
            "cpu_s": round(after["cpu_s"] - before["cpu_s"], 6),
            "memory": after["memory"] - before["memory"],
            "seconds": round(after["at"] - before["at"], 3)}


def info_reply_bytes(client: redis.Redis) -> int:
    """The bytes one of our INFO calls adds to Redis' output count."""
    first = snapshot(client)
    second = snapshot(client)
    return second["net_out"] - first["net_out"]


def less_background(measured: dict, idle: dict) -> dict:
    """`measured` less what the idle stack does in as many seconds (heartbeats, idle polls)."""
    scale = measured["seconds"] / idle["seconds"]
    out = dict(measured)
    out["calls"] = {n: max(0.0, c - idle["calls"].get(n, 0) * scale) for n, c in measured["calls"].items()}
    for key in ("net_in", "net_out", "cpu_s"):
        out[key] = max(0.0, measured[key] - idle[key] * scale)
    return out


# The processes' CPU

def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (gunicorn's master and its workers)."""
    try:
        process = psutil.Process(pid)
        total = 0.0
        for p in [process, *process.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
        return total
    except psutil.NoSuchProcess:
        return 0.0


def cpu_by_role(running: Stack) -> dict[str, float]:
    roles = {"redis": 0.0, "api": 0.0, "workers": 0.0}
    for name, process in running.processes.items():
        role = "workers" if name.startswith("worker") else name
        roles[role] = roles.get(role, 0.0) + cpu_seconds(process.pid)
    mine = os.times()
    roles["client"] = mine.user + mine.system  # this process: the crowd's HTTP clients
    return roles


def worker_steps(ports: list[int]) -> int:
    """Engine steps so far, summed over the workers (their batch-size histogram's count)."""
    total = 0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("storyteller_batch_size_count"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


# Who sent what: MONITOR

class Monitor(threading.Thread):
    """Counts every command Redis runs, by who sent it: the connection's port (told apart later by
    the connections' names), or, for a command a Lua script ran (no round trip of its own), the
    script: Redis runs one command at a time, so a script's commands follow its EVALSHA."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, client_name=f"{ME}-monitor")
        self.counts: dict[tuple[str, str], int] = {}  # (port or "script:NAME", command) -> calls
        self.ready = threading.Event()

    def run(self) -> None:
        script = "?"
        with self.client.monitor() as monitor:
            self.ready.set()
            for entry in monitor.listen():
                words = entry["command"].split(" ", 2)
                if entry["command"].startswith("ECHO") and STOP_MARK in entry["command"]:
                    return
                name = words[0].lower()
                if name in ("evalsha", "eval") and len(words) > 1:
                    sha = words[1] if name == "evalsha" else hashlib.sha1(words[1].encode()).hexdigest()
                    script = SCRIPT_BY_SHA.get(sha, "other")
                    name = f"evalsha:{script}"
                sender = f"script:{script}" if entry["client_type"] == "lua" else entry["client_port"]
                self.counts[(sender, name)] = self.counts.get((sender, name), 0) + 1


def monitored(client: redis.Redis, url: str, crowd: Callable[[], dict]) -> tuple[dict, dict]:
    """Run `crowd` under MONITOR: ({"api:get": n, "worker:evalsha:take": n, "script:take:lindex": n,
    ..., "seconds": s}, the crowd's row)."""
    monitor = Monitor(url)
    monitor.start()
    monitor.ready.wait(5)
    time.sleep(0.2)
    started = time.perf_counter()
    row = crowd()
    seconds = time.perf_counter() - started
    names = {}
    for entry in client.client_list():
        names[entry["addr"].rsplit(":", 1)[1]] = entry.get("name", "")
    client.echo(STOP_MARK)
    monitor.join(60)
    counts: dict[str, float] = {}
    for (sender, command), n in monitor.counts.items():
        if command in OWN:
            continue
        if sender.startswith("script:"):
            side = sender
        else:
            name = names.get(sender, "")
            if name.startswith(ME):
                continue
            side = "api" if name.startswith("storyteller-api") else "worker" if name == "" else "other"
        counts[f"{side}:{command}"] = counts.get(f"{side}:{command}", 0) + n
    counts["seconds"] = seconds
    return counts, row


def is_round_trip(sent: str) -> bool:
    """A command a client sent ("api:get"), not one a script ran ("script:take:lindex")."""
    return not sent.startswith("script:")


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

def tiny_model(directory: Path) -> str:
    """The tests' tiny random Llama, with room for long answers (rotary positions: no weight
    depends on the context length, so raising it in the config is all it takes)."""
    from tests.tiny_models import save_tiny
    path = save_tiny("llama", str(directory / "tiny-llama"))
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 2048
    config_path.write_text(json.dumps(config, indent=2))
    return path


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


def less_idle(senders: dict, idle: dict) -> dict:
    """A monitored crowd's counts less what the idle stack sends in as many seconds."""
    background = senders["seconds"] / idle["seconds"]
    return {k: (v if k == "seconds" else round(max(0.0, v - idle.get(k, 0) * background), 1))
            for k, v in senders.items()}


# redis-benchmark

MODEL = "SmolLM2-135M-Instruct"
ME_WORKER = "bench-worker"


class _Recorder(redis.Redis):
    """A client that keeps the last EVALSHA it sent, so that redis-benchmark replays exactly what the
    API's and the worker's own classes send (their scripts' keys and arguments, whatever they are)."""
    sent: list[str] = []

    def execute_command(self, *args, **options):
        if args and str(args[0]).upper() == "EVALSHA":
            self.sent = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
        return super().execute_command(*args, **options)


def payloads() -> dict:
    """The service's messages at their usual sizes: jobs of a 30-token prompt, one streamed step's
    text, a 100-token answer (~450 characters, as SmolLM2 writes)."""
    jobs = [Job(id=f"0123456789abcdef0123456789abcd{i:02d}-0", model=MODEL, prompt_ids=list(range(1000, 1030)),
                params=SamplingParams(max_tokens=100, temperature=0.8), timeout_s=300, stream=True)
            for i in range(16)]
    words = "The dragon slept under the old gate while the knight waited. " * 8
    return {"jobs": jobs,
            "delta": encode_result(TextDelta(text=" dragon", offset=120, completion_tokens=31)),
            "final": encode_result(Final(text=words[:450], finish_reason="length", prompt_tokens=30,
                                         completion_tokens=100))}


def benchmark_cases(url: str) -> list[tuple[str, list[str]]]:
    """(label, command) pairs, as the service sends them: the scripts' calls are recorded from the
    API's Admission and the worker's JobQueue run against the benchmark's Redis, which is left with
    16 jobs taken and leased to one worker (what its publish script checks)."""
    from api.admission import Admission
    from worker.job_queue import JobQueue
    p = payloads()
    recorder = _Recorder.from_url(url)
    admission = Admission(recorder, max_queue=0)
    for job in p["jobs"]:
        admission.push([job], cap=0)
    admit = recorder.sent
    worker = JobQueue(recorder, ME_WORKER, MODEL)
    for _ in p["jobs"]:
        worker._take_now(1, alone_ok=True)
    take = recorder.sent
    JobQueue(recorder, ME_WORKER, "nobody")._take_now(1, alone_ok=True)
    take_empty = recorder.sent
    ids = [job.id for job in p["jobs"]]
    # Each delta with its token's record (at the 31st token of a 4-digit-id record).
    worker._run_publish([ids[0], p["delta"], "", "", 150, "1234,"])
    publish1 = recorder.sent
    worker._run_publish([x for i in ids for x in (i, p["delta"], "", "", 150, "1234,")])
    publish16 = recorder.sent
    recorder.set(keys.answer(MODEL, ids[0]), p["final"])
    return [
        ("GET (a stored answer)", ["GET", keys.answer(MODEL, ids[0])]),
        ("SET ... EX (an answer)", ["SET", keys.answer(MODEL, "__rand_int__"), p["final"], "EX", "300"]),
        ("MGET x16 (cancel flags of a step)", ["MGET", *[keys.cancel(MODEL, i) for i in ids]]),
        ("RPUSH (a job)", ["RPUSH", "bench:list", p["jobs"][0].to_json()]),
        ("LMOVE (a job taken)", ["LMOVE", "bench:list", "bench:taken", "LEFT", "RIGHT"]),
        ("PUBLISH (a delta, 1 subscriber)", ["PUBLISH", keys.channel(MODEL, ids[0]), p["delta"]]),
        ("EVALSHA admit (push 1 job)", admit),
        ("EVALSHA take (1 job)", take),
        ("EVALSHA take (queue empty)", take_empty),
        ("EVALSHA publish (1 delta)", publish1),
        ("EVALSHA publish (16 deltas)", publish16),
    ]


def run_benchmark(args, say) -> list[dict]:
    binary = args.redis_benchmark
    if not Path(binary).exists():
        raise SystemExit(f"{binary} is not there: install Debian's redis-tools")
    port = free_port()
    server = redis_server(port, subprocess.DEVNULL)
    subscriber = None
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(url)
        client = redis.Redis.from_url(url)
        cases = benchmark_cases(url)
        # A reader on every channel published to, as the API's subscriber is: a message with
        # nobody listening costs Redis less than one delivered.
        subscriber = subprocess.Popen(["redis-cli", "-p", str(port), "SUBSCRIBE",
                                       *[keys.channel(MODEL, job.id) for job in payloads()["jobs"]]],
                                      stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        results = []
        for label, command in cases:
            rates, p50s, cpu_us = [], [], []
            for _ in range(args.bench_repeats):
                cpu_before = snapshot(client)["cpu_s"]
                out = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(port), "-n", str(args.bench_n),
                                      "-c", str(args.bench_clients), "-r", "1000000", "--csv", *command],
                                     capture_output=True, text=True, timeout=300)
                line = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith('"test"')][-1]
                # The test's name is the command, quotes and commas and all: read from the end.
                cells = [c.strip('"') for c in line.rsplit('","', 7)[1:]]
                rates.append(float(cells[0]))  # rps, avg, min, p50, p95, p99, max
                p50s.append(float(cells[3]))
                # Redis' own CPU per command: what it costs the server, whether or not the client
                # (on the same cores) kept it busy.
                cpu_us.append((snapshot(client)["cpu_s"] - cpu_before) * 1e6 / args.bench_n)
            row = {"label": label, "command": command[0] + ("" if command[0] != "EVALSHA" else
                                                            " " + SCRIPT_BY_SHA.get(command[1], "?")),
                   "rps": statistics.median(rates), "rps_all": rates, "p50_ms": statistics.median(p50s),
                   "redis_cpu_us": round(statistics.median(cpu_us), 2)}
            results.append(row)
            say(f"  {label:<36} {row['rps']:>9,.0f} /s  {row['redis_cpu_us']:>6.1f} us of Redis CPU each  "
                f"(p50 {row['p50_ms']:.2f} ms; runs {', '.join(f'{r:,.0f}' for r in rates)})")
        return results
    finally:
        if subscriber:
            subscriber.terminate()
        server.terminate()
        server.wait(10)


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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "redis": version.split(" sha=")[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


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
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1) + "\n")

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
