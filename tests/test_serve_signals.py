"""serve.py stopped as a terminal stops it: Ctrl-C goes to the whole foreground process group.

Each serve.py here is started in a session and process group of its own (start_new_session), as a
shell starts a foreground job, and signalled with os.killpg: the signal reaches every process still
in that group, as Ctrl-C would. The first SIGINT must drain (new requests 503, running streams end
whole), a second one must stop at once, and serve.py killed outright must take its children along.
"""
from __future__ import annotations

import http.client
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import httpx2
import openai
import psutil
import pytest
import redis

from serve import free_port, port_is_free
from shared import keys
from tests.processes import ROOT, _env, make_client, models_served
from tests.serve_runs import Serve, assert_nothing_left, cmdline, tag, tagged  # noqa: F401 (tag: a fixture)
from worker.faults import as_env

pytestmark = pytest.mark.slow  # each starts the whole service: ~10-30 s on 2 cores

SLOW = as_env(step_delay_s=0.08)  # the tests' fault: 100 tokens take ~8 s, so the signal lands mid-stream
MAX_TOKENS = 100  # the tiny model's context window is 128 tokens


class GroupServe(Serve):
    """serve.py as a terminal's foreground job: the leader of its own process group."""

    def __init__(self, tmp_path, tag, args, **env):  # noqa: F811 (tag: the fixture's value)
        self.out, self.err = tmp_path / "serve.out", tmp_path / "serve.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen([sys.executable, "serve.py", *args], cwd=ROOT, stdout=out,
                                            stderr=err, env=_env(STORYTELLER_TEST_TAG=tag, **env),
                                            start_new_session=True)

    def ctrl_c(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)


def start(tmp_path, tag, tiny_model_dirs, **env):  # noqa: F811
    """serve.py with the tiny model, a slow worker and a redis-server of its own on a private port
    (or the one at env's REDIS_URL)."""
    port, redis_port = free_port(), free_port()
    env.setdefault("REDIS_URL", f"redis://127.0.0.1:{redis_port}/0")
    serve = GroupServe(tmp_path, tag, [], PORT=str(port), MODEL=tiny_model_dirs["llama"],
                       **SLOW, **env)
    serve.wait_until_ready()
    return serve, port, redis_port


def group_members(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, ProcessLookupError):
            pass
    return found


def long_stream(port: int, max_tokens: int = MAX_TOKENS):
    client = make_client(port)
    model = sorted(models_served(port))[0]
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


def refused_once_draining(port: int, outcome: dict) -> None:
    """Once the API lists no model (the worker announced it is draining), a new request: its status,
    or 'connection refused' if the API is already gone."""
    give_up = time.monotonic() + 30
    try:
        while time.monotonic() < give_up:
            if not models_served(port):
                break
            time.sleep(0.1)
        else:
            outcome["status"] = "the worker never announced it was draining"
            return
        make_client(port).completions.create(model="any", prompt="Hello", max_tokens=1)
        outcome["status"] = 200
    except openai.APIStatusError as exc:
        outcome["status"] = exc.status_code
    except (openai.APIConnectionError, OSError) as exc:
        outcome["status"] = f"connection failed: {exc}"
    outcome["at"] = time.monotonic()


def test_ctrl_c_to_the_group_drains_a_running_stream(tmp_path, tag, tiny_model_dirs):  # noqa: F811
    serve, port, redis_port = start(tmp_path, tag, tiny_model_dirs)
    pgid = serve.process.pid
    # Only serve.py is in the terminal's group: its children each have one of their own.
    assert [p.pid for p in group_members(pgid)] == [serve.process.pid]
    texts, finish, usage, outcome = [], None, None, {}
    prober = threading.Thread(target=refused_once_draining, args=(port, outcome), daemon=True)
    for chunk in long_stream(port):
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
        if len(texts) == 15 and not prober.is_alive() and "at" not in outcome:
            serve.ctrl_c()
            prober.start()
    ended = time.monotonic()
    prober.join(30)
    assert finish == "length", serve.output()[-4000:]
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # The new request was refused while the stream was still being written.
    assert outcome.get("status") == 503, (outcome, serve.output()[-4000:])
    assert outcome["at"] < ended
    assert serve.wait() == 0, serve.output()[-4000:]
    assert "serve.py:" not in serve.err.read_text()
    assert "Traceback" not in serve.output(), serve.output()[-4000:]  # from none of the children either
    assert group_members(pgid) == []
    assert_nothing_left(tag, port, redis_port)


