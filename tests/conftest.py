"""Shared fixtures: tiny models (their directories, and loaded in process), fakeredis for unit tests,
a private redis-server."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

import fakeredis
import pytest
import redis

from serve import free_port, wait_for_redis
from tests.tiny_models import save_tiny


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {kind: save_tiny(kind, str(root / f"tiny-{kind}")) for kind in ("gpt2", "llama")}


# Module-scoped, as in the modules they came from: no module's engines share a loaded model with
# another module's.
@pytest.fixture(scope="module", params=["gpt2", "llama"])
def loaded(request, tiny_model_dirs):
    """Each tiny model in turn, loaded in float32 on the CPU: a test runs once on each family."""
    from worker.model_loader import load
    return load(tiny_model_dirs[request.param], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs):
    """The tiny Llama alone, loaded in float32 on the CPU."""
    from worker.model_loader import load
    return load(tiny_model_dirs["llama"], dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The packaged SmolLM2's Hugging Face tokenizer, as its worker builds it (cached on disk)."""
    from shared.settings import Settings
    from worker.model_loader import PACKAGED_FILE, _tokenizer, packaged_model_dir
    return _tokenizer(packaged_model_dir(), {"gguf_file": PACKAGED_FILE}, Settings().cache_dir)


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis()


class RedisServer:
    """A private redis-server on a free port, which a test may stop and start again.

    `url` and `extra_args` (appended, so they win) make another kind: one with a password
    (`--requirepass`), or TLS on the URL's port (`--port 0 --tls-port ...`). Its output: `log`.
    """

    def __init__(self, directory: str, url: Optional[str] = None, extra_args: Sequence[str] = ()):
        self.url = url or f"redis://127.0.0.1:{free_port()}/0"
        self.port = urlparse(self.url).port
        self.directory = directory
        self.extra_args = list(extra_args)
        self.log = Path(directory) / "redis-server.log"
        self.process = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (the test command installs it: see .ci/run)")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self.directory, *self.extra_args], stdout=log, stderr=subprocess.STDOUT)
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


@pytest.fixture(scope="session")
def kernel():
    """The engine's C++ kernels (worker/continuous/csrc), built into the cache a worker uses."""
    from shared.settings import Settings
    from worker.continuous import kernels
    module = kernels.build(Settings().cache_dir + "/kernels")
    if module is None:
        pytest.fail("the C++ kernels did not build (g++ and ninja come with the test setup)")
    return module
