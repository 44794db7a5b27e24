"""Prometheus metrics: the API's (Flask's test client on fakeredis, then real processes with two
gunicorn processes) and a worker's; and a real Prometheus that scrapes them and answers every
expression of the Grafana dashboard and of the alert rules.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

import api.__main__
from api.app import create_app
from serve import free_port
from shared import keys
from shared import metrics as names
from shared.protocol import Failure, Final, Job, SamplingParams, TextDelta, encode_result
from shared.settings import Settings
from tests.processes import ROOT, get_json, logs, make_client, models_served, start, stop, wait_until
from tests.test_api_errors import MODEL as FAKE_MODEL, _register_worker
from tests.test_reliability import MODEL, Paused, _worker, redis_alone  # noqa: F401 (a fixture)
from worker.continuous import engine as continuous
from worker.metrics import EngineCollector, WorkerMetrics
from worker.model_loader import load
from worker.static_engine import StaticEngine

pytestmark = pytest.mark.timeout(240)

DASHBOARD = ROOT / "grafana" / "dashboards" / "storyteller.json"
ALERTS = ROOT / "prometheus" / "alerts.yml"


# Reading metrics

def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 if none)."""
    wanted = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def has(samples: dict, name: str, **labels) -> bool:
    wanted = {(k, str(v)) for k, v in labels.items()}
    return any(n == name and wanted <= set(ls) for n, ls in samples)


def grew(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# The API, in-process (Flask's test client, fakeredis)

@pytest.fixture
def api_client(fake_redis):
    return create_app(Settings(request_timeout=5), client=fake_redis).test_client()


def _metrics(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.content_type.startswith("text/plain")
    return parse(response.get_data(as_text=True))


def test_requests_are_counted_by_route_and_status_and_errors_by_code(api_client):
    before = _metrics(api_client)
    for path in ["/health", "/v1/nothing/here", "/favicon.ico"]:
        api_client.get(path, buffered=True)  # buffered: the test client closes the response then
    api_client.post("/v1/completions", data="{not json", buffered=True)
    api_client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, buffered=True)  # no worker: 503
    after = _metrics(api_client)
    assert grew(before, after, names.REQUESTS, route="/health", status=200) == 1
    # Unknown paths share one label value, whatever they are: the label's values stay bounded.
    assert grew(before, after, names.REQUESTS, route="unmatched", status=404) == 2
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=400) == 1
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=503) == 1
    assert grew(before, after, names.ERRORS, code="invalid_json") == 1
    assert grew(before, after, names.ERRORS, code="service_unavailable") == 1
    assert grew(before, after, names.ERRORS, code="invalid_request_error") == 2  # the 404s: no code, a type
    assert grew(before, after, names.REQUEST_LATENCY + "_count", route="/v1/completions") == 2
    assert not any(n.startswith(names.REQUESTS) and dict(ls).get("route") == "/metrics" for n, ls in after), \
        "a scrape is not an API request"


def _stand_in_worker(client, answers: int, fail: bool = False) -> threading.Thread:
    """Takes `answers` jobs and writes each: a streamed job gets a piece of text first."""
    def run():
        for _ in range(answers):
            raw = None
            for _ in range(500):
                raw = client.lpop(keys.queue(FAKE_MODEL))
                if raw:
                    break
                time.sleep(0.01)
            job = Job.from_json(raw)
            if fail:
                client.publish(keys.channel(job.id), encode_result(Failure("it broke", code="worker_error")))
                continue
            if job.stream:
                client.publish(keys.channel(job.id), encode_result(TextDelta(" and", 0, 1)))
            client.publish(keys.channel(job.id), encode_result(Final(" and then", "length",
                                                                     len(job.prompt_ids), 2)))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_token_counters_are_the_sum_of_usage_and_streams_time_their_first_token(fake_redis):
    _register_worker(fake_redis)
    client = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    before = _metrics(client)
    _stand_in_worker(fake_redis, answers=4)
    usages = []
    for body in [{"prompt": "Once upon a time", "max_tokens": 2},
                 {"prompt": ["One", "Two"], "max_tokens": 2}]:
        response = client.post("/v1/completions", json={"model": FAKE_MODEL, **body})
        usages.append(response.get_json()["usage"])
    response = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "A stream", "max_tokens": 2,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in response.get_data(as_text=True).splitlines()
              if line.startswith("data: {")]
    usages.append(events[-1]["usage"])
    after = _metrics(client)
    assert grew(before, after, names.PROMPT_TOKENS, model=FAKE_MODEL) == sum(u["prompt_tokens"] for u in usages)
    assert grew(before, after, names.COMPLETION_TOKENS, model=FAKE_MODEL) == 8 == \
        sum(u["completion_tokens"] for u in usages)
    # Streams only: a whole answer's first token reaches its client with its last.
    assert grew(before, after, names.TIME_TO_FIRST_TOKEN + "_count", model=FAKE_MODEL) == 1