def read_stream(port: int, max_tokens: int, into: dict) -> None:
    """A stream asked for and read to its end (or its error): its finish_reason and usage."""
    try:
        for chunk in long_stream(port, max_tokens):
            if chunk.choices:
                into["finish"] = chunk.choices[0].finish_reason or into.get("finish")
            if chunk.usage:
                into["usage"] = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 (the assertion below shows it)
        into["error"] = repr(exc)


def test_ctrl_c_answers_the_queued_requests_too(tmp_path, tag, tiny_model_dirs):  # noqa: F811
    """A queue deeper than the batch when the whole service stops: the last worker takes the queued
    requests too (it is the last of its model), and every stream ends whole."""
    serve, port, redis_port = start(tmp_path, tag, tiny_model_dirs, BATCH="1")
    model = sorted(models_served(port))[0]
    queued = redis.Redis(port=redis_port)
    tokens = 30  # 3 x 30 steps of ~0.08 s: well inside the stop timeout
    results = [{} for _ in range(3)]
    readers = [threading.Thread(target=read_stream, args=(port, tokens, r), daemon=True) for r in results]
    for reader in readers:
        reader.start()
    give_up = time.monotonic() + 30
    while sum(queued.llen(q) for q in keys.queues(model)) < 2:  # one running, two waiting in Redis
        assert time.monotonic() < give_up, "the requests never queued up behind the batch of one"
        time.sleep(0.02)
    outcome = {}
    serve.ctrl_c()
    refused_once_draining(port, outcome)
    for reader in readers:
        reader.join(60)
    assert results == [{"finish": "length", "usage": tokens}] * 3, (results, serve.output()[-4000:])
    assert outcome.get("status") == 503, (outcome, serve.output()[-4000:])
    assert serve.wait() == 0, serve.output()[-4000:]
    assert "serve.py:" not in serve.err.read_text()
    assert "Traceback" not in serve.output(), serve.output()[-4000:]
    assert group_members(serve.process.pid) == []
    assert_nothing_left(tag, port, redis_port)


def test_second_ctrl_c_stops_at_once(tmp_path, tag, tiny_model_dirs):  # noqa: F811
    serve, port, redis_port = start(tmp_path, tag, tiny_model_dirs)
    stream = long_stream(port)
    next(iter(stream))  # the worker holds a request: the first Ctrl-C alone would wait for it
    serve.ctrl_c()
    time.sleep(0.5)
    began = time.monotonic()
    serve.ctrl_c()
    assert serve.wait() == 0, serve.output()[-4000:]
    # What tells it from a drain is the stream cut below (a drain would finish it); the bound only
    # says the stop did not hang (gunicorn's graceful timeout is 30 s), with room for any load.
    assert time.monotonic() - began < 25, "the second Ctrl-C waited for the drain"
    with pytest.raises((openai.APIConnectionError, httpx2.HTTPError)):  # the stream was cut, not finished
        for _ in stream:
            pass
    # Our end closed too: the dead API's end of the cut connection would otherwise hold its port
    # (FIN_WAIT_2) until the kernel's timeout, which is not something left running.
    stream.close()
    assert_nothing_left(tag, port, redis_port)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["killed", "terminal-closed"])
def test_children_die_with_serve_py(tmp_path, tag, tiny_model_dirs, how):  # noqa: F811
    serve, port, redis_port = start(tmp_path, tag, tiny_model_dirs)
    children = [pid for pid in tagged(tag) if pid != serve.process.pid]
    assert len(children) >= 4  # redis-server, the API (and its gunicorn worker), batch, worker
    # SIGKILL: nothing can drain; the children's parent-death signal ends them. SIGHUP, as the
    # kernel sends it to a closed terminal's foreground group (serve.py's alone): a drain.
    serve.process.send_signal(how)
    serve.wait()
    give_up = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert_nothing_left(tag, port, redis_port)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def batch_horse(tag: str) -> psutil.Process | None:  # noqa: F811
    """The process RQ's batch worker forked for the batch it runs (its "work horse"), if any."""
    for pid in tagged(tag):
        try:
            if cmdline(pid)[1:3] == ["-m", "batch"]:
                children = psutil.Process(pid).children()
                return children[0] if children else None
        except (OSError, IndexError, psutil.Error):
            pass
    return None


