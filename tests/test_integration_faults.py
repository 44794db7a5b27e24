"""Integration tests that stop or kill things: Redis down, a worker drained by SIGTERM, a worker
killed mid-stream, Redis restarted under a running worker. Each brings processes of its own (its
workers, or its Redis and API as well), so it cannot break the shared stack of
tests/test_integration.py, whose API and Redis some of them use.
"""
from __future__ import annotations

import json
import signal
import time

import openai
import pytest

from shared import keys
from tests.live_stack import finish_reasons, stack  # noqa: F401 (a fixture)
from tests.processes import (MODEL, RedisServer, get_json, logs, make_client, models_served, start, start_api, stop,
                             tiny_worker, wait_until)
from worker.faults import as_env

pytestmark = pytest.mark.timeout(120)


# Redis down, no worker: fast 503s from an API of its own

def test_no_worker_then_redis_down_give_fast_503(tmp_path):
    server = RedisServer(str(tmp_path))
    server.start()
    port, api = start_api(server, tmp_path, "api")
    try:
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] == 200, [api], "/health")
        client = make_client(port)

        def fails_fast_with_503(expected_words: str):
            began = time.monotonic()
            with pytest.raises(openai.InternalServerError) as caught:
                client.completions.create(model=MODEL, prompt="Once", max_tokens=2)
            # At once: well under 15 s even on a loaded 2-core machine, where waiting for a worker
            # would take the API's 60 s grace (or the 300 s request timeout).
            assert time.monotonic() - began < 15, "a 503 must come at once, not after waiting for a worker"
            assert caught.value.status_code == 503 and caught.value.code == "service_unavailable"
            assert expected_words in caught.value.message

        # An empty Redis: no worker has announced itself.
        assert get_json(f"http://127.0.0.1:{port}/health")[1]["workers"] == 0
        fails_fast_with_503("no worker is running")

        server.stop()
        fails_fast_with_503("Redis")
        assert get_json(f"http://127.0.0.1:{port}/health")[0] == 503

        # Redis back on the same port: the API reconnects by itself.
        server.start()
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] == 200, [api], "/health again",
                   timeout=10)
    finally:
        stop(api)
        server.stop()


# SIGTERM drains

def test_sigterm_lets_the_worker_finish_its_request(stack, tiny_model_dirs, tmp_path):
    # A worker of its own, under another model name, so the request cannot go to the shared worker.
    name = "tiny-drain"
    worker = start(["worker", "--model", tiny_model_dirs["llama"], "--model-name", name, "--dtype", "float32",
                    "--batch", "4", "--wait", "5"], tmp_path, "drain-worker", REDIS_URL=stack.redis_server.url)
    try:
        wait_until(lambda: name in models_served(stack.port), [worker, stack.api], f"/v1/models to list {name}")
        (worker_id,) = stack.worker_ids(name)
        stream = make_client(stack.port).completions.create(
            model=name, prompt="Once", temperature=0, max_tokens=120, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = []
        for chunk in stream:
            if not chunks:
                worker.send_signal(signal.SIGTERM)  # after the first piece of text: mid-request
            chunks.append(chunk)
        assert worker.wait(15) == 0, logs(worker)
    finally:
        stop(worker)
    # The signal came while the request was held, and the request was still written to the end.
    assert "stopping: finishing 1 request(s)" in logs(worker)
    assert finish_reasons(chunks) == ["length"]
    assert chunks[-1].usage.completion_tokens == 120
    # A clean exit leaves nothing behind: no heartbeat, no registration, the model no longer listed.
    assert not stack.redis.exists(keys.heartbeat(name, worker_id))
    assert not stack.redis.hexists(keys.WORKERS, worker_id)
    assert not stack.redis.exists(keys.processing(name, worker_id))
    assert name not in models_served(stack.port)


# A worker killed mid-stream

STEP_DELAY_S = 0.05  # seconds each paced worker sleeps after each step


def test_stream_survives_worker_killed_mid_job(stack, tiny_model_dirs, tmp_path):
    # Two workers of their own for one model: the one holding the job dies, the other finishes it.
    # Each is paced (the tests' step_delay_s fault, worker/faults.py): the 120 tokens take at least
    # STEP_DELAY_S * 120 = 6 s, so when the first piece of text arrives the job is certainly still
    # in its worker's processing list, however fast or loaded the machine (unpaced, the tiny model
    # could write them all before the test looked, and the kill would not be mid-stream).
    name = "tiny-crash"
    pair = [start(["worker", "--model", tiny_model_dirs["llama"], "--model-name", name, "--dtype", "float32",
                   "--batch", "4", "--wait", "5"], tmp_path, f"crash-worker-{i}", REDIS_URL=stack.redis_server.url,
                  **as_env(step_delay_s=STEP_DELAY_S))
            for i in range(2)]
    try:
        wait_until(lambda: len(stack.worker_ids(name)) == 2, pair, f"two workers of {name}")
        ids = {json.loads(stack.redis.get(keys.heartbeat(name, i)))["pid"]: i for i in stack.worker_ids(name)}
        client = make_client(stack.port)
        request = dict(model=name, prompt="Once", temperature=0, max_tokens=120, extra_body={"ignore_eos": True})
        text, killed = "", None
        for chunk in client.completions.create(stream=True, **request):
            if killed is None:
                job_id = chunk.id.removeprefix("cmpl-") + "-0"
                for proc in pair:
                    held = stack.redis.lrange(keys.processing(name, ids[proc.pid]), 0, -1)
                    if any(job_id.encode() in raw for raw in held):
                        proc.kill()  # SIGKILL: no drain, the job stays in its processing list
                        killed = proc
                assert killed is not None, (f"job {job_id} was in no worker's processing list at its first "
                                            f"piece of text: the kill could not land mid-stream")
            text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason
        # Greedy: the survivor writes the same text again, alone.
        whole = client.completions.create(**request).choices[0].text
    finally:
        for proc in pair:
            stop(proc)
    assert killed.returncode == -signal.SIGKILL
    assert finish == "length"
    assert text == whole, "the streamed text is not the answer"


# Redis restarted under a running worker

def test_worker_outlives_a_redis_restart(tiny_model_dirs, tmp_path):
    server = RedisServer(str(tmp_path))
    server.start()
    worker = tiny_worker(tiny_model_dirs["llama"], server, tmp_path, "worker")
    port, api = start_api(server, tmp_path, "api")
    try:
        wait_until(lambda: MODEL in models_served(port), [worker, api], "the worker")
        server.stop()
        time.sleep(2)  # longer than a heartbeat: the worker's loop and heartbeat both hit a dead Redis
        server.start()  # empty: no heartbeat, no tokenizer, nothing
        # The worker announces itself and stores its tokenizer again, and serves as before.
        wait_until(lambda: MODEL in models_served(port), [worker, api], "the worker after the restart",
                   timeout=15)
        answer = make_client(port).completions.create(model=MODEL, prompt="Once", max_tokens=4,
                                                      extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4
        assert worker.poll() is None, logs(worker)
        assert "Redis unreachable" in logs(worker)
    finally:
        stop(api), stop(worker)
        server.stop()