def test_an_error_inside_a_stream_is_counted_by_its_code(fake_redis):
    _register_worker(fake_redis)
    client = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    before = _metrics(client)
    _stand_in_worker(fake_redis, answers=1, fail=True)
    response = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "x", "stream": True})
    assert '"code": "worker_error"' in response.get_data(as_text=True)
    after = _metrics(client)
    assert grew(before, after, names.REQUESTS, route="/v1/completions", status=200) == 1
    assert grew(before, after, names.ERRORS, code="worker_error") == 1
    assert grew(before, after, names.COMPLETION_TOKENS) == 0


def _queue_job(client, model: str, priority: int, enqueued_at: float) -> None:
    job = Job(id=f"job-{priority}-{enqueued_at}", model=model, prompt_ids=[1, 2], params=SamplingParams(),
              deadline=time.time() + 60, enqueued_at=enqueued_at, priority=priority)
    client.rpush(keys.queue(model, priority), job.to_json())


def test_queues_workers_and_worker_starts_are_read_from_redis_when_scraped(fake_redis, api_client):
    queue = _register_worker(fake_redis)  # alive: a heartbeat
    queue.count_start(), queue.count_start()  # it started twice (a restart)
    now = time.time()
    _queue_job(fake_redis, FAKE_MODEL, 0, now - 30)
    _queue_job(fake_redis, FAKE_MODEL, 0, now - 5)
    _queue_job(fake_redis, FAKE_MODEL, -5, now - 12)  # taken first, but not the oldest
    # Another model: its only worker is gone (announced, no heartbeat), its jobs wait.
    fake_redis.hset(keys.WORKERS, "gone-1", "other")
    _queue_job(fake_redis, "other", 3, now - 2)
    # And one not served for days: forgotten, not reported as a model with no worker.
    fake_redis.zadd(keys.MODELS, {"retired": now - 3 * 24 * 3600})

    samples = _metrics(api_client)
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=0) == 2
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=-5) == 1
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL) == 3  # every priority is a series
    assert has(samples, names.QUEUE_DEPTH, model=FAKE_MODEL, priority=10)
    assert 30 <= value(samples, names.OLDEST_JOB_AGE, model=FAKE_MODEL) < 40
    assert value(samples, names.WORKERS_ALIVE, model=FAKE_MODEL) == 1
    assert value(samples, names.WORKER_STARTS, model=FAKE_MODEL) == 2
    assert value(samples, names.QUEUE_DEPTH, model="other", priority=3) == 1
    assert has(samples, names.WORKERS_ALIVE, model="other") and value(samples, names.WORKERS_ALIVE, model="other") == 0
    assert not has(samples, names.WORKERS_ALIVE, model="retired")

    fake_redis.delete(*keys.queues(FAKE_MODEL))
    samples = _metrics(api_client)
    assert value(samples, names.QUEUE_DEPTH, model=FAKE_MODEL) == 0
    assert value(samples, names.OLDEST_JOB_AGE, model=FAKE_MODEL) == 0


def test_metrics_still_answer_while_redis_is_down():
    dead = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))  # no retries: a refusal at once
    client = create_app(Settings(), client=dead).test_client()
    samples = _metrics(client)
    assert not has(samples, names.QUEUE_DEPTH)


def test_the_api_refuses_to_start_if_metrics_would_count_per_process():
    # This test process has imported prometheus_client already: in gunicorn's processes that would
    # mean each reports only its own requests, so `python -m api` stops rather than mislead.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        api.__main__._metrics_dir()


# A worker's metrics, in-process

def _exposition(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs):
    return load(tiny_model_dirs["llama"], dtype="float32", device="cpu")


