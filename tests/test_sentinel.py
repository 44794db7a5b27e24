"""Redis Sentinel, against real servers on loopback: a primary with a password, its replica, three
redis-sentinel processes, and a real API and tiny-model worker whose REDIS_URL is the redis+sentinel://
URL. A load of requests from OpenAI's client runs while the primary is SIGKILLed: every request ends,
in bounded time, answered or with a clear error; the sentinels promote the replica; the API and the
worker find it by themselves and new requests are answered. RQ's worker (the batch API's) works
through the same URL.
"""
from __future__ import annotations

import operator
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import openai
import pytest
import redis
from rq import Queue, SimpleWorker

from shared import keys
from shared.redis_client import connect
from tests.processes import (free_port, get_json, logs, make_client, models_served, start, stop,
                             wait_for_servers, wait_until)

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-llama"
SERVICE = "storyteller-primary"
PASSWORD = "s3cret pass"  # a space: percent-encoded in the URL, quoted in sentinel.conf
QUOTED = PASSWORD.replace(" ", "%20")
SENTINELS = 3
QUORUM = 2  # two of three sentinels must see the primary down; a majority elects the one that fails over
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 4000
REQUESTS, AT_ONCE, TOKENS = 32, 8, 40
KILL_AFTER = 6  # answers before the primary is killed: the load is well under way
DURING = 3  # requests sent one after another once the primary is dead
# Every request must have ended this long after the kill: the API rides out Redis outages of up to
# 30 s (api/broker.py), and a fail-over here takes a few seconds; a hang shows as a timeout.
SETTLE_S = 60


class Server:
    """A redis-server or redis-sentinel process of the test's own, its output in `log`."""

    def __init__(self, directory: Path, name: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.port, self.log, self.directory = free_port(), directory / f"{name}.log", directory
        self.process: subprocess.Popen | None = None

    def start(self, command: list[str]) -> "Server":
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def client(self, **options) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, **options)


