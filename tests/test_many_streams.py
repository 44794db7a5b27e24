"""A crowd on one API host: 2,000 players hold slow streams open at once against one `python -m api`
process (gunicorn's gevent worker, as in production), a private redis-server and a stand-in
worker that takes every job first and only then writes, a few words a second, to all of them.

None may be refused or cut short, each must read its whole text, and the API process must keep to
its bound on Redis connections (--redis-connections, default 32, its one pub/sub subscriber
included) with 2,000 players waiting on it.

Also, on its own: the process's one subscriber listens again when its connection is cut, or goes
quiet.
"""
from __future__ import annotations

import asyncio
import collections
import resource
import threading
import time

import httpx2
import openai
import psutil
import pytest
import redis

from api import broker
from api.broker import RESUBSCRIBED, Subscriber
from shared import keys
from shared.protocol import Final, TextDelta, encode_result
from shared.settings import Settings
from tests.fake_workers import MODEL, register_worker
from tests.processes import RedisServer, get_json, logs, start_api, stop, wait_until

pytestmark = pytest.mark.timeout(300)

PLAYERS = 2000
WORDS = 4          # each stream's text: WORDS pieces, then its final chunk
WORD_EVERY_S = 1.0
CONNECTIONS_BOUND = Settings().redis_connections  # per API process: the default setting


class SlowWorker:
    """Takes jobs with the worker's own JobQueue until it holds all PLAYERS of them (so every
    player is waiting at once), then writes a word to every job each WORD_EVERY_S, then the final
    answers, stored and published as a worker does. A player whose request failed before its stream
    began (`gave_up`, a list the crowd appends to) sent no job: the worker does not wait for it, so
    one failure is reported as itself, not as every other player's time-out."""

    def __init__(self, server: RedisServer, on_all_held, gave_up: list):
        self.redis = server.client()
        self.queue = register_worker(self.redis)
        self.on_all_held = on_all_held
        self.gave_up = gave_up
        self.error = None
        self.held = 0  # jobs taken so far: it writes nothing until it holds all PLAYERS
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            jobs = []
            while len(jobs) + len(self.gave_up) < PLAYERS and not self.stopping.is_set():
                jobs += self.queue.take(PLAYERS - len(jobs), wait_s=0, block_s=0.2)
                self.held = len(jobs)
                self._beat()
            if self.stopping.is_set():
                return
            self.on_all_held()
            for word in range(WORDS):
                pipe = self.redis.pipeline(transaction=False)
                for job in jobs:
                    delta = TextDelta(text=_word(job.id, word), offset=len(_text(job.id, word)),
                                      completion_tokens=word + 1)
                    pipe.publish(keys.channel(job.model, job.id), encode_result(delta))
                pipe.execute()
                self._beat()
                if self.stopping.wait(WORD_EVERY_S):
                    return
            pipe = self.redis.pipeline(transaction=False)
            for job in jobs:
                final = encode_result(Final(text=_text(job.id, WORDS), finish_reason="length",
                                            prompt_tokens=len(job.prompt_ids), completion_tokens=WORDS))
                pipe.set(keys.answer(job.model, job.id), final, ex=300)
                pipe.publish(keys.channel(job.model, job.id), final)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _beat(self) -> None:
        self.queue.redis.expire(keys.heartbeat(self.queue.model, self.queue.worker_id), 60)


def _word(job_id: str, n: int) -> str:
    return f" {job_id[-6:]}:{n}"


def _text(job_id: str, words: int) -> str:
    return "".join(_word(job_id, n) for n in range(words))


def _api_connections(client) -> dict[str, list[dict]]:
    """CLIENT LIST's entries of each API process, by the name each process gives its connections."""
    by_name = collections.defaultdict(list)
    for entry in client.client_list():
        if entry.get("name", "").startswith("storyteller-api-"):
            by_name[entry["name"]].append(entry)
    return dict(by_name)