def _shared_prefix_jobs(count: int) -> list[Job]:
    prefix = list(range(10, 42))  # two blocks of 16: the second request finds them in the cache
    return [Job(id=f"j{i}", model="tiny", prompt_ids=prefix + [50 + i],
                params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                deadline=time.time() + 60, enqueued_at=time.time() - 0.5) for i in range(count)]


def test_the_continuous_engines_numbers_reach_the_workers_metrics(tiny_llama):
    settings = Settings(block_size=16, kv_blocks=32, max_batch_tokens=64)
    engine = continuous.build(tiny_llama, settings, tiny_llama.model.state_dict(), tiny_llama.model.config)
    observed = WorkerMetrics("tiny-continuous")
    first, second = _shared_prefix_jobs(2)
    seqs = [engine.add(first)]
    batches = []
    while engine.busy:
        if len(seqs) == 1 and seqs[0].output_ids:  # the first one's prompt is in the cache now
            seqs.append(engine.add(second))
        engine.step()
        batches.append(engine.last_batch)
        observed.stepped(engine.last_batch)
    observed.finished(seqs)
    stats = engine.stats()
    assert stats["generated"] == 10 == sum(len(s.output_ids) for s in seqs)
    assert stats["prefix_hit_blocks"] == 2
    assert max(batches) == 2

    samples = _exposition(EngineCollector("tiny-continuous", engine, requeued=Counter(other=3),
                                          crashed=Counter()))
    assert value(samples, names.GENERATED_TOKENS, model="tiny-continuous") == 10
    assert value(samples, names.PREFIX_CACHE_HITS, model="tiny-continuous") == 2
    assert value(samples, names.PREEMPTIONS, model="tiny-continuous") == 0
    assert value(samples, names.RUNNING, model="tiny-continuous") == 0
    assert value(samples, names.KV_CACHE_USAGE, model="tiny-continuous") == 0  # all given back
    # Requeued jobs carry their own model; the worker's own model is there at 0.
    assert value(samples, names.REQUEUED_JOBS, model="other") == 3
    assert has(samples, names.REQUEUED_JOBS, model="tiny-continuous")
    assert has(samples, names.CRASHED_JOBS, model="tiny-continuous")


def test_the_static_engine_reports_what_it_has(tiny_llama):
    engine = StaticEngine(tiny_llama, capacity=4)
    for job in _shared_prefix_jobs(3):
        engine.add(job)
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        assert engine.last_batch in (0, 3)
    samples = _exposition(EngineCollector("tiny-static", engine, Counter(), Counter()))
    assert value(samples, names.GENERATED_TOKENS, model="tiny-static") == 15
    assert has(samples, names.RUNNING, model="tiny-static")
    assert not has(samples, names.KV_CACHE_USAGE)  # no paged cache, no usage: left out, not a 0


def test_worker_histograms_observe_queue_wait_per_token_time_and_batches():
    observed = WorkerMetrics("histograms")
    job = _shared_prefix_jobs(1)[0]
    observed.taken(job)
    observed.taken(Job(id="old-api", model="m", prompt_ids=[1], params=SamplingParams(), deadline=0))
    samples = parse(generate_latest().decode())
    assert value(samples, names.QUEUE_WAIT + "_count", model="histograms") == 1  # unstamped: not observed
    assert 0.5 <= value(samples, names.QUEUE_WAIT + "_sum", model="histograms") < 5


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
    worker = _worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "worker", "--metrics-port", str(worker_port),
                     "--kv-blocks", "4", "--block-size", "16")
    # PROMETHEUS_MULTIPROC_DIR given: the API empties it of an earlier run's files (this one would
    # not even parse) and counts there.
    counted_in = tmp_path / "api-metrics"
    counted_in.mkdir()
    (counted_in / "counter_1.db").write_bytes(b"left over")
    port = free_port()
    api = start(["api", "--port", str(port), "--redis-url", redis_alone.url, "--api-workers", "2",
                 "--max-queue", "2"], tmp_path, "api", PROMETHEUS_MULTIPROC_DIR=str(counted_in))
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
    port = free_port()
    worker_ports = [free_port(), free_port()]
    api = start(["api", "--port", str(port), "--redis-url", redis_alone.url, "--api-workers", "2",
                 "--max-queue", "2", "--worker-grace", "1"], tmp_path, "api")
    prometheus, prometheus_proc = _start_prometheus(tmp_path, port, worker_ports)  # from the start: for deriv()
    workers = [_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, f"worker{i}", "--metrics-port", str(p))
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
