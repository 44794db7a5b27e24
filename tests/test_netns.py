"""Real hosts on one machine (tests/netns.py): Redis, the API and two workers, each in a network
namespace of its own, joined by a switch; the clients and the test's own Redis client reach them at
their addresses from the root namespace, over the veths.

Worker A's cable is pulled (its port on the switch set down) while it holds streaming and
non-streaming jobs: it is not killed, and its TCP connections stall rather than fail. Past its
heartbeat's life, worker B puts A's jobs back and writes them; once A's cable is back, A learns from
the leases that it lost them and drops them, publishing nothing; every client got one whole answer,
its text once; and A goes on serving.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import openai
import pytest
import redis

from serve import wait_for_redis
from shared import keys
from tests import netns
from tests.processes import logs, stop, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
REDIS_PORT, API_PORT = 6379, 8000
MAX_TOKENS = 96  # the tiny models' context is 128 tokens: prompt and answer fit


@pytest.fixture
def network(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Network(["redis", "api", "wa", "wb"], tmp_path) as net:
        yield net


def test_a_cut_link_stalls_a_connection_and_a_restored_one_carries_it_on(network):
    """The harness's own promise: a cut is a pulled cable (no error, no RST), not a closed socket."""
    host = network.hosts["wa"].address
    echo = network.start("wa", [sys.executable, "-c", _ECHO, host], "echo")
    wait_until(lambda: socket.create_connection((host, 9000), timeout=1).close() is None, [echo],
               "the echo server", 30)
    with socket.create_connection((host, 9000), timeout=5) as conn:
        conn.sendall(b"before")
        assert conn.recv(100) == b"before"
        network.cut("wa")
        conn.sendall(b"during")  # accepted by this host's kernel, not delivered
        conn.settimeout(1.5)
        with pytest.raises(TimeoutError):
            conn.recv(100)
        network.restore("wa")
        conn.settimeout(10)  # TCP retransmits: the same connection carries it once the cable is back
        assert conn.recv(100) == b"during"


_ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
while True:
    conn, _ = server.accept()
    while data := conn.recv(100):
        conn.sendall(data)
"""


@dataclass(frozen=True)
class Ask:
    prompt: str
    chat: bool
    stream: bool


@dataclass
class Answer:
    text: str
    finish_reasons: list
    response_id: str = ""

    @property
    def job_id(self) -> str:
        """Its one job's id: the API names both after the request (cmpl-ID / chatcmpl-ID, ID-0)."""
        return self.response_id.partition("-")[2] + "-0"


def ask(client: openai.OpenAI, a: Ask) -> Answer:
    """One request, greedy and of a fixed length; a stream's text is its deltas, concatenated."""
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                  stream=a.stream)
    if a.chat:
        made = client.chat.completions.create(messages=[{"role": "user", "content": a.prompt}], **common)
    else:
        made = client.completions.create(prompt=a.prompt, **common)
    if not a.stream:
        choice = made.choices[0]
        return Answer(choice.message.content if a.chat else choice.text, [c.finish_reason for c in made.choices],
                      made.id)
    text, finishes, response_id = "", [], ""
    for chunk in made:
        response_id = chunk.id
        for choice in chunk.choices:
            text += (choice.delta.content or "") if a.chat else choice.text
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return Answer(text, finishes, response_id)


class Listener:
    """Every message published on any job's channel, with when it was heard (monotonic)."""

    def __init__(self, client: redis.Redis):
        self.heard: list[tuple[float, str, dict]] = []
        self._lock = threading.Lock()
        # Kept: a Redis client that is garbage-collected closes its pool's connections, this one's too.
        self._client = client
        self._pubsub = client.pubsub()
        self._pubsub.psubscribe(keys.channel(MODEL, "*"))
        assert self._pubsub.get_message(timeout=5)["type"] == "psubscribe"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while True:
            message = self._pubsub.get_message(timeout=0.1)
            if message is None:
                if self._done.is_set():  # only once nothing more is waiting: a client's answer may
                    return               # reach the test before its message reaches this thread
                continue
            if message["type"] == "pmessage":
                job_id = message["channel"].decode().removeprefix(keys.channel(MODEL, ""))
                with self._lock:
                    self.heard.append((time.monotonic(), job_id, json.loads(message["data"])))

    def messages(self, job_id: str, kind: str = None, after: float = 0.0) -> list[dict]:
        with self._lock:
            return [m for t, j, m in self.heard if j == job_id and t > after and kind in (None, m["type"])]

    def jobs(self) -> set[str]:
        with self._lock:
            return {j for _, j, _ in self.heard}

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._pubsub.close()


