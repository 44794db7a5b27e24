"""Shared fixtures: tiny model directories, fakeredis for unit tests, a private redis-server."""
from __future__ import annotations

import shutil
import subprocess

import fakeredis
import pytest
import redis

from serve import free_port, wait_for_redis
from tests.tiny_models import save_tiny


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {kind: save_tiny(kind, str(root / f"tiny-{kind}")) for kind in ("gpt2", "llama")}


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis()


class RedisServer:
    """A private redis-server on a free port, which a test may stop and start again."""

    def __init__(self, directory: str):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.process = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (the test command installs it: see .ci/run)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(self.url)

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def real_redis(redis_server):
    client = redis_server.client()
    client.flushdb()
    yield client
    client.flushdb()
