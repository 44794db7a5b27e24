"""Shared fixtures: tiny models (their directories, and loaded in process), fakeredis for unit tests,
a private redis-server (one a session, or one a test)."""
from __future__ import annotations

import fakeredis
import pytest

from tests.processes import RedisServer
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


@pytest.fixture(params=["fakeredis", "redis-server"])
def any_redis(request):
    """fakeredis, then a real redis-server: a test of what crosses Redis runs on both, so that
    fakeredis' shortcuts (its blocking pops answer at once, its scripts' edge cases) hide nothing."""
    return request.getfixturevalue("fake_redis" if request.param == "fakeredis" else "real_redis")


@pytest.fixture
def redis_alone(tmp_path):
    """A redis-server of the test's own, for one that stops it or must not share its keys."""
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def kernel():
    """The engine's C++ kernels (worker/continuous/csrc), built into the cache a worker uses."""
    from shared.settings import Settings
    from worker.continuous import kernels
    module = kernels.build(Settings().cache_dir + "/kernels")
    if module is None:
        pytest.fail("the C++ kernels did not build (g++ and ninja come with the test setup)")
    return module