def test_a_running_batch_dies_with_serve_py(tmp_path, tag, tiny_model_dirs, real_redis, redis_server):  # noqa: F811
    """serve.py killed outright while a batch runs: the batch worker's forked job process, whose
    parent is the batch worker and not serve.py, dies at once too (its own parent-death signal).
    A Redis that serve.py did not start, which outlives it: with serve.py's own, the job process
    would soon fail on its own once Redis was gone; with this one it would go on for hours."""
    serve, port, _ = start(tmp_path, tag, tiny_model_dirs, REDIS_URL=redis_server.url)
    client = make_client(port)
    model = sorted(models_served(port))[0]
    lines = [{"custom_id": f"tale-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True}}
             for i in range(4)]  # ~100 steps of 0.08 s: running for ~8 s
    upload = client.files.create(file=("tales.jsonl", io.BytesIO("".join(json.dumps(line) + "\n" for line in lines)
                                                                 .encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    give_up = time.monotonic() + 30
    while (horse := batch_horse(tag)) is None or client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < give_up, f"the batch never ran:\n{serve.output()[-4000:]}"
        time.sleep(0.1)
    assert client.batches.retrieve(batch.id).request_counts.completed == 0  # still running
    serve.process.kill()
    serve.wait()
    # At once: the batch worker's parent-death signal, then the horse's. Without its own, the horse
    # would go on retrying the dead API, backing off, until the batch's window (24 h) closed.
    give_up = time.monotonic() + 5
    while horse.is_running() and horse.status() != psutil.STATUS_ZOMBIE and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not horse.is_running() or horse.status() == psutil.STATUS_ZOMBIE, "the batch's job process lived on"
    assert_nothing_left(tag, port)


@pytest.mark.parametrize("open_connection", [False, True], ids=["idle", "a-connection-open"])
def test_ctrl_c_stops_the_api_alone_without_a_traceback(tmp_path, tag, redis_server, open_connection):  # noqa: F811
    """`python -m api` in a terminal, Ctrl-C: gunicorn's quick stop, at once and without a traceback
    (gunicorn's gevent worker raised SystemExit in a greenlet, which gevent printed: api/gevent_worker.py).
    With a keep-alive connection open, the worker is still serving when it is told to quit."""
    port = free_port()
    out = tmp_path / "api.out"
    with open(out, "wb") as log:
        api = subprocess.Popen([sys.executable, "-m", "api", "--port", str(port), "--redis-url", redis_server.url],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=_env(STORYTELLER_TEST_TAG=tag))
    give_up = time.monotonic() + 60
    while "Booting worker" not in out.read_text() or port_is_free("127.0.0.1", port):
        assert api.poll() is None and time.monotonic() < give_up, out.read_text()
        time.sleep(0.1)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(100):  # the worker may still be loading the app: its first answer says it serves
        try:
            connection.request("GET", "/health")
            connection.getresponse().read()
            break
        except OSError:
            connection.close()
            time.sleep(0.1)
    if not open_connection:
        connection.close()
    began = time.monotonic()
    os.killpg(api.pid, signal.SIGINT)
    assert api.wait(30) == 0, out.read_text()
    # At once, not after gunicorn's 30 s graceful timeout, which the open keep-alive connection would
    # have it wait out: 20 s tells the two apart on a loaded 2-core machine.
    assert time.monotonic() - began < 20, "Ctrl-C did not stop the API at once"
    connection.close()
    assert "Traceback" not in out.read_text(), out.read_text()
    assert "failed with SystemExit" not in out.read_text(), out.read_text()
    assert_nothing_left(tag, port)