def data_server(directory: Path, name: str, *extra: str) -> Server:
    binary = shutil.which("redis-server") or pytest.fail("redis-server is not installed (test.sh installs it)")
    server = Server(directory, name)
    # masterauth too: a server Sentinel turns into a replica must authenticate to the new primary.
    return server.start([binary, "--port", str(server.port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no", "--dir", str(directory), "--requirepass", PASSWORD,
                         "--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0", *extra])


def sentinel(directory: Path, name: str, primary_port: int) -> Server:
    server = Server(directory, name)
    config = directory / f"{name}.conf"  # Sentinel rewrites its config file: one of its own, writable
    config.write_text(f"port {server.port}\nbind 127.0.0.1\ndir {directory}\n"
                      f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {QUORUM}\n"
                      f'sentinel auth-pass {SERVICE} "{PASSWORD}"\n'
                      f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                      f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n")
    # Debian's redis-sentinel package (test.sh installs it) is redis-server in sentinel mode.
    command = ([binary, str(config)] if (binary := shutil.which("redis-sentinel"))
               else [shutil.which("redis-server") or pytest.fail("redis-server is not installed"),
                     str(config), "--sentinel"])
    return server.start(command)


def answers(server: Server, **options) -> bool:
    try:
        return bool(server.client(password=PASSWORD, **options).ping())
    except redis.RedisError:
        return False


def wait_for(ready, what: str, servers: list[Server], timeout: float = 30) -> None:
    wait_for_servers(ready, what, [s.log for s in servers], timeout)


def ask(client: openai.OpenAI, i: int) -> dict:
    """One request, streamed or not; how it ended, never an exception (the test judges it)."""
    began, request = time.monotonic(), dict(model=MODEL, prompt=f"Tale {i}:", max_tokens=TOKENS,
                                            extra_body={"ignore_eos": True})
    try:
        if i % 2:
            text, finish = "", None
            for chunk in client.completions.create(stream=True, **request):
                text += chunk.choices[0].text if chunk.choices else ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            ended = dict(outcome="answer", finish=finish, text=text)
        else:
            answer = client.completions.create(**request)
            ended = dict(outcome="answer", finish=answer.choices[0].finish_reason,
                         tokens=answer.usage.completion_tokens, text=answer.choices[0].text)
    except openai.APIStatusError as exc:
        ended = dict(outcome="error", status=exc.status_code, message=exc.message)
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:  # no answer at all: not clear
        ended = dict(outcome="no answer", message=repr(exc))
    except openai.APIError as exc:  # an error event in a stream
        ended = dict(outcome="error", status=None, message=exc.message)
    return dict(ended, i=i, began=began, ended=time.monotonic())


def test_api_and_worker_ride_out_a_sentinel_fail_over(tiny_model_dirs, tmp_path):
    primary = data_server(tmp_path / "primary", "primary")
    servers, procs = [primary], []
    try:
        wait_for(lambda: answers(primary), "the primary", servers)
        replica = data_server(tmp_path / "replica", "replica", "--replicaof", "127.0.0.1", str(primary.port))
        servers.append(replica)
        # The sentinels learn of the replica from the primary's INFO: attached first, it is known at once.
        wait_for(lambda: replica.client(password=PASSWORD).info("replication")["master_link_status"] == "up",
                 "the replica to sync", servers)
        sentinels = [sentinel(tmp_path / f"sentinel-{i}", f"sentinel-{i}", primary.port) for i in range(SENTINELS)]
        servers += sentinels

        def watched() -> bool:  # every sentinel knows the replica and the other sentinels: it can fail over
            states = [s.client().sentinel_master(SERVICE) for s in sentinels]
            return all(st["num-slaves"] == 1 and st["num-other-sentinels"] == SENTINELS - 1 for st in states)

        wait_for(watched, "the sentinels to know the replica and each other", servers)

        # First in the list, a sentinel that is down: clients ask the next one.
        hosts = ",".join(f"127.0.0.1:{p}" for p in [free_port(), *(s.port for s in sentinels)])
        url = f"redis+sentinel://:{QUOTED}@{hosts}/{SERVICE}/0"
        port = free_port()
        # A heartbeat that outlives the pause below and the fail-over (3 s by default, about what a
        # fail-over takes here), as advised for Sentinel (README): the worker stays listed throughout.
        worker = start(["worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32", "--batch", "8",
                        "--wait", "5"], tmp_path, "worker", REDIS_URL=url, HEARTBEAT_TTL_S="10")
        api = start(["api", "--port", str(port), "--max-queue", "0", "--request-timeout", "45"], tmp_path, "api",
                    REDIS_URL=url)
        procs += [worker, api]
        wait_until(lambda: MODEL in models_served(port), procs, f"/v1/models to list {MODEL}")
        # The API prints the URL it uses, and never the password.
        assert "s3cret" not in logs(api) + logs(worker)

        client = make_client(port)  # no retries: each request's own ending is what is judged
        data = primary.client(password=PASSWORD)
        (worker_id,) = [i.decode() for i in data.hkeys(keys.WORKERS)]
        pool, extra = ThreadPoolExecutor(AT_ONCE), ThreadPoolExecutor(1)
        try:
            futures = [pool.submit(ask, client, i) for i in range(REQUESTS - AT_ONCE)]
            wait_until(lambda: sum(f.done() for f in futures) >= KILL_AFTER, procs, "the load to get going")
            # The tiny model answers in a fraction of a second: a kill at a random moment mostly finds
            # requests being queued (they get a fast 503), not waiting. So the worker is paused first,
            # until every open request's job is in Redis (queued, or held mid-way by the worker), and
            # the replica has them all (WAIT: replication is asynchronous, and a write the replica
            # never got is lost in a fail-over, which is no part of what is tested here). The last
            # AT_ONCE requests are sent only once it is paused: on a fast CPU the first ones can all
            # be answered between two polls above, and some must be open when the primary dies.
            worker.send_signal(signal.SIGSTOP)
            futures += [pool.submit(ask, client, i) for i in range(REQUESTS - AT_ONCE, REQUESTS)]

            def jobs_in_redis() -> int:
                return sum(data.llen(q) for q in keys.queues(MODEL)) + data.llen(keys.processing(MODEL, worker_id))

            give_up, seen = time.monotonic() + 10, None
            while seen is None or not (seen[0] == seen[1] >= 1):
                assert time.monotonic() < give_up, f"open requests, jobs in Redis: {seen}\n{logs(*procs)}"
                seen = (sum(f.running() for f in futures), jobs_in_redis())
                time.sleep(0.05)
            assert data.execute_command("WAIT", 1, 5000) == 1, "the replica did not acknowledge the jobs"
            waiting = {i for i, f in enumerate(futures) if f.running()}
            primary.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            worker.send_signal(signal.SIGCONT)  # it finds Redis gone, and rides that out
            # New requests while no primary is known: each gets its 503 at once (or, once the
            # replica is promoted, its answer).
            meanwhile = [extra.submit(ask, client, REQUESTS + i) for i in range(DURING)]
            done, hanging = wait(futures + meanwhile, timeout=SETTLE_S)
        finally:  # not waiting for a request that hangs: that is what the test reports
            worker.send_signal(signal.SIGCONT)
            pool.shutdown(wait=False, cancel_futures=True)
            extra.shutdown(wait=False, cancel_futures=True)
        ended = sorted((f.result() for f in done), key=lambda r: r["i"])
        assert not hanging, f"{len(hanging)} request(s) still open {SETTLE_S} s after the kill\n{logs(*procs)}"
        primary.process.wait(5)
        for r in ended:  # shown when the test fails: each request's course against the kill
            print(f"request {r['i']:2d}: {r['began'] - killed_at:+6.2f} s .. {r['ended'] - killed_at:+6.2f} s "
                  f"{r['outcome']} {r.get('status') or ''} {r.get('message', '')[:200]}")

        # Every request ended answered in full, or with an error that says what happened: Redis not
        # reachable (sent while no primary was known), or no worker (sent before the worker's next
        # heartbeat reached the new primary: its last one may have expired during the fail-over).
        unclear = [r for r in ended if r["outcome"] == "no answer"
                   or (r["outcome"] == "error" and not (r["status"] in (None, 503, 504) and r["message"]))]
        assert not unclear, f"requests without a clear ending: {unclear}\n{logs(*procs)}"
        for r in ended:
            if r["outcome"] == "answer":
                assert r["finish"] == "length" and r.get("tokens", TOKENS) == TOKENS, r
        errors = [r for r in ended if r["outcome"] == "error"]
        assert all(any(words in r["message"] for words in ("Redis", "no worker", "timed out")) for r in errors), errors
        # The requests waiting at the kill were all answered: the API and the worker rode it out.
        # Those sent during the fail-over were answered or refused soon (the API waits up to 5 s for
        # a subscription to be confirmed, after up to 10 s for a connection of its pool).
        assert all(r["ended"] - r["began"] < 20 for r in ended if r["i"] >= REQUESTS), ended[REQUESTS:]
        assert all(ended[i]["outcome"] == "answer" for i in waiting), ([ended[i] for i in waiting], logs(*procs))

        # The replica is the primary now, as every sentinel says (the requests may all have ended before).
        wait_for(lambda: replica.client(password=PASSWORD).execute_command("ROLE")[0] == b"master" and all(
            int(s.client().sentinel_get_master_addr_by_name(SERVICE)[1]) == replica.port for s in sentinels),
            "the replica to be promoted", servers)

        # New requests are answered, through the promoted replica, once the worker's heartbeat is there.
        wait_until(lambda: MODEL in models_served(port), procs, f"{MODEL} listed after the fail-over", timeout=15)
        later = [ask(client, REQUESTS + DURING + i) for i in range(4)]
        assert all(r["outcome"] == "answer" and r["finish"] == "length" for r in later), (later, logs(*procs))
        assert get_json(f"http://127.0.0.1:{port}/health")[0] == 200
        assert worker.poll() is None and api.poll() is None, logs(*procs)
        assert "Redis unreachable" in (tmp_path / "worker.err").read_text()  # it met the fail-over, and went on

        # RQ (the batch worker, batch/__main__.py) through the same URL: a job queued and run.
        connection = connect(url)
        job = Queue("sentinel-test", connection=connection).enqueue(operator.add, 2, 3)
        SimpleWorker([Queue("sentinel-test", connection=connection)], connection=connection).work(burst=True)
        job.refresh()
        assert job.return_value() == 5
        print(f"{len(ended)} requests: {sum(r['outcome'] == 'answer' for r in ended)} answered, "
              f"{len(errors)} errors, {len(waiting)} waiting at the kill; all ended "
              f"{max(r['ended'] for r in ended) - killed_at:.1f} s after it")
    finally:
        for proc in procs:
            stop(proc)
        for server in servers:
            server.stop()
