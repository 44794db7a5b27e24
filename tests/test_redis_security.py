"""Redis with a password and over TLS: the URL forms, the password never printed, serve.py's
ensure_redis, and a real API and worker on a redis-server with --requirepass and one with TLS."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis

import api.__main__
from serve import ensure_redis
from shared.redis_client import connect, explain, masked, unavailable_because
from shared.settings import Settings
from tests.processes import RedisServer, free_port, get_json, logs, make_client, start, stop, wait_until

PASSWORD = "s3cret-Pa55 word"  # a space too: it must survive the URL (%20) and redis.conf quoting
QUOTED = PASSWORD.replace(" ", "%20")
MODEL = "tiny-llama"


# The URL as it may be shown

@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    (f"redis://:{QUOTED}@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    (f"redis://game:{QUOTED}@h:1/2", "redis://game:***@h:1/2"),
    ("rediss://:p%40ss@h:6380/0?ssl_ca_certs=/etc/ca.pem", "rediss://:***@h:6380/0?ssl_ca_certs=/etc/ca.pem"),
    ("rediss://h/0?ssl_password=x&ssl_certfile=c.pem&password=y",
     "rediss://h/0?ssl_password=***&ssl_certfile=c.pem&password=***"),
    ("redis://user@h/0", "redis://user@h/0"),
])
def test_masked_hides_every_password(url, shown):
    assert masked(url) == shown


def test_help_and_repr_mask_the_redis_password(monkeypatch, capsys):
    url = f"redis://:{QUOTED}@127.0.0.1:6379/0"
    monkeypatch.setenv("REDIS_URL", url)
    with pytest.raises(SystemExit):
        Settings.parse(["--help"], api.__main__.FLAGS, "test")
    shown = capsys.readouterr().out.replace("\n", " ")
    assert "s3cret" not in shown and "***@127.0.0" in shown
    assert "s3cret" not in repr(Settings.from_env())


def test_a_refused_password_is_explained_without_it():
    text = explain(redis.AuthenticationError("invalid username-password pair"))
    assert "REDIS_URL" in text and "redis://:PASSWORD@" in text
    assert explain(redis.ConnectionError("Connection refused")) == "Connection refused"


def test_a_pool_that_stayed_busy_is_told_apart_from_redis_down(real_redis):
    """Past its bound an API process's request waits for a free connection (redis-py's
    BlockingConnectionPool); when that wait runs out Redis is up and the process saturated, and the
    503 says so. Redis down is still "not reachable"."""
    pool = redis.BlockingConnectionPool(max_connections=1, timeout=0.2, **real_redis.connection_pool.connection_kwargs)
    held = pool.get_connection()
    try:
        with pytest.raises(redis.ConnectionError) as busy:
            redis.Redis(connection_pool=pool).ping()
    finally:
        pool.release(held)
        pool.disconnect()
    assert unavailable_because(busy.value).startswith("the job queue (Redis) is busy: every Redis connection")
    down = redis.Redis(port=free_port(), socket_connect_timeout=1)
    with pytest.raises(redis.ConnectionError) as refused:
        down.ping()
    assert unavailable_because(refused.value).startswith("the job queue (Redis) is not reachable: ")


# serve.py's ensure_redis

@pytest.mark.timeout(60)
def test_ensure_redis_starts_redis_server_with_the_urls_password():
    url = f"redis://:{QUOTED}@127.0.0.1:{free_port()}/0"
    note, started = ensure_redis(url)
    try:
        assert len(started) == 1 and "s3cret" not in note and ":***@" in note
        # Given on stdin: not in the command line that `ps` shows.
        command_line = Path(f"/proc/{started[0].pid}/cmdline").read_bytes()
        assert b"s3cret" not in command_line
        assert connect(url).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(url.replace(f":{QUOTED}@", "@")).ping()
    finally:
        for process in started:
            process.terminate()
            process.wait(10)


@pytest.mark.timeout(60)
def test_ensure_redis_starts_no_tls_server_and_says_so():
    url = f"rediss://:{QUOTED}@127.0.0.1:{free_port()}/0"
    with pytest.raises(SystemExit) as caught:
        ensure_redis(url)
    assert "TLS" in str(caught.value) and "s3cret" not in str(caught.value)


@pytest.fixture
def password_server(tmp_path):
    port = free_port()
    server = RedisServer(str(tmp_path), url=f"redis://:{QUOTED}@127.0.0.1:{port}/0",
                         extra_args=["--requirepass", PASSWORD])
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
def test_ensure_redis_refused_by_a_running_redis_says_why(password_server):
    wrong = f"redis://:wrong-guess@127.0.0.1:{password_server.port}/0"
    with pytest.raises(SystemExit) as caught:
        ensure_redis(wrong)
    message = str(caught.value)
    assert "wrong-guess" not in message and "REDIS_URL" in message and ":***@" in message


# Real processes

def _completion_works(port: int) -> None:
    with make_client(port) as client:
        done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.prompt_tokens > 0


def _serve(url: str, model_dir: str, log_dir: Path) -> tuple[int, list[subprocess.Popen]]:
    port = free_port()
    worker = start(["worker", "--model", model_dir, "--dtype", "float32"], log_dir, "worker", REDIS_URL=url)
    api_proc = start(["api", "--port", str(port), "--threads", "8"], log_dir, "api", REDIS_URL=url)
    procs = [worker, api_proc]
    wait_until(lambda: MODEL in get_json(f"http://127.0.0.1:{port}/health")[1].get("models", []),
               procs, "the API to see the worker", timeout=120)
    return port, procs


@pytest.mark.timeout(240)
def test_api_and_worker_on_a_redis_with_a_password(password_server, tiny_model_dirs, tmp_path):
    plain = f"redis://127.0.0.1:{password_server.port}/0"
    wrong = f"redis://:wrong-guess@127.0.0.1:{password_server.port}/0"
    # Without the password, or with a wrong one, a worker stops at once and says why.
    refused = [start(["worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32"], tmp_path, name,
                     REDIS_URL=url) for name, url in [("no-password", plain), ("wrong-password", wrong)]]
    for worker in refused:
        try:
            assert worker.wait(90) != 0
        finally:
            stop(worker)
        said = worker.log_files[1].read_text()
        assert "cannot use Redis" in said and "check the password" in said, said
        assert "wrong-guess" not in said

    port, procs = _serve(password_server.url, tiny_model_dirs["llama"], tmp_path)
    blind_port = free_port()
    blind = start(["api", "--port", str(blind_port), "--threads", "4"], tmp_path, "api-no-password",
                  REDIS_URL=plain)
    procs.append(blind)
    try:
        _completion_works(port)
        # An API without the password answers 503, naming the cause.
        wait_until(lambda: get_json(f"http://127.0.0.1:{blind_port}/health")[0] == 503, procs,
                   "the API without a password to answer")
        status, body = get_json(f"http://127.0.0.1:{blind_port}/health")
        assert status == 503 and "check the password" in body["error"]["message"]
        everything = logs(*procs)
        assert "s3cret" not in everything and QUOTED not in everything
        assert "(Redis redis://:***@127.0.0.1" in logs(procs[1])  # the API's start-up line, masked
    finally:
        for proc in reversed(procs):
            stop(proc)


def _make_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA, and a certificate it signed for 127.0.0.1."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=Storyteller test CA")
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "1", "-extfile", "san.cnf")
    return {name: directory / name for name in ("ca.crt", "server.crt", "server.key")}


@pytest.fixture
def tls_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (test.sh installs it): no certificates for a TLS Redis")
    certs = _make_certs(tmp_path)
    port = free_port()
    server = RedisServer(
        str(tmp_path), url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca.crt']}",
        extra_args=["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.crt"]),
                    "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
                    "--tls-auth-clients", "no"])
    try:
        server.start()
    except SystemExit:
        said = server.log.read_text(errors="replace")
        server.stop()
        if "tls" in said.lower() and ("bad directive" in said.lower() or "not supported" in said.lower()):
            pytest.skip(f"this redis-server was built without TLS (Debian's has it): {said.strip()[-200:]}")
        pytest.fail(f"the TLS redis-server did not come up:\n{said[-2000:]}")
    yield server
    server.stop()


@pytest.mark.timeout(240)
def test_api_and_worker_over_tls(tls_server, tiny_model_dirs, tmp_path):
    # The server's certificate is checked: without the CA, the connection is refused.
    unverified = tls_server.url.split("?")[0]
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        connect(unverified, socket_connect_timeout=2).ping()
    port, procs = _serve(tls_server.url, tiny_model_dirs["llama"], tmp_path)
    try:
        _completion_works(port)
    finally:
        for proc in reversed(procs):
            stop(proc)
