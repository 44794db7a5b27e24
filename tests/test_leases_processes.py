"""Leases with real processes on a private redis-server: a worker cut off mid-stream (SIGSTOP: it
neither beats nor publishes, as behind a cut link) past its heartbeat's life, while another worker
writes its job again; once it is back, the client has the answer once and the first worker drops it.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from shared import keys
from tests.processes import (MODEL, live_worker_ids, logs, make_client, models_served, start_api, stop, tiny_worker,
                             wait_until)

pytestmark = pytest.mark.timeout(180)


def _finals(messages: list, channel: bytes) -> int:
    return sum(1 for m in messages if m["channel"] == channel and json.loads(m["data"])["type"] == "final")


def test_a_worker_cut_off_mid_stream_drops_its_job_and_the_client_gets_the_text_once(
        redis_alone, tiny_model_dirs, tmp_path):
    port, api = start_api(redis_alone, tmp_path, "api")
    first = tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "first")
    second = None
    procs = [api, first]
    redis = redis_alone.client()
    try:
        wait_until(lambda: MODEL in models_served(port), procs, "the first worker")
        (first_id,) = live_worker_ids(redis)
        second = tiny_worker(tiny_model_dirs["llama"], redis_alone, tmp_path, "second")
        procs.append(second)
        wait_until(lambda: len(live_worker_ids(redis)) == 2, procs, "the second worker")
        client = make_client(port)
        request = dict(model=MODEL, prompt="The dragon", max_tokens=110, temperature=0,
                       extra_body={"ignore_eos": True})
        expected = client.completions.create(**request).choices[0].text

        # Every message on every job's channel, to count the final answers published.
        heard, listening = [], redis_alone.client().pubsub()
        listening.psubscribe(keys.channel(MODEL, "*"))
        assert listening.get_message(timeout=1)["type"] == "psubscribe"
        done = threading.Event()

        def listen():
            while not done.is_set():
                message = listening.get_message(timeout=0.1)
                if message:
                    heard.append(message)

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        # The first worker takes the job: the second stands still for a moment (well within its
        # heartbeat's life).
        second.send_signal(signal.SIGSTOP)
        chunks = iter(client.completions.create(stream=True, **request))
        text = next(chunks).choices[0].text
        first.send_signal(signal.SIGSTOP)  # mid-stream: cut off
        second.send_signal(signal.SIGCONT)
        held = redis.lrange(keys.processing(MODEL, first_id), 0, -1)
        assert len(held) == 1, "the first worker had finished before it was cut off"
        job_id = json.loads(held[0])["id"]
        text += "".join(chunk.choices[0].text for chunk in chunks)  # written again by the second
        assert not redis.exists(keys.processing(MODEL, first_id))
        time.sleep(1)  # the cut lasts well past the heartbeat's 3 s
        first.send_signal(signal.SIGCONT)
        wait_until(lambda: "dropped 1 job(s) without publishing" in logs(first), procs, "the drop", 30)
        time.sleep(1.5)  # anything it would still publish would be heard by now
        done.set()
        listener.join()
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
        for proc in procs:
            stop(proc)
    assert text == expected
    assert _finals(heard, keys.channel(MODEL, job_id).encode()) == 1, logs(first, second)
    assert job_id in logs(first)
    assert f"worker {first_id} is gone: 1 job(s) back in the queue" in logs(second)
