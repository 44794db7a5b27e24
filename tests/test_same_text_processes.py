"""Same request, same text, through the whole stack with real processes and the official openai
client, on default workers (the packaged SmolLM2 GGUF, the default dtype and kernels): two workers
started one after the other write identical texts for the same crowd (greedy and seeded,
completions and chat, streamed and not, all sent at once), both announcing the same numerics
fingerprint, "+invariant"; and a greedy chat request writes the same text streamed and not.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared import keys
from shared.protocol import WorkerInfo
from tests.processes import default_worker, holding, logs, make_client, start_api, stop, wait_until
from worker.model_loader import PACKAGED_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TOPICS = ["a brave dragon", "a skeleton guarding a gate", "a haunted tavern", "a lost crown", "an old bard",
          "a storm at sea", "a goblin market", "a knight and a castle"]
# The case: once "Once upon a time, there was a young and brave wolf..." streamed and
# "Once upona road, a young and brave wolf..." not.
WOLF = dict(model=PACKAGED_NAME, max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": "Tell a short story about a young and brave wolf."}])


def _crowd() -> list[tuple[str, dict]]:
    """16 requests, every mix of chat or completion, greedy or seeded, streamed or not, twice over;
    and the wolf, streamed and not."""
    requests = []
    for i in range(16):
        chat, seeded, stream = i % 2 == 0, i // 2 % 2 == 1, i // 4 % 2 == 1
        topic = TOPICS[i % len(TOPICS)]
        params = dict(model=PACKAGED_NAME, max_tokens=24 + i % 4 * 4, stream=stream,
                      **(dict(temperature=0.8, top_p=0.95, seed=2000 + i) if seeded else dict(temperature=0)))
        if chat:
            requests.append(("chat", dict(messages=[{"role": "user", "content": f"Tell a story about {topic}."}],
                                          **params)))
        else:
            requests.append(("completion", dict(prompt=f"Once upon a time, {topic}", **params)))
    return requests + [("chat", dict(WOLF, stream=True)), ("chat", dict(WOLF, stream=False))]


def _write(client, request: tuple[str, dict]) -> str:
    kind, params = request
    if kind == "chat":
        answer = client.chat.completions.create(**params)
        if params["stream"]:
            return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        return answer.choices[0].message.content
    answer = client.completions.create(**params)
    if params["stream"]:
        return "".join(c.choices[0].text for c in answer if c.choices)
    return answer.choices[0].text


def _numerics(client, pid: int) -> str:
    """The numerics fingerprint in the heartbeat of the worker with this pid."""
    for worker_id in [i.decode() for i in client.hkeys(keys.WORKERS)]:
        beat = client.get(keys.heartbeat(PACKAGED_NAME, worker_id))
        if beat and json.loads(beat)["pid"] == pid:
            return WorkerInfo.from_json(beat).numerics
    raise AssertionError(f"no heartbeat from worker {pid}")


def test_two_default_workers_started_one_after_the_other_write_the_same_texts(redis_alone, tmp_path, kernel):
    port, api = start_api(redis_alone, tmp_path, "api")
    client, crowd, written, fingerprints = make_client(port), _crowd(), [], []
    try:
        for name in ("A", "B"):  # one at a time: B starts after A is gone
            worker = default_worker(redis_alone.url, tmp_path, name)  # one thread, as tests/processes.py sets
            try:
                wait_until(lambda: worker.pid in holding(redis_alone.client(), PACKAGED_NAME), [api, worker],
                           f"worker {name} to load", timeout=180)
                fingerprints.append(_numerics(redis_alone.client(), worker.pid))
                with ThreadPoolExecutor(len(crowd)) as pool:  # all at once: they share steps
                    written.append(list(pool.map(lambda r: _write(client, r), crowd)))
                if name == "A":  # and the wolf alone, streamed then not, one after the other
                    alone = [_write(client, ("chat", dict(WOLF, stream=stream))) for stream in (True, False)]
            finally:
                stop(worker)
            assert worker.returncode == 0, logs(worker)
    finally:
        stop(api)
    first, second = written
    assert fingerprints[0] == fingerprints[1] and fingerprints[0].endswith("+invariant"), fingerprints
    assert all(first), first
    assert first == second
    # The wolf: streamed and not, in the crowd and alone, on both workers.
    assert first[-2] == first[-1] == alone[0] == alone[1], (first[-2:], alone)
