"""A worker SIGKILLed mid-stream, with real processes on a private redis-server: its jobs go back
to the queue with their records of written tokens, and the other worker continues them. Every
stream, greedy and seeded, ends whole with exactly the text it writes undisturbed, and the
survivor's metrics show that it did not decode the written part again.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve import free_port
from shared import keys
from shared import metrics as names
from tests.processes import logs, make_client, stop, wait_until
from tests.test_metrics import scrape, value
from tests.test_reliability import MODEL, _api, _worker, redis_alone  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(240)

STREAMS, MAX_TOKENS = 16, 48
STEP_DELAY_S = "0.05"  # ~2.5 s a stream: the kill lands well inside every one


def _request(i: int) -> dict:
    sampled = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if i % 2 else dict(temperature=0)
    return dict(model=MODEL, prompt=f"Player {i} asks the storyteller for a tale", max_tokens=MAX_TOKENS,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampled)


class Stream:
    """One streamed completion read in a thread: its text so far, how it ended."""

    def __init__(self, client, i: int):
        self.text, self.chunks, self.finish, self.usage = "", 0, None, None
        self.thread = threading.Thread(target=self._read, args=(client, i), daemon=True)
        self.thread.start()

    def _read(self, client, i: int) -> None:
        for chunk in client.completions.create(**_request(i)):
            if chunk.usage:
                self.usage = chunk.usage.completion_tokens
            if chunk.choices:
                self.text += chunk.choices[0].text
                self.chunks += bool(chunk.choices[0].text)
                self.finish = chunk.choices[0].finish_reason or self.finish


def _holding(client) -> dict[int, int]:
    """pid -> how many jobs each live worker holds."""
    held = {}
    for worker_id in [i.decode() for i in client.hkeys(keys.WORKERS)]:
        beat = client.get(keys.heartbeat(MODEL, worker_id))
        if beat:
            held[json.loads(beat)["pid"]] = client.llen(keys.processing(MODEL, worker_id))
    return held


def test_a_worker_killed_mid_stream_its_jobs_resume_on_the_other(redis_alone, tiny_model_dirs, tmp_path):
    port, api = _api(redis_alone, tmp_path, "api")
    metrics_ports = [free_port(), free_port()]
    workers = [_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, f"worker{i}", "--metrics-port",
                       str(p), STEP_DELAY_S=STEP_DELAY_S) for i, p in enumerate(metrics_ports)]
    procs = [api, *workers]
    try:
        wait_until(lambda: len(_holding(redis_alone.client())) == 2, procs, "two workers")
        client = make_client(port)
        with ThreadPoolExecutor(STREAMS) as pool:  # undisturbed: what each stream writes
            undisturbed = list(pool.map(lambda i: "".join(
                c.choices[0].text for c in client.completions.create(**_request(i)) if c.choices), range(STREAMS)))
        before = [scrape(f"http://127.0.0.1:{p}/metrics") for p in metrics_ports]

        streams = [Stream(client, i) for i in range(STREAMS)]
        wait_until(lambda: all(s.chunks for s in streams), procs, "every stream's first text", timeout=30)
        held = _holding(redis_alone.client())
        victim = max(workers, key=lambda w: held.get(w.pid, 0))
        victim.send_signal(signal.SIGKILL)  # no drain: its jobs stay in its processing list
        killed_at = time.monotonic()
        assert not any(s.finish for s in streams), "a stream ended before the kill: it was not mid-stream"
        for s in streams:
            s.thread.join(60)
        survivor_index = 1 - workers.index(victim)
        after = scrape(f"http://127.0.0.1:{metrics_ports[survivor_index]}/metrics")
        survivor = workers[survivor_index]
    finally:
        for proc in procs:
            stop(proc)
    assert victim.returncode == -signal.SIGKILL
    assert held[victim.pid] > 0 and time.monotonic() - killed_at < 60
    assert [s.text for s in streams] == undisturbed, logs(survivor)
    assert all(s.finish == "length" and s.usage == MAX_TOKENS for s in streams)
    # The survivor wrote every token of the crowd but the ones it resumed: the written part of each
    # job it took back was computed as prompt, not decoded again.
    resumed = value(after, names.RESUMED_TOKENS, model=MODEL) - value(before[survivor_index], names.RESUMED_TOKENS,
                                                                       model=MODEL)
    generated = value(after, names.GENERATED_TOKENS, model=MODEL) - value(before[survivor_index],
                                                                          names.GENERATED_TOKENS, model=MODEL)
    assert resumed >= held[victim.pid], "each job taken back had sent text, so had a record"
    assert generated + resumed == STREAMS * MAX_TOKENS
    assert "resumes after the" in logs(survivor)
