"""Same request, same text, through the whole stack with real processes and the official openai
client, on default workers (the packaged SmolLM2 GGUF, the default dtype and kernels, and torch's
own thread count, one per core: the rows of a step split across threads as a user's worker splits
them): each request of a crowd (greedy and seeded, completions and chat, streamed and not, 32-44
tokens each whatever it writes, all sent at once) writes what it writes sent alone, one after the
other, to the same worker; a second worker started after the first is gone writes the same crowd
the same; both announce the same numerics fingerprint, "+invariant"; and a greedy chat request
writes the same text streamed and not.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
    """16 requests, every mix of chat or completion, greedy or seeded, streamed or not, twice over,
    each writing 32-44 tokens (end of text ignored: long enough for a difference in a step's
    numbers to change a token); and the wolf, streamed and not."""
    requests = []
    for i in range(16):
        chat, seeded, stream = i % 2 == 0, i // 2 % 2 == 1, i // 4 % 2 == 1
        topic = TOPICS[i % len(TOPICS)]
        params = dict(model=PACKAGED_NAME, max_tokens=32 + i % 4 * 4, stream=stream, extra_body={"ignore_eos": True},
                      **(dict(temperature=0.8, top_p=0.95, seed=2000 + i) if seeded else dict(temperature=0)))
        if chat:
            requests.append(("chat", dict(messages=[{"role": "user", "content": f"Tell a story about {topic}."}],
                                          **params)))
        else:
            requests.append(("completion", dict(prompt=f"Once upon a time, {topic}", **params)))
    return requests + [("chat", dict(WOLF, stream=True)), ("chat", dict(WOLF, stream=False))]


def _write(client, request: tuple[str, dict]) -> tuple[str, int]:
    """(the text, its number of tokens)."""
    kind, params = request
    if params["stream"]:
        params = dict(params, stream_options={"include_usage": True})
    if kind == "chat":
        answer = client.chat.completions.create(**params)
        if params["stream"]:
            chunks = list(answer)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        return answer.choices[0].message.content, answer.usage.completion_tokens
    answer = client.completions.create(**params)
    if params["stream"]:
        chunks = list(answer)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
    return answer.choices[0].text, answer.usage.completion_tokens


def _numerics(client, pid: int) -> str:
    """The numerics fingerprint in the heartbeat of the worker with this pid."""
    for worker_id in [i.decode() for i in client.hkeys(keys.WORKERS)]:
        beat = client.get(keys.heartbeat(PACKAGED_NAME, worker_id))
        if beat and json.loads(beat)["pid"] == pid:
            return WorkerInfo.from_json(beat).numerics
    raise AssertionError(f"no heartbeat from worker {pid}")


def test_each_request_of_a_crowd_writes_what_it_writes_alone_on_default_workers(redis_alone, tmp_path, kernel):
    port, api = start_api(redis_alone, tmp_path, "api")
    client, crowd, together, fingerprints = make_client(port), _crowd(), [], []
    try:
        for name in ("A", "B"):  # one at a time: B starts after A is gone
            # OMP_NUM_THREADS unset (tests/processes.py sets 1): torch's own count, as a user's worker runs.
            worker = default_worker(redis_alone.url, tmp_path, name, OMP_NUM_THREADS=None)
            try:
                wait_until(lambda: worker.pid in holding(redis_alone.client(), PACKAGED_NAME), [api, worker],
                           f"worker {name} to load", timeout=180)
                assert b"OMP_NUM_THREADS=" not in Path(f"/proc/{worker.pid}/environ").read_bytes()
                fingerprints.append(_numerics(redis_alone.client(), worker.pid))
                with ThreadPoolExecutor(len(crowd)) as pool:  # all at once: they share steps
                    together.append(list(pool.map(lambda r: _write(client, r), crowd)))
                if name == "A":  # then each alone, one after the other, on the same worker
                    alone = [_write(client, request) for request in crowd]
            finally:
                stop(worker)
            assert worker.returncode == 0, logs(worker)
    finally:
        stop(api)
    assert fingerprints[0] == fingerprints[1] and fingerprints[0].endswith("+invariant"), fingerprints
    assert all(text for text, _ in alone), alone
    assert [tokens for _, tokens in alone[:16]] == [32 + i % 4 * 4 for i in range(16)]  # every token it asked for
    differ = [i for i, request in enumerate(crowd) if together[0][i] != alone[i]]
    assert not differ, "in the crowd, not as alone: " + "\n".join(
        f"{i} {crowd[i][0]}: {together[0][i][0]!r} != {alone[i][0]!r}" for i in differ)
    assert together[1] == together[0]  # and worker B, started later, wrote the same
    # The wolf: streamed and not, in the crowd and alone.
    assert alone[-2] == alone[-1], alone[-2:]
