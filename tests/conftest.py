"""Shared fixtures: tiny models (their directories, and loaded in process), fakeredis for unit tests,
a private redis-server (one a session, or one a test); and, under CI, a skip is a failure unless
tests/allowed_skips.py allows its reason."""
from __future__ import annotations

import fakeredis
import pytest

from tests import allowed_skips
from tests.processes import RedisServer
from tests.tiny_models import save_tiny


# --- Under CI (CI=true), a skip whose reason tests/allowed_skips.py does not list fails instead: in
# every phase (skipif marks and skips in fixtures are setup's; pytest.skip in the test is call's) and
# at collection (importorskip or a module-level skip), so no claimed feature goes untested unseen.

def _refuse_skip(report) -> None:
    if not (report.skipped and allowed_skips.in_ci()) or hasattr(report, "wasxfail"):
        return  # an xfail is reported as skipped too: it is not a skip
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr).removeprefix("Skipped: ")
    if not allowed_skips.allowed(reason):
        where = f"{longrepr[0]}:{longrepr[1]}: " if isinstance(longrepr, tuple) else ""
        report.outcome = "failed"
        report.longrepr = where + allowed_skips.refusal(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _refuse_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _refuse_skip(report)
    return report


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


@pytest.fixture(scope="session")
def smollm2_dense():
    """The packaged SmolLM2 through transformers' dequantizing loader in float32, its model's weights
    dense, as a local Hugging Face directory would give them: loaded once a run (~17-20 s)."""
    from shared.settings import Settings
    from worker.model_loader import PACKAGED, load
    return load(PACKAGED, dtype="float32", device="cpu", cache_dir=Settings().cache_dir)


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


# --- GGUF files made here by llama.cpp's own converter and quantizer (tests/gguf_files.py): each is
# made once per machine into the cache, then found there.

@pytest.fixture(scope="session")
def family_gguf(smollm2_tokenizer):
    """family_gguf(kind, qtype="F16"): the path of the tiny `kind` model (tests/tiny_models.FAMILIES)
    as a GGUF file of `qtype` (tests/gguf_files.TYPES: F16, BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K)."""
    from tests import gguf_files
    return lambda kind, qtype="F16": str(gguf_files.family_gguf(kind, smollm2_tokenizer, qtype))


@pytest.fixture(scope="session")
def family_gguf_source(smollm2_tokenizer):
    """family_gguf_source(kind): the Hugging Face directory those files were converted from."""
    from tests import gguf_files
    return lambda kind: str(gguf_files.family_directory(kind, smollm2_tokenizer))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """smollm2_gguf(qtype): the packaged SmolLM2-135M requantized to `qtype` (Q4_K_M, Q5_K_M, Q8_0, Q4_0),
    as SmolLM2-135M-Instruct.{qtype}.gguf."""
    from tests import gguf_files
    return lambda qtype: str(gguf_files.smollm2_gguf(qtype))