async def _crowd(port: int, gave_up: list) -> list:
    # One client, a connection per player: the official client's own pool allows 1,000.
    limits = httpx2.Limits(max_connections=PLAYERS + 50, max_keepalive_connections=PLAYERS + 50)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                timeout=httpx2.Timeout(120, connect=60, pool=60),
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))

    began = time.monotonic()

    async def player(i: int):
        try:
            stream = await client.completions.create(model=MODEL, prompt=f"Player {i} asks for a story",
                                                     max_tokens=WORDS, stream=True)
        except BaseException as exc:
            gave_up.append((time.monotonic() - began, exc))
            raise
        text, finish, chunk_id = "", None, None
        async for chunk in stream:
            chunk_id = chunk.id
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return chunk_id, text, finish

    async with client:
        return await asyncio.gather(*(player(i) for i in range(PLAYERS)), return_exceptions=True)


@pytest.mark.slow
def test_one_api_process_holds_2000_slow_streams_with_bounded_redis_connections(tmp_path):
    # A socket per player on this side too: lift the soft limit on open files (often 1024).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < PLAYERS + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (PLAYERS + 1024 if hard == resource.RLIM_INFINITY
                                                    else min(PLAYERS + 1024, hard), hard))
    server = RedisServer(str(tmp_path))
    server.start()
    # As in production (the default worker class, gevent); no cap on the queue: the stand-in
    # worker announces a batch of 4, whose automatic cap would refuse most of the crowd.
    port, api = start_api(server, tmp_path, "api", "--max-queue", "0")
    seen, gave_up = {}, []

    def all_held():  # every player is waiting now: what the API process holds
        gunicorn_procs = psutil.Process(api.pid).children()
        seen["held_at"] = time.monotonic()
        seen["connections"] = _api_connections(server.client())
        seen["rss"] = {p.pid: p.memory_info().rss for p in gunicorn_procs}
        seen["cpu_held"] = sum(sum(p.cpu_times()[:2]) for p in gunicorn_procs)
        seen["sockets"] = sum(1 for p in gunicorn_procs for c in p.net_connections("tcp")
                              if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)

    worker = None
    try:
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] == 200, [api], "/health")
        worker = SlowWorker(server, all_held, gave_up)
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/v1/models")[1]["data"], [api], "the model")
        # A request refused after tokenizing (its prompt is too long), so the API has loaded the
        # tokenizer: the baseline memory includes it.
        refused = httpx2.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "dragon " * 100})
        assert refused.status_code == 400, refused.text
        gunicorn_procs = psutil.Process(api.pid).children()
        rss_idle = {p.pid: p.memory_info().rss for p in gunicorn_procs}
        cpu_idle = sum(sum(p.cpu_times()[:2]) for p in gunicorn_procs)
        began = time.monotonic()
        results = asyncio.run(_crowd(port, gave_up))
        took = time.monotonic() - began
        cpu_end = sum(sum(p.cpu_times()[:2]) for p in gunicorn_procs)
        connections_after = _api_connections(server.client())
    finally:
        if worker:
            worker.stopping.set()
        stop(api)
        server.stop()
    failed = collections.Counter(f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException))
    early = ", ".join(f"{type(exc).__name__} after {at:.1f} s" for at, exc in gave_up[:5])
    assert not failed, (f"{sum(failed.values())} of {PLAYERS} failed: {dict(failed)}; before their stream "
                        f"began: {len(gave_up)} ({early}); the stand-in worker took {worker.held} jobs; "
                        f"{took:.0f} s\n{logs(api)}")
    assert worker.error is None, worker.error
    assert "held_at" in seen, "the stand-in worker never held every job at once"
    for chunk_id, text, finish in results:
        job_id = chunk_id.removeprefix("cmpl-") + "-0"
        assert (text, finish) == (_text(job_id, WORDS), "length")
    # Every player's stream was open at once, each on a socket of the one API process...
    (gunicorn_pid,) = seen["rss"]
    assert seen["sockets"] >= PLAYERS
    # ...and that process kept to its bound on Redis connections, one of them its subscriber.
    (held,) = seen["connections"].values()
    assert 1 <= len(held) <= CONNECTIONS_BOUND, held
    assert sum(1 for c in held if int(c.get("sub", 0)) > 0) == 1
    (subscriber,) = [c for c in held if int(c.get("sub", 0)) > 0]
    assert int(subscriber["sub"]) >= PLAYERS  # the players' channels, and its own
    assert all(len(c) <= CONNECTIONS_BOUND for c in connections_after.values())
    per_player = (seen["rss"][gunicorn_pid] - rss_idle.get(gunicorn_pid, 0)) / PLAYERS
    print(f"\n{PLAYERS} streams held at once by one API process: all answered in {took:.1f} s "
          f"(all waiting {seen['held_at'] - began:.1f} s after the first request); Redis "
          f"connections of that process: {len(held)} (bound {CONNECTIONS_BOUND}), one pub/sub with "
          f"{subscriber['sub']} channels; memory {seen['rss'][gunicorn_pid] / 2**20:.0f} MiB "
          f"({per_player / 1024:.0f} KiB per waiting player); API CPU {seen['cpu_held'] - cpu_idle:.1f} s "
          f"to take the crowd in, {cpu_end - seen['cpu_held']:.1f} s to stream to it")


