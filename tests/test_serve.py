"""serve.py cleans up after itself: whatever stops it, during start-up or after, nothing it started
is left running, registered in Redis or listening, and it says why in one line.

Every serve.py here is tagged, so that whatever it left behind is found (tests/serve_runs.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from serve import ensure_redis, port_is_free
from shared import keys
from tests.processes import ROOT, _env, free_port
from tests.serve_runs import (READY_TIMEOUT_S, Serve, assert_nothing_left, cmdline, tag,  # noqa: F401 (tag: a fixture)
                              tagged)


def assert_nobody_registered(client) -> None:
    """The workers' traces in Redis: the registry, heartbeats and processing lists."""
    assert client.hgetall(keys.WORKERS) == {}
    assert client.keys(keys.heartbeat("*", "*")) == []
    assert client.keys(keys.processing("*", "*")) == []


def test_free_port_never_hands_out_one_port_twice():
    """Ports asked for one after another, none bound yet (as a test's cluster nodes are): each is
    free and none repeats. Drawn at random from 2,768 ports, 300 would repeat ~16 times."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(port_is_free("127.0.0.1", port) for port in ports)


def test_missing_model_stops_before_anything_starts(tmp_path, tag, real_redis, redis_server):
    port = free_port()
    serve = Serve(tmp_path, tag, ["--model", "/nonexistent"], REDIS_URL=redis_server.url, PORT=str(port))
    assert serve.wait() != 0
    assert "'/nonexistent': no such directory" in serve.last_error_line()
    assert_nothing_left(tag, port)
    assert_nobody_registered(real_redis)


def test_api_port_taken_stops_before_anything_starts(tmp_path, tag, real_redis, redis_server, tiny_model_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = Serve(tmp_path, tag, [], REDIS_URL=redis_server.url, PORT=str(port),
                      MODEL=tiny_model_dirs["llama"])
        assert serve.wait() != 0
        assert f"port {port} on 127.0.0.1 is already in use" in serve.last_error_line()
        assert_nothing_left(tag)
    assert_nobody_registered(real_redis)
    assert port_is_free("127.0.0.1", port)


def test_worker_failing_at_start_up_stops_the_api_and_its_redis(tmp_path, tag):
    # A directory that passes the up-front check but that no loader can read: the worker exits
    # after the API and a redis-server of serve.py's own have started, and both must go with it.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    port, redis_port = free_port(), free_port()
    serve = Serve(tmp_path, tag, ["--model", str(broken)], REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
                  PORT=str(port))
    assert serve.wait() == 1
    assert f"started redis-server at redis://127.0.0.1:{redis_port}/0" in serve.output()
    line = serve.last_error_line()
    assert line.startswith("serve.py: the worker (pid ") and "exited with status 1 during start-up" in line, \
        serve.output()[-4000:]
    assert_nothing_left(tag, port, redis_port)


def test_stopped_with_sigterm_leaves_nothing_running_or_registered(tmp_path, tag, real_redis, redis_server,
                                                                   tiny_model_dirs):
    port = free_port()
    # Settings given as serve.py's flags reach the API and the workers.
    serve = Serve(tmp_path, tag, ["--workers", "2", "--model-name", "lore-teller", "--max-attempts", "3"],
                  REDIS_URL=redis_server.url, PORT=str(port), MODEL=tiny_model_dirs["llama"])
    serve.wait_until_ready()
    assert "serving lore-teller with 2 worker(s)" in serve.output()
    give_up = time.monotonic() + READY_TIMEOUT_S
    while len(real_redis.hkeys(keys.WORKERS)) < 2 and time.monotonic() < give_up:  # the second one too
        time.sleep(0.2)
    assert len(real_redis.keys(keys.heartbeat("*", "*"))) == 2
    serve.process.send_signal(signal.SIGTERM)
    assert serve.wait() == 0, serve.output()[-4000:]
    assert "serve.py:" not in serve.err.read_text()  # a requested stop is no failure
    assert_nothing_left(tag, port)
    assert_nobody_registered(real_redis)


def test_worker_killed_after_start_stops_the_rest(tmp_path, tag, real_redis, redis_server, tiny_model_dirs):
    port = free_port()
    serve = Serve(tmp_path, tag, [], REDIS_URL=redis_server.url, PORT=str(port), MODEL=tiny_model_dirs["llama"])
    serve.wait_until_ready()
    workers = [pid for pid in tagged(tag) if cmdline(pid)[1:3] == ["-m", "worker"]]
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    assert serve.wait() == 1
    assert serve.last_error_line() == (f"serve.py: the worker (pid {workers[0]}) was killed by signal 9; "
                                       f"stopped everything it had started")
    assert_nothing_left(tag, port)


# What serve.py says before it starts: a Redis it did not start, a missing compiler

def test_a_redis_it_did_not_start_is_named_with_its_db_and_how_to_pick_another(redis_server):
    url = redis_server.url.removesuffix("/0") + "/3"
    note, started = ensure_redis(url)
    assert started == []  # it answers: nothing started, and it says where it will write
    assert f"into db 3 of the Redis at {url}, which it did not start" in note
    assert "REDIS_URL=redis://127.0.0.1:6379/5 ./serve.sh" in note


def test_without_a_compiler_it_warns_in_one_line_and_goes_on(tmp_path, tag, redis_server):
    no_compiler = tmp_path / "bin"  # a PATH with no c++ nor g++ on it
    no_compiler.mkdir()
    serve = Serve(tmp_path, tag, ["--model", "/nonexistent"], REDIS_URL=redis_server.url, PORT=str(free_port()),
                  PATH=str(no_compiler))
    assert serve.wait() == 2
    errors = serve.err.read_text().splitlines()
    warnings = [line for line in errors if line.startswith("warning: no C++ compiler")]
    assert len(warnings) == 1 and "apt-get install g++" in warnings[0], errors
    # Past the warning, the checks went on: the model's error is what stopped it.
    assert "'/nonexistent': no such directory" in serve.last_error_line()


# --metrics

PROMETHEUS_SCRIPT = """
import json, sys, time, urllib.request
import serve
serve.PROMETHEUS_PORT = serve.free_port()
service = serve.Service()
try:
    print(serve.start_prometheus(service, "http://127.0.0.1:1/v1", [2]), flush=True)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{serve.PROMETHEUS_PORT}/api/v1/rules", timeout=1) as r:
                print(json.dumps(json.load(r)), flush=True)
                break
        except OSError:
            time.sleep(0.1)
finally:
    service.stop()
"""


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus command is not installed (Debian's prometheus package; test.sh installs it)")
def test_metrics_prometheus_loads_the_alerts_logs_to_a_file_and_leaves_no_folder(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROMETHEUS_SCRIPT], cwd=ROOT, env=_env(TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    banner, rules = done.stdout.splitlines()[:2]
    log = tmp_path / "storyteller-prometheus.log"
    assert f"its log: {log}" in banner and "prometheus/alerts.yml" in banner
    assert [group["name"] for group in json.loads(rules)["data"]["groups"]] == ["storyteller"]
    assert "Server is ready" in log.read_text()  # its log went to the file, not the terminal
    assert "Server is ready" not in done.stdout + done.stderr
    assert list(tmp_path.glob("storyteller-prometheus-*")) == []  # its data folder removed at exit
