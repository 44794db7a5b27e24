"""The batch API on the real service: a private redis-server, the API, a tiny-model worker and RQ's
batch worker (`python -m batch`), files in a directory both share (--files-dir).

The issue's bar: a batch of 50 requests completes with 50 answers in input order, while live
players' requests beside it keep their latency. Here that is checked by what keeps it, read from
Redis as it happens: the batch's jobs go at the lowest priority, whatever its lines asked, and
never hold more than --batch-concurrency of the worker's slots. The latency ratio itself (alone
vs beside the batch) is a measurement, not a pass/fail on a shared 2-core machine: it is
bench/batch_beside_live.py's. Then the examples/ run against the same stack.
"""
from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import threading
import time

import pytest

from shared import keys
from shared.protocol import PRIORITY_DEFAULT, PRIORITY_MAX, Job
from tests.processes import (ROOT, RedisServer, live_worker_ids, logs, make_client, models_served, start, start_api, stop,
                             tiny_worker, wait_until)
from worker.faults import as_env

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-llama"
BATCH_CONCURRENCY = 2   # of the worker's 8 slots: the batch never holds all of them, and lasts longer than
                        # the live players' 30 requests beside it (at 4 it could finish first)
LIVE_REQUESTS = 30
# The tiny model's steps take ~1 ms, so its requests' time was mostly HTTP and tokenizing, which the
# batch does not slow: the batch's 5,000 tokens could end before the live players' 30 requests did.
# A few ms a step, as a real model's, makes the steps what both share.
STEP_TIME = as_env(step_delay_s=0.005)


@pytest.fixture(scope="module")
def service(tiny_model_dirs, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("batch-service")
    files_dir = str(log_dir / "files")
    server = RedisServer(str(log_dir))
    server.start()
    port, api = start_api(server, log_dir, "api", "--files-dir", files_dir)
    procs = [
        api,
        tiny_worker(tiny_model_dirs["llama"], server, log_dir, "worker", "--batch", "8", **STEP_TIME),
        start(["batch", "--redis-url", server.url, "--api-url", f"http://127.0.0.1:{port}/v1",
               "--batch-concurrency", str(BATCH_CONCURRENCY), "--files-dir", files_dir], log_dir, "batch-worker"),
    ]
    try:
        wait_until(lambda: MODEL in models_served(port), procs, "the stack")
        yield port, procs, server
    finally:
        for proc in procs:
            stop(proc)
        server.stop()


def live_latencies(client, count: int) -> list[float]:
    """A player's requests, one after another, all alike: seconds each took."""
    took = []
    for _ in range(count):
        began = time.monotonic()
        done = client.completions.create(model=MODEL, prompt="The player asks the innkeeper", max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
        took.append(time.monotonic() - began)
        assert done.usage.completion_tokens == 16
    return took


def jobs_by_priority(client) -> dict[int, int]:
    """How many jobs of each priority wait in the queues or are held by a worker, now (one MULTI,
    so queued and held are read at one moment)."""
    lists = keys.queues(MODEL) + [keys.processing(MODEL, w) for w in live_worker_ids(client)]
    pipe = client.pipeline(transaction=True)
    for name in lists:
        pipe.lrange(name, 0, -1)
    counts: dict[int, int] = {}
    for raws in pipe.execute():
        for raw in raws:
            priority = Job.from_json(raw).priority
            counts[priority] = counts.get(priority, 0) + 1
    return counts


def test_a_batch_of_50_completes_in_order_while_live_players_keep_their_latency(service):
    port, procs, server = service
    client = make_client(port)
    live_latencies(client, 3)  # warm: the API's tokenizer cache, the worker's first steps
    alone = live_latencies(client, LIVE_REQUESTS)

    ids = [f"lore-{i:02d}" for i in range(50)]
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"The legend of place {i}", "max_tokens": 100,
                       "ignore_eos": True, "priority": -10}}  # asks to go first: a batch never does
             for i, cid in enumerate(ids)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("lore.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, procs,
               "the batch's first answer", timeout=60)
    before = client.batches.retrieve(batch.id).request_counts.completed
    samples, sampling = [], threading.Event()

    def sample():  # what Redis holds, every few ms, while the live players play
        redis = server.client()
        while not sampling.wait(0.005):
            samples.append(jobs_by_priority(redis))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        alongside = live_latencies(client, LIVE_REQUESTS)
    finally:
        sampling.set()
        sampler.join()
    after = client.batches.retrieve(batch.id)
    # The live requests did run alongside the batch: it went on answering, and had more to do.
    assert after.status == "in_progress" and before < after.request_counts.completed < 50, after

    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", procs, "the batch", timeout=120)
    done = client.batches.retrieve(batch.id)
    assert done.request_counts.total == done.request_counts.completed == 50 and done.request_counts.failed == 0
    assert done.error_file_id is None and done.completed_at >= done.in_progress_at >= done.created_at
    answers = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [a["custom_id"] for a in answers] == ids
    assert all(a["response"]["status_code"] == 200 and a["error"] is None for a in answers)
    assert all(a["response"]["body"]["usage"]["completion_tokens"] == 100 for a in answers)

    # What keeps the players' latency: at every moment, the batch's jobs (the lowest priority, though
    # its lines asked for the highest) held at most BATCH_CONCURRENCY places, queued or running, so
    # the worker's other slots and the front of the queue stayed the players'. Only the players' and
    # the batch's priorities were ever seen.
    assert samples and any(s.get(PRIORITY_MAX) for s in samples), samples[:20]
    assert all(set(s) <= {PRIORITY_DEFAULT, PRIORITY_MAX} for s in samples), [s for s in samples if
                                                                            set(s) - {PRIORITY_DEFAULT, PRIORITY_MAX}][:5]
    assert max(s.get(PRIORITY_MAX, 0) for s in samples) <= BATCH_CONCURRENCY, max(samples, key=lambda s: s.get(
        PRIORITY_MAX, 0))
    # Printed, not asserted: a ratio of times on a shared machine (bench/batch_beside_live.py measures it).
    print(f"live median {statistics.median(alone):.3f} s alone, {statistics.median(alongside):.3f} s beside "
          f"the batch: {statistics.median(alongside) / statistics.median(alone):.2f}x")


