"""redis-benchmark (Debian's) against a fresh private redis-server, with the service's own commands.

The commands the API and the worker send, with their own Lua scripts and payloads of their own
sizes, recorded from the service's classes rather than written again here, so the benchmark
replays what they really send (bench.redis_cost's part 2).
"""
from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path

import redis

from bench.probes import SCRIPT_BY_SHA, snapshot
from bench.stack import redis_server
from serve import free_port, wait_for_redis
from shared import keys
from shared.protocol import Final, Job, SamplingParams, TextDelta, encode_result


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