def _live_ids(client: redis.Redis) -> list[str]:
    ids = [i.decode() for i in client.hkeys(keys.WORKERS)]
    return [i for i in ids if client.exists(keys.heartbeat(MODEL, i))]


def _stopped(pid: int) -> bool:
    """SIGSTOP has taken effect (kill() returns before it does): /proc's state is T."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def _log(proc) -> str:
    """A process's whole output (tests.processes.logs keeps only the end of it)."""
    return "".join(path.read_text(errors="replace") for path in proc.log_files)


def _dropped(log_text: str) -> set[str]:
    """Job ids a worker said it dropped unpublished (worker/worker.py's warning)."""
    found = set()
    for ids in re.findall(r"dropped \d+ job\(s\) without publishing.*\((.*)\)", log_text):
        found.update(i.strip() for i in ids.split(","))
    return found


def test_a_worker_cut_off_past_its_heartbeat_loses_its_jobs_to_another_and_publishes_nothing_for_them(
        network, tiny_model_dirs, tmp_path):
    net = network
    redis_host, api_host = net.hosts["redis"].address, net.hosts["api"].address
    redis_url = f"redis://{redis_host}:{REDIS_PORT}/0"
    server = shutil.which("redis-server")
    assert server, "redis-server is not installed (test.sh installs it)"
    # Verbose: its log shows each client's connections come and go, by address.
    procs = [net.start("redis", [server, "--bind", redis_host, "--port", str(REDIS_PORT), "--protected-mode", "no",
                                 "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                                 "--loglevel", "verbose"], "redis")]
    wait_for_redis(redis_url)  # from the root namespace, across the switch
    # No conversation routing (--affinity-wait 0): the held requests must all go to worker A while B
    # stands still, and routing would offer B the chat requests whose prompts it cached answering
    # them first, to be taken by A only after its earlier ones (then A never holds all at once).
    procs.append(net.python("api", ["api", "--host", api_host, "--port", str(API_PORT), "--redis-url", redis_url,
                                    "--affinity-wait", "0"], "api"))
    worker = ["worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32", "--wait", "5"]
    a = net.python("wa", worker, "worker-a", REDIS_URL=redis_url)
    b = net.python("wb", worker, "worker-b", REDIS_URL=redis_url)
    procs += [a, b]
    store = redis.Redis(host=redis_host, port=REDIS_PORT, socket_timeout=10)
    # trust_env off: a proxy from the environment must not carry the test's requests off the switch.
    client = openai.OpenAI(base_url=f"http://{api_host}:{API_PORT}/v1", api_key="none", max_retries=0,
                           timeout=120, http_client=openai.DefaultHttpxClient(trust_env=False))

    def serving() -> bool:
        try:
            return len(_live_ids(store)) == 2 and MODEL in {m.id for m in client.models.list()}
        except (openai.APIConnectionError, redis.RedisError):
            return False

    wait_until(serving, procs, "the API and both workers", 150)
    (a_id,) = [i for i in _live_ids(store) if f"-{a.pid}-" in i]  # the worker id holds its pid

    held_asks = [Ask("The dragon", chat=False, stream=True), Ask("Once upon a time", chat=False, stream=True),
                 Ask("Tell a story about a gate.", chat=True, stream=True),
                 Ask("The wizard", chat=False, stream=False), Ask("A knight walked", chat=False, stream=False),
                 Ask("Write about a potion.", chat=True, stream=False)]
    during_asks = [Ask("The castle", chat=False, stream=True), Ask("Gold and skeletons.", chat=True, stream=False)]
    pool = ThreadPoolExecutor(len(held_asks) + len(during_asks))
    # Each request answered by the undisturbed service first: greedy, so the same text every time.
    plain = [replace(x, stream=False) for x in held_asks + during_asks]
    expected = {(x.prompt, x.chat): answer.text
                for x, answer in zip(plain, pool.map(lambda x: ask(client, x), plain))}
    listener = Listener(redis.Redis(host=redis_host, port=REDIS_PORT))
    try:
        # Worker A takes every request: B stands still meanwhile (well within its heartbeat's life).
        b.send_signal(signal.SIGSTOP)
        held_futures = [pool.submit(ask, client, x) for x in held_asks]

        seen = {}  # what A held at the last look: job id -> text heard yet (streams only)

        def a_holds_all_and_streams() -> bool:
            jobs = [json.loads(raw) for raw in store.lrange(keys.processing(MODEL, a_id), 0, -1)]
            seen.clear()
            seen.update({j["id"]: bool(listener.messages(j["id"], "text")) for j in jobs if j["stream"]})
            return len(jobs) == len(held_asks) and all(seen.values())

        give_up = time.monotonic() + 30
        while not a_holds_all_and_streams():  # polled tightly: the jobs last about a second on A
            assert time.monotonic() < give_up, (f"worker A never held every request with text on its "
                                                f"way: {seen}\n{logs(*procs)}")
            time.sleep(0.002)
        # A is frozen for the moment of the cut, so that the cable is pulled while it holds every job
        # whatever this machine's speed; it then runs on, behind the cut link.
        a.send_signal(signal.SIGSTOP)
        wait_until(lambda: _stopped(a.pid), procs, "worker A to stop", 10)
        held = [json.loads(raw) for raw in store.lrange(keys.processing(MODEL, a_id), 0, -1)]
        net.cut("wa")
        a.send_signal(signal.SIGCONT)
        b.send_signal(signal.SIGCONT)
        lost = {j["id"] for j in held}
        assert {j["stream"] for j in held} == {True, False}, f"A finished some before the cut: {held}"
        assert all(listener.messages(j["id"], "text") for j in held if j["stream"]), "not cut mid-stream"

        # New requests meanwhile: B serves them, and A's jobs once its heartbeat has run out.
        during_futures = [pool.submit(ask, client, x) for x in during_asks]
        wait_until(lambda: all(f.done() for f in held_futures + during_futures), procs, "every answer", 120)
        # A behind the cut: a Redis call it had sent gives up (the socket timeout) rather than wait
        # for ever on the dead link (redis-py's message).
        wait_until(lambda: "Timeout reading from" in _log(a), procs, "worker A's Redis calls to time out", 30)
        assert not store.exists(keys.processing(MODEL, a_id))
        assert f"worker {a_id} is gone: {len(lost)} job(s) back in the queue" in _log(b), logs(b)

        restored_at = time.monotonic()
        net.restore("wa")
        wait_until(lambda: lost <= _dropped(_log(a)), procs, "worker A to drop the jobs it lost", 60)
        time.sleep(2)  # anything A would still publish for them would be heard by now

        # A goes on serving: with B gone, only A can answer these.
        procs.remove(b)
        stop(b)
        after_asks = [Ask("The dragon", chat=False, stream=True),
                      Ask("Write about a potion.", chat=True, stream=False)]
        after = list(pool.map(lambda x: ask(client, x), after_asks))
    finally:
        listener.stop()
        pool.shutdown(cancel_futures=True)

    answers = [(x, f.result()) for x, f in zip(held_asks + during_asks, held_futures + during_futures)]
    answers += list(zip(after_asks, after))
    for x, answer in answers:
        # One whole answer each, its text once: a stream's deltas add up to the undisturbed text.
        assert answer.finish_reasons == ["length"], (x, answer)
        assert answer.text == expected[(x.prompt, x.chat)], (x, answer.text, expected[(x.prompt, x.chat)])
        # One final answer published for it, whoever wrote it: none twice.
        finals = listener.messages(answer.job_id, "final")
        assert len(finals) == 1 and not listener.messages(answer.job_id, "error"), (x, answer, finals)
    asked = {answer.job_id for _, answer in answers}
    assert lost <= asked and listener.jobs() <= asked, (lost, asked, listener.jobs())
    # B had finished A's jobs before A's cable came back: any message for them since would be A's.
    for job_id in lost:
        assert listener.messages(job_id, after=restored_at) == [], (job_id, logs(a))
    assert "came back to this worker" not in _log(a)