def test_the_subscriber_listens_again_when_its_connection_is_cut(redis_server, real_redis):
    subscriber = Subscriber(redis.Redis.from_url(redis_server.url, client_name="subscriber-under-test"))
    channels = [keys.channel("m", "cut-0").encode(), keys.channel("m", "cut-1").encode()]
    inbox = subscriber.listen(channels)  # returns once Redis confirmed both
    assert real_redis.publish(channels[1], b"before") == 1
    assert inbox.messages.get(timeout=5) == (channels[1], b"before")

    (cut,) = [c for c in real_redis.client_list()
              if c.get("name") == "subscriber-under-test" and int(c.get("sub", 0)) > 0]
    real_redis.client_kill_filter(_id=cut["id"])
    # Subscribed again, both channels confirmed: the request is told to read the stored answers.
    assert inbox.messages.get(timeout=10) is RESUBSCRIBED
    assert real_redis.publish(channels[0], b"after") == 1
    assert inbox.messages.get(timeout=5) == (channels[0], b"after")

    other = subscriber.listen([keys.channel("m", "cut-2").encode()])  # the same one connection carries it
    assert [int(c["sub"]) for c in real_redis.client_list() if c.get("name") == "subscriber-under-test"
            and int(c.get("sub", 0)) > 0] == [4]  # its own channel, and three
    subscriber.forget(inbox)
    subscriber.forget(other)
    wait_until(lambda: real_redis.pubsub_numsub(*channels) == [(channels[0], 0), (channels[1], 0)], [],
               "the channels to be unsubscribed", timeout=5)
    assert subscriber.channels == 0


def _subscriber_ids(client, name: str) -> list[int]:
    return [c["id"] for c in client.client_list() if c.get("name") == name and int(c.get("sub", 0)) > 0]


def test_the_subscriber_connects_again_when_its_link_goes_quiet(redis_server, real_redis, monkeypatch):
    # A partition leaves a connection that neither answers nor fails; here Redis reads nothing from
    # its clients for a while (CLIENT PAUSE), which looks the same from the subscriber's side.
    monkeypatch.setattr(broker, "PING_AFTER_S", 0.5)
    monkeypatch.setattr(broker, "PONG_WAIT_S", 1.0)
    subscriber = Subscriber(redis.Redis.from_url(redis_server.url, client_name="quiet-subscriber"))
    channel = keys.channel("m", "quiet-0").encode()
    inbox = subscriber.listen([channel])
    (before,) = _subscriber_ids(real_redis, "quiet-subscriber")
    real_redis.client_pause(6000)
    assert inbox.messages.get(timeout=20) is RESUBSCRIBED  # a new connection, once Redis reads again
    (after,) = _subscriber_ids(real_redis, "quiet-subscriber")
    assert after != before
    assert real_redis.publish(channel, b"still here") == 1
    assert inbox.messages.get(timeout=5) == (channel, b"still here")
    subscriber.forget(inbox)
