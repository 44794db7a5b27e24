"""A worker SIGKILLed mid-stream, with real processes on a private redis-server: its jobs go back
to the queue with their records of written tokens, and the other worker continues them. Every
stream, greedy and seeded, ends whole with exactly the text it writes undisturbed, and the
survivor's metrics show that it did not decode the written part again.

Three pools: tiny-Llama workers in float32; (slow) two default workers, as a new user starts them:
the packaged SmolLM2 GGUF with the default dtype and kernels; and (slow) two workers on that file
requantized to Q4_K_M by llama.cpp's quantizer (the common download: its Q4_K, Q5_0 and Q6_K tensors
on the K-quant kernel), started with MODEL=<the file> and serving it by the file's stem.
"""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import pytest

from shared import metrics as names
from tests.processes import (MODEL, default_worker, free_port, holding, logs, make_client, start_api, stop, tiny_worker,
                             wait_until)
from tests.prometheus_text import scrape, value
from worker.faults import as_env
from worker.model_loader import PACKAGED_NAME

pytestmark = pytest.mark.timeout(240)

STREAMS = 16
SLOW = as_env(step_delay_s=0.05)  # ~2.5 s a stream: the kill lands well inside every one
KILL_AFTER = 8  # pieces of text every stream has had by the kill


class Pool(NamedTuple):
    model: str
    max_tokens: int
    start: Callable  # (server, log dir, name, metrics port) -> the worker's process
    load_s: float  # how long its workers may take to start


@pytest.fixture(params=["tiny-llama", pytest.param("smollm2", marks=pytest.mark.slow),
                        pytest.param("smollm2-q4_k_m", marks=[pytest.mark.slow, pytest.mark.timeout(420)])])
def pool(request, tiny_model_dirs) -> Pool:
    if request.param == "tiny-llama":
        return Pool(MODEL, 48, lambda server, log_dir, name, port: tiny_worker(
            tiny_model_dirs["llama"], server, log_dir, name, "--metrics-port", str(port), **SLOW),
            load_s=90)
    request.getfixturevalue("kernel")  # built once, before two workers would each build it
    if request.param == "smollm2-q4_k_m":
        path = Path(request.getfixturevalue("smollm2_gguf")("Q4_K_M"))
        return Pool(path.stem, 40, lambda server, log_dir, name, port: default_worker(
            server.url, log_dir, name, "--metrics-port", str(port), MODEL=str(path), **SLOW), load_s=300)
    return Pool(PACKAGED_NAME, 40, lambda server, log_dir, name, port: default_worker(
        server.url, log_dir, name, "--metrics-port", str(port), **SLOW), load_s=180)


def _request(pool: Pool, i: int) -> dict:
    sampled = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if i % 2 else dict(temperature=0)
    return dict(model=pool.model, prompt=f"Player {i} asks the storyteller for a tale", max_tokens=pool.max_tokens,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampled)


class Stream:
    """One streamed completion read in a thread: its text so far, how it ended."""

    def __init__(self, client, request: dict):
        self.text, self.chunks, self.finish, self.usage = "", 0, None, None
        self.thread = threading.Thread(target=self._read, args=(client, request), daemon=True)
        self.thread.start()

    def _read(self, client, request: dict) -> None:
        for chunk in client.completions.create(**request):
            if chunk.usage:
                self.usage = chunk.usage.completion_tokens
            if chunk.choices:
                self.text += chunk.choices[0].text
                self.chunks += bool(chunk.choices[0].text)
                self.finish = chunk.choices[0].finish_reason or self.finish


def test_a_worker_killed_mid_stream_its_jobs_resume_on_the_other(pool, redis_alone, tmp_path):
    port, api = start_api(redis_alone, tmp_path, "api")
    metrics_ports = [free_port(), free_port()]
    workers = [pool.start(redis_alone, tmp_path, f"worker{i}", p) for i, p in enumerate(metrics_ports)]
    procs = [api, *workers]
    try:
        wait_until(lambda: len(holding(redis_alone.client(), pool.model)) == 2, procs, "two workers",
                   timeout=pool.load_s)
        client = make_client(port)
        with ThreadPoolExecutor(STREAMS) as crowd:  # undisturbed: what each stream writes, as a crowd
            undisturbed = list(crowd.map(lambda i: "".join(
                c.choices[0].text for c in client.completions.create(**_request(pool, i)) if c.choices),
                range(STREAMS)))
        before = [scrape(f"http://127.0.0.1:{p}/metrics") for p in metrics_ports]

        streams = [Stream(client, _request(pool, i)) for i in range(STREAMS)]
        wait_until(lambda: all(s.chunks >= KILL_AFTER for s in streams), procs, "every stream's first texts",
                   timeout=30)
        held = holding(redis_alone.client(), pool.model)
        victim = max(workers, key=lambda w: held.get(w.pid, 0))
        victim.send_signal(signal.SIGKILL)  # no drain: its jobs stay in its processing list
        killed_at = time.monotonic()
        assert not any(s.finish for s in streams), "a stream ended before the kill: it was not mid-stream"
        for s in streams:
            s.thread.join(60)
        finished_at = time.monotonic()  # here, not after the processes' stops below (seconds each, loaded)
        survivor_index = 1 - workers.index(victim)
        after = scrape(f"http://127.0.0.1:{metrics_ports[survivor_index]}/metrics")
        survivor = workers[survivor_index]
    finally:
        for proc in procs:
            stop(proc)
    assert victim.returncode == -signal.SIGKILL
    # Taken back once the victim's 3 s heartbeat lapsed, and finished seconds later; a crowd left to
    # its 300 s request_timeout would not be done in 60 s, a bound no load on 2 cores comes near.
    assert held[victim.pid] > 0 and finished_at - killed_at < 60
    assert [s.text for s in streams] == undisturbed, logs(survivor)
    assert all(s.finish == "length" and s.usage == pool.max_tokens for s in streams)
    # The survivor wrote every token of the crowd but the ones it resumed: the written part of each
    # job it took back was computed as prompt, not decoded again.
    resumed, generated = (value(after, name, model=pool.model) - value(before[survivor_index], name, model=pool.model)
                          for name in (names.RESUMED_TOKENS, names.GENERATED_TOKENS))
    assert resumed >= KILL_AFTER * held[victim.pid], "each job taken back had sent text, so had a record"
    assert generated + resumed == STREAMS * pool.max_tokens
    assert "resumes after the" in logs(survivor)
