"""Prometheus metrics from real processes: `python -m api` with two gunicorn processes and tiny-model
workers on a private Redis, whose numbers follow the queue, the answers and the errors; and a real
Prometheus that scrapes them and answers every expression of the Grafana dashboard and of the alert
rules. Reading a metrics page, and the in-process checks, are tests/test_metrics.py's.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from shared import keys, metrics as names
from tests.processes import (MODEL, ROOT, Paused, free_port, get_json, logs, make_client, models_served, start_api,
                             stop, tiny_worker, wait_until)
from tests.prometheus_text import grew, scrape, value

pytestmark = pytest.mark.timeout(240)

DASHBOARD = ROOT / "grafana" / "dashboards" / "storyteller.json"
ALERTS = ROOT / "prometheus" / "alerts.yml"


# Real processes: `python -m api` with two gunicorn processes, tiny-model workers, a private Redis

def _completion_usage(client, i: int):
    """One request of a small mixed crowd: whole, streamed (with its usage), or chat."""
    if i % 3 == 1:
        stream = client.completions.create(model=MODEL, prompt=f"Player {i} asks", max_tokens=6, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [chunk.usage for chunk in stream if chunk.usage][-1]
    if i % 3 == 2:
        return client.chat.completions.create(model=MODEL, max_tokens=5,
                                              messages=[{"role": "user", "content": f"Tell story {i}"}]).usage
    return client.completions.create(model=MODEL, prompt=f"Player {i} asks", max_tokens=6,
                                     extra_body={"ignore_eos": True}).usage


def _depth(samples: dict) -> float:
    return value(samples, names.QUEUE_DEPTH, model=MODEL)


def test_metrics_follow_the_queue_the_answers_and_the_errors(redis_alone, tiny_model_dirs, tmp_path):
    worker_port = free_port()
    # A KV cache of 64 tokens: a request for 100 tokens is refused by the worker (a 500).
    worker = tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "worker", "--metrics-port", str(worker_port),
                         "--kv-blocks", "4", "--block-size", "16")
    # PROMETHEUS_MULTIPROC_DIR given: the API empties it of an earlier run's files (this one would
    # not even parse) and counts there.
    counted_in = tmp_path / "api-metrics"
    counted_in.mkdir()
    (counted_in / "counter_1.db").write_bytes(b"left over")
    port, api = start_api(redis_alone, tmp_path, "api", "--api-workers", "2", "--max-queue", "2",
                          PROMETHEUS_MULTIPROC_DIR=str(counted_in))
    procs = [worker, api]
    api_metrics, worker_metrics = f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{worker_port}/metrics"
    pool = ThreadPoolExecutor(2)
    try:
        wait_until(lambda: MODEL in models_served(port), procs, "the stack")
        client = make_client(port)
        api_before, worker_before = scrape(api_metrics), scrape(worker_metrics)
        assert value(api_before, names.WORKERS_ALIVE, model=MODEL) == 1
        assert value(api_before, names.WORKER_STARTS, model=MODEL) == 1

        paused = Paused(worker, redis_alone.client())
        try:
            waiting = pool.submit(_completion_usage, client, 0)
            wait_until(lambda: _depth(scrape(api_metrics)) == 1, procs, "the queue depth to rise to 1")
            time.sleep(1.2)
            assert value(scrape(api_metrics), names.OLDEST_JOB_AGE, model=MODEL) >= 1
            with pytest.raises(openai.RateLimitError):  # 1 waiting + 2 > --max-queue 2
                client.completions.create(model=MODEL, prompt="Two more", max_tokens=2, n=2)
        finally:
            paused.resume()
        usages = [waiting.result(timeout=60)]
        wait_until(lambda: _depth(scrape(api_metrics)) == 0, procs, "the queue depth to fall to 0")
        assert value(scrape(api_metrics), names.OLDEST_JOB_AGE, model=MODEL) == 0

        usages += list(pool.map(lambda i: _completion_usage(client, i), range(1, 13)))
        with pytest.raises(openai.InternalServerError) as refused:  # more than the worker's KV cache holds
            client.completions.create(model=MODEL, prompt="Too long", max_tokens=100)
        assert refused.value.status_code == 500 and refused.value.code == "worker_error"
        with pytest.raises(openai.APIError):  # the same, streamed: a 200, then an error event
            list(client.completions.create(model=MODEL, prompt="Too long", max_tokens=100, stream=True))
        # Each scrape reaches either API process: every one adds up both processes' numbers.
        scrapes = [scrape(api_metrics) for _ in range(8)]
        worker_after = scrape(worker_metrics)
    finally:
        pool.shutdown(cancel_futures=True)
        stop(api), stop(worker)

    assert not (counted_in / "counter_1.db").exists()
    processes = {p.name.split("_")[1] for p in counted_in.glob("counter_*.db")}
    print(f"API processes that counted requests: {len(processes)}")
    assert 1 <= len(processes) <= 2
    after = scrapes[-1]
    for other in scrapes[:-1]:
        for name in (names.PROMPT_TOKENS, names.COMPLETION_TOKENS, names.REQUESTS, names.ERRORS):
            assert value(other, name) == value(after, name), f"{name}: the API processes disagree"
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    assert grew(api_before, after, names.PROMPT_TOKENS, model=MODEL) == prompt, logs(api)
    assert grew(api_before, after, names.COMPLETION_TOKENS, model=MODEL) == completion
    assert grew(api_before, after, names.REQUESTS, route="/v1/completions", status=429) == 1
    assert grew(api_before, after, names.REQUESTS, route="/v1/completions", status=500) == 1
    assert grew(api_before, after, names.REQUESTS, route="/v1/chat/completions", status=200) == 4
    assert grew(api_before, after, names.ERRORS, code="queue_full") == 1
    assert grew(api_before, after, names.ERRORS, code="worker_error") == 2  # the 500 and the stream's
    assert grew(api_before, after, names.TIME_TO_FIRST_TOKEN + "_count", model=MODEL) == 4  # the streams
    assert grew(api_before, after, names.REQUEST_LATENCY + "_count", route="/v1/chat/completions") == 4

    # The worker: 15 jobs taken (13 answered, 2 refused), the first after waiting over a second.
    assert grew(worker_before, worker_after, names.QUEUE_WAIT + "_count", model=MODEL) == 15
    assert grew(worker_before, worker_after, names.QUEUE_WAIT + "_sum", model=MODEL) >= 1
    assert grew(worker_before, worker_after, names.GENERATED_TOKENS, model=MODEL) >= completion
    answered_long = sum(1 for u in usages if u.completion_tokens > 1)
    assert grew(worker_before, worker_after, names.TIME_PER_OUTPUT_TOKEN + "_count", model=MODEL) == answered_long
    assert grew(worker_before, worker_after, names.BATCH_SIZE + "_count", model=MODEL) >= completion / 2
    assert value(worker_after, names.RUNNING, model=MODEL) == 0
    assert 0 <= value(worker_after, names.KV_CACHE_USAGE, model=MODEL) <= 1


# A real Prometheus, and every expression of the dashboard and of the alert rules

def dashboard_exprs() -> list[str]:
    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", []) if t.get("expr")]


def alert_rules() -> dict[str, str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"] if "alert" in rule}


_NAME = re.compile(r"\bstoryteller_[a-z_]+")
_SUFFIXES = ("", "_bucket", "_sum", "_count")


def test_every_metric_the_dashboard_and_the_alerts_use_exists():
    known = {getattr(names, n) for n in dir(names) if n.isupper() and n != "PREFIX"}
    exprs = dashboard_exprs() + list(alert_rules().values())
    assert len(exprs) > 10
    used = {m for expr in exprs for m in _NAME.findall(expr)}
    assert {m for m in used if not any(m.removesuffix(s) in known for s in _SUFFIXES if m.endswith(s))} == set()


def _masked(expr: str) -> str:
    """`expr` with everything inside brackets and quotes blanked out: what is left is its top level."""
    out, depth, quote = [], 0, None
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
            out.append(" ")
            continue
        if ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            out.append(" ")
            continue
        out.append(ch if depth == 0 and not quote else " ")
    return "".join(out)


def conditions(expr: str) -> list[str]:
    """The measured sides of an alert's comparisons: `a > 1 and b < 2` -> [a, b]."""
    parts, start = [], 0
    for match in re.finditer(r"\b(and|or|unless)\b", _masked(expr)):
        parts.append(expr[start:match.start()])
        start = match.end()
    parts.append(expr[start:])
    sides = []
    for part in parts:
        part = re.sub(r"^\s*(on|ignoring)\s*\([^)]*\)", "", part)
        comparison = re.search(r"==|!=|>=|<=|>|<", _masked(part))
        sides.append((part[:comparison.start()] if comparison else part).strip())
    return sides