def test_a_running_batch_cancelled_keeps_its_answers_and_names_what_never_ran(service):
    port, procs, _ = service
    client = make_client(port)
    lines = [{"custom_id": f"npc-{i:02d}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Bark {i}"}], "max_tokens": 100,
                       "ignore_eos": True}} for i in range(40)]
    upload = client.files.create(file=("barks.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines)
                                                                 .encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, procs, "two answers")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled", procs, "the cancel", timeout=60)
    done = client.batches.retrieve(batch.id)
    answered = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    unsent = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(answered) == done.request_counts.completed and 2 <= len(answered) < 40
    assert {u["error"]["code"] for u in unsent} == {"batch_cancelled"}
    assert sorted(a["custom_id"] for a in answered + unsent) == [line["custom_id"] for line in lines]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_nanommo_client_streams_stories_to_several_players(service):
    port, _, _ = service
    ran = run_example("nanommo_client.py", "--url", f"http://127.0.0.1:{port}/v1", "--players", "4",
                      "--turns", "1", "--max-tokens", "8")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "4 players, 4 stories from tiny-llama" in ran.stdout and "0 players failed" in ran.stdout
    assert all(f"[{name}]" in ran.stdout for name in ("Aria", "Borin", "Cael", "Dara"))


def test_batch_lore_uploads_polls_and_prints_every_legend(service):
    port, _, _ = service
    ran = run_example("batch_lore.py", "--url", f"http://127.0.0.1:{port}/v1", "--requests", "5",
                      "--max-tokens", "8", "--poll", "0.2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "completed, 5 answered, 0 failed" in ran.stdout
    printed = [line.split(":")[0] for line in ran.stdout.splitlines() if line.startswith("lore-")]
    assert printed == [f"lore-{i:04d}" for i in range(5)]
