"""serve.py stopped as a terminal stops it: Ctrl-C goes to the whole foreground process group.

Each serve.py here is started in a session and process group of its own (start_new_session), as a
shell starts a foreground job, and signalled with os.killpg: the signal reaches every process still
in that group, as Ctrl-C would. The first SIGINT must drain (new requests 503, running streams end
whole), a second one must stop at once, and serve.py killed outright must take its children along.
"""
from __future__ import annotations

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

from serve import free_port
from tests.processes import ROOT, _env, make_client, models_served
from tests.test_serve import Serve, assert_nothing_left, tag, tagged  # noqa: F401 (tag: a fixture)

pytestmark = pytest.mark.slow  # each starts the whole service: ~10-30 s on 2 cores

STEP_DELAY_S = "0.08"  # the test hook: 100 tokens take ~8 s, so the signal lands mid-stream
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
    """serve.py with the tiny model, a slow worker and a redis-server of its own on a private port."""
    port, redis_port = free_port(), free_port()
    serve = GroupServe(tmp_path, tag, [], REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", PORT=str(port),
                       MODEL=tiny_model_dirs["llama"], STEP_DELAY_S=STEP_DELAY_S, **env)
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


def long_stream(port: int):
    client = make_client(port)
    model = sorted(models_served(port))[0]
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS,
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
    assert group_members(pgid) == []
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
    assert time.monotonic() - began < 5, "the second Ctrl-C waited for the drain"
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