def test_conditions_are_the_measured_sides_of_the_comparisons():
    assert conditions('sum(x{a=">"}) > 0\nand\nderiv(y[5m:15s]) > 0') == ['sum(x{a=">"})', "deriv(y[5m:15s])"]
    assert conditions("max(a) > 0 unless on (model) max(b) > 0") == ["max(a)", "max(b)"]
    assert conditions("(sum(a) or on() vector(0)) == 0") == ["(sum(a) or on() vector(0))"]


class Prometheus:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
            return response.status == 200

    def query(self, expr: str) -> list:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.load(response)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def rules(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as response:
            return [r for g in json.load(response)["data"]["groups"] for r in g["rules"]]

    def wait_for_data(self, exprs: list[str], procs, what: str, timeout: float = 60) -> None:
        """Poll until every expression returns data; fail naming those that never did."""
        empty, give_up = list(exprs), time.monotonic() + timeout
        while empty and time.monotonic() < give_up:
            if any(p.poll() is not None for p in procs):
                pytest.fail(f"a process exited while waiting for {what}\n{logs(*procs)}")
            empty = [e for e in empty if not self.query(e)]
            if empty:
                time.sleep(1)
        assert not empty, f"{what}: no data after {timeout:g} s from\n" + "\n".join(empty)


def _start_prometheus(tmp_path: Path, api_port: int, worker_ports: list[int]) -> tuple[Prometheus, subprocess.Popen]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed (test.sh installs Debian's: apt-get install prometheus)")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],  # loaded, so an invalid rule stops Prometheus here
        "scrape_configs": [
            {"job_name": "api", "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]},
            {"job_name": "worker", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in worker_ports]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    proc.log_files = (tmp_path / "prometheus.log",)
    log.close()
    return Prometheus(port), proc


# The alerts that the test makes fire for real, below; the others' conditions (a queue growing for
# minutes, a job waiting over a minute, a poison job, a full KV cache) are checked to have data.
FIRED_HERE = ("StorytellerShedding", "StorytellerNoWorkerAlive", "StorytellerModelLostWorkers",
              "StorytellerHighErrorRate")


@pytest.mark.slow
def test_prometheus_scrapes_everything_the_dashboard_and_the_alerts_ask_for(redis_alone, tiny_model_dirs, tmp_path):
    alerts, exprs = alert_rules(), dashboard_exprs()
    assert set(FIRED_HERE) <= set(alerts), f"the alert rules changed: {sorted(alerts)}"
    port, api = start_api(redis_alone, tmp_path, "api", "--api-workers", "2", "--max-queue", "2", "--worker-grace", "1")
    worker_ports = [free_port(), free_port()]
    prometheus, prometheus_proc = _start_prometheus(tmp_path, port, worker_ports)  # from the start: for deriv()
    workers = [tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, f"worker{i}", "--metrics-port", str(p))
               for i, p in enumerate(worker_ports)]
    procs = [api, prometheus_proc, *workers]
    pool = ThreadPoolExecutor(2)
    try:
        wait_until(prometheus.ready, procs, "Prometheus")
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/health")[1]["workers"] == 2, procs, "the stack")
        client = make_client(port)
        for _ in pool.map(lambda i: _completion_usage(client, i), range(12)):
            pass
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

        # Healthy, after a short load: every panel has data, and the measured side of every alert
        # that is not made to fire below (those measure what a healthy stack does not have yet:
        # 429s, 5xx).
        prometheus.wait_for_data(exprs, procs, "the dashboard")
        sides = sorted({side for name, expr in alerts.items() if name not in FIRED_HERE
                        for side in conditions(expr)})
        prometheus.wait_for_data(sides, procs, "the alerts' conditions")
        assert all(rule["health"] == "ok" for rule in prometheus.rules()), prometheus.rules()

        # Then the troubles the alerts are for: one worker stopped, the other stuck (the queue
        # fills, a request is shed with 429), then dead (queued requests and new ones get 503).
        stop(workers[1])
        paused = Paused(workers[0], redis_alone.client())
        queued = [pool.submit(_completion_usage, client, 0) for _ in range(2)]
        wait_until(lambda: sum(redis_alone.client().llen(q) for q in keys.queues(MODEL)) == 2, [api, prometheus_proc],
                   "a full queue")
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="One too many", max_tokens=2)
        paused.done.set(), paused.thread.join()  # its heartbeat expires: dead to the API
        workers[0].kill()
        for future in queued:
            with pytest.raises(openai.InternalServerError):  # 503: no worker came back in --worker-grace
                future.result(timeout=30)
        for _ in range(4):
            with pytest.raises(openai.InternalServerError):  # 503 at once: no worker at all
                client.completions.create(model=MODEL, prompt="Anyone?", max_tokens=2)
        prometheus.wait_for_data([alerts[name] for name in FIRED_HERE], [api, prometheus_proc], "the alerts to fire")
    finally:
        pool.shutdown(cancel_futures=True)
        for proc in procs:
            stop(proc)
