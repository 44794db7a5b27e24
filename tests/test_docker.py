"""The images built and run by a real Docker engine: Debian's docker.io, its daemon started here
(overlay2, or vfs where overlay2 will not start; no iptables, no default bridge; a data root and
socket of its own, removed afterwards).

No image registry is reachable from the test machines, so the base image is made of Debian's packages
with mmdebstrap (python3 and its venv module; the host's CA certificates, so that pip in the build
reaches PyPI through whatever proxy the host trusts) and Redis and Prometheus come from one image of
Debian's packages too (tests/docker/). Both Dockerfiles are built as they are, from a copy of the
checkout's files (what `git ls-files` lists: no .venv, no local state), with the torch wheel this
machine has (wheels/, as an air-gapped user would build). Then docker-compose.yml runs with two
workers (tests/docker/compose.test.yml only swaps the Redis and Prometheus images): their
HEALTHCHECKs pass, a streamed request is answered through the published port, and Prometheus scrapes
both workers.

Skipped, with the reason, where dockerd, mmdebstrap or docker-compose is missing (test.sh installs
them) or the daemon cannot start; in CI (CI=true) that skip is a failure (tests/allowed_skips.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from serve import free_port
from shared.lifetime import dies_with_parent
from tests.processes import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = ROOT / "tests" / "docker"
BASE = "storyteller-test-base:bookworm"
SERVICES = "storyteller-test-services"
# docker-compose.yml's image names: compose runs what was built here (up --no-build).
API_IMAGE, WORKER_IMAGE = "storyteller-api", "storyteller-worker"
DOCKER = "/usr/bin/docker"  # Debian's client, of the daemon's version (a newer one may be on PATH)
HEALTHY_TIMEOUT_S = 600  # two workers compiling their kernels on two cores, after loading the model
BUILT: dict[str, dict] = {}  # image -> {"seconds", "bytes"}: printed at the end of the module


def wait_until(ready, timeout: float, what) -> None:
    """Poll ready() every second; on time out fail with what() (the state, as it was last seen)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            if ready():
                return
        except (OSError, ValueError, KeyError):  # not answering yet
            pass
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:g} s: {what() if callable(what) else what}")


def missing_tools() -> str:
    wanted = {"dockerd": "docker.io", "mmdebstrap": "mmdebstrap", "docker-compose": "docker-compose"}
    missing = [f"{tool} (Debian's {package})" for tool, package in wanted.items() if not shutil.which(tool)]
    if not os.path.exists(DOCKER):
        missing.append(f"{DOCKER} (Debian's docker.io)")
    return ", ".join(missing)


class Engine:
    """dockerd on a socket and data root of its own. The environment `env()` gives reaches it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.socket = folder / "docker.sock"
        self.log = folder / "dockerd.log"
        self.process = None
        self.driver = None  # the storage driver the daemon started with

    def env(self, **extra) -> dict:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1", **extra}

    def start(self) -> None:
        """overlay2 where the kernel has it (layers shared, not copied); vfs, which copies every layer
        whole at every step (minutes more on the worker's torch layers), where overlay2 will not start
        (a data root on overlayfs, say)."""
        for driver in ("overlay2", "vfs"):
            if self._start(driver):
                self.driver = driver
                return
        pytest.skip(f"dockerd did not start (overlay2 nor vfs): {self.log.read_text()[-1500:]}")

    def _start(self, driver: str) -> bool:
        self.process = subprocess.Popen(
            ["dockerd", f"--storage-driver={driver}", "--iptables=false", "--bridge=none",
             f"--data-root={self.folder / 'root'}", f"--exec-root={self.folder / 'exec'}",
             f"--pidfile={self.folder / 'docker.pid'}", f"--host=unix://{self.socket}"],
            # Its own session, and killed with this process: a killed test run leaves no daemon behind.
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=dies_with_parent())
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and self.process.poll() is None:
            if self.run(["version"], check=False).returncode == 0:
                return True
            time.sleep(0.5)
        self.stop()
        return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def run(self, args: list[str], check: bool = True, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run([DOCKER, *args], env=self.env(), capture_output=True, text=True, timeout=timeout,
                              **kwargs)
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def build(self, image: str, dockerfile: Path, context: Path, **args: str) -> None:
        """`docker build` (BuildKit: the classic builder copies the whole filesystem at every step on
        vfs), the build's network the host's (there is no bridge), timed and sized into BUILT."""
        build_args = [f"--build-arg={name}={value}" for name, value in args.items()]
        started = time.monotonic()
        self.run(["build", "--network=host", "--progress=plain", f"--file={dockerfile}", f"--tag={image}",
                  *build_args, str(context)])
        size = int(self.run(["image", "inspect", "--format={{.Size}}", image]).stdout)
        BUILT[image] = {"seconds": round(time.monotonic() - started, 1), "bytes": size}

    def inspect(self, what: str) -> dict:
        return json.loads(self.run(["inspect", what]).stdout)[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if missing := missing_tools():
        pytest.skip(f"no Docker engine to build with here: missing {missing} (test.sh installs them)")
    if os.geteuid() != 0:
        pytest.skip("dockerd runs as root here (no rootless setup): run the tests as root")
    # A short path: the daemon's sockets live under it, and a socket's path has a 108-byte limit.
    folder = Path(subprocess.check_output(["mktemp", "-d", "/tmp/storyteller-docker-XXXXXX"], text=True).strip())
    engine = Engine(folder)
    engine.start()
    yield engine
    engine.stop()
    subprocess.run(["rm", "-rf", str(folder)], check=False)  # gigabytes of layers (whole copies on vfs)
    if BUILT:
        built = ", ".join(f"{image} {info['bytes'] / 1e6:.0f} MB in {info['seconds']:.0f} s"
                          for image, info in BUILT.items())
        print(f"\nimages built on {engine.driver}: {built}", file=sys.stderr)


def base_image(engine: Engine) -> None:
    """A Debian bookworm image with python3 and venv, made by mmdebstrap from Debian's packages; the
    host's extra CA certificates added (a proxy's, where the registries are reached through one)."""
    tarball = engine.folder / "base.tar"
    hooks = ['rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*']
    extra_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra_cas:
        hooks.insert(0, f'cp {" ".join(map(str, extra_cas))} "$1"/usr/local/share/ca-certificates/ '
                        '&& chroot "$1" update-ca-certificates')
    subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                    # Debian's snapshot mirrors serve Release files past their Valid-Until date.
                    '--aptopt=Acquire::Check-Valid-Until "false"',
                    *[f"--customize-hook={hook}" for hook in hooks],
                    "bookworm", str(tarball), "http://deb.debian.org/debian"],
                   check=True, capture_output=True, timeout=600)
    engine.run(["import", "--change=ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--change=CMD [\"bash\"]", str(tarball), BASE])
    tarball.unlink()


def torch_wheel() -> Path | None:
    """This machine's wheel of requirements-worker.txt's torch, where pip finds local wheels."""
    pin = next(line.split("==")[1].split()[0] for line in (ROOT / "requirements-worker.txt").read_text().splitlines()
               if line.startswith("torch=="))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split():
        found = sorted(Path(folder).glob(f"torch-{pin}+cpu-{tag}-*.whl")) if Path(folder).is_dir() else []
        if found:
            return found[0]
    return None


def build_context(folder: Path) -> Path:
    """The checkout's files as git lists them (tracked, and new ones not ignored) and the torch wheel."""
    context = folder / "context"
    files = subprocess.check_output(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                    cwd=ROOT, text=True).split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, context / name)
    (context / "wheels").mkdir(exist_ok=True)
    if wheel := torch_wheel():
        shutil.copy(wheel, context / "wheels" / wheel.name)
    return context


@pytest.fixture(scope="module")
def images(engine):
    """The base, then the API, worker and services images built side by side (~2 cores' worth of pip
    and apt, much of it waiting on the network)."""
    base_image(engine)
    context = build_context(engine.folder)
    builds = [(API_IMAGE, context / "Dockerfile.api", context),
              (WORKER_IMAGE, context / "Dockerfile.worker", context),
              (SERVICES, HERE / "Dockerfile.services", HERE)]
    errors = []

    def build(image, dockerfile, where):
        try:
            engine.build(image, dockerfile, where, BASE=BASE)
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build, args=spec) for spec in builds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    shutil.rmtree(context)
    return engine


def in_image(engine: Engine, image: str, *command: str) -> subprocess.CompletedProcess:
    return engine.run(["run", "--rm", "--network=none", image, *command], check=False)


def test_api_image_carries_no_torch(images):
    packages = in_image(images, API_IMAGE, "pip", "list", "--format=json")
    assert packages.returncode == 0, packages.stderr
    names = {p["name"].lower() for p in json.loads(packages.stdout)}
    assert "torch" not in names and {"flask", "gunicorn", "openai", "rq"} <= names
    assert in_image(images, API_IMAGE, "python", "-c", "import api.app, batch.job").returncode == 0
    assert in_image(images, API_IMAGE, "test", "-e", "/app/worker").returncode == 1  # only api/, batch/, shared/
    assert in_image(images, API_IMAGE, "test", "-e", "/wheels").returncode == 1  # left in the first stage


def test_worker_image_runs_as_a_user_of_its_own(images):
    assert images.inspect(WORKER_IMAGE)["Config"]["User"] == "10001:10001"
    who = in_image(images, WORKER_IMAGE, "id", "-u")
    assert who.stdout.strip() == "10001"
    # torch is the CPU wheel from wheels/ (or TORCH_INDEX's), and the model is baked in.
    torch = in_image(images, WORKER_IMAGE, "python", "-c", "import torch; print(torch.__version__)")
    assert torch.returncode == 0 and "+cpu" in torch.stdout, torch.stderr
    assert in_image(images, WORKER_IMAGE, "test", "-e", "/wheels").returncode == 1


@pytest.fixture(scope="module")
def stack(images):
    """docker-compose.yml with two workers (Grafana, which Debian does not package, left out), on
    free host ports, until the module's tests are done."""
    ports = {"API_HOST_PORT": free_port(), "PROMETHEUS_HOST_PORT": free_port()}
    project = f"storyteller-test-{os.getpid()}"
    command = ["docker-compose", "--project-name", project, "--file", str(ROOT / "docker-compose.yml"),
               "--file", str(HERE / "compose.test.yml")]
    # One thread per worker and a small cache: two workers share this machine's two cores.
    env = images.env(COMPOSE_DOCKER_CLI_BUILD="0", TORCH_THREADS="1", KV_MEMORY="256",
                     **{name: str(port) for name, port in ports.items()})

    def compose(*args, check=True, timeout=600):
        done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    # One worker first, then the second: two containers made at once on a new named volume both copy
    # the image's cache directory into it, and Docker's copy can fail the second ("failed to mkdir
    # .../tokenizer-...: file exists" (now gguf-...), seen once in a full run, 2026-12-02). docs/operations.md says the same
    # for a first `docker compose up --scale worker=N`.
    compose("up", "--detach", "--no-build", "redis", "api", "worker", "rq-worker", "prometheus")
    compose("up", "--detach", "--no-build", "--no-recreate", "--scale", "worker=2", "worker")
    try:
        yield compose, ports
    finally:
        logs = compose("logs", "--no-color", "--tail=40", check=False).stdout
        compose("down", "--volumes", "--timeout", "30", check=False)
        print(f"\nthe stack's last lines:\n{logs[-6000:]}", file=sys.stderr)


def containers(compose, service: str) -> list[str]:
    return compose("ps", "--quiet", service).stdout.split()


def health_of(engine: Engine, container: str) -> str:
    return engine.inspect(container)["State"].get("Health", {}).get("Status", "none")


def test_compose_serves_a_stream_with_two_healthy_workers(images, stack):
    compose, ports = stack
    workers = containers(compose, "worker")
    assert len(workers) == 2
    watched = workers + containers(compose, "api")
    healthy = lambda: all(health_of(images, c) == "healthy" for c in watched)  # noqa: E731
    wait_until(healthy, timeout=HEALTHY_TIMEOUT_S,
               what=lambda: "healthy containers: " + ", ".join(health_of(images, c) for c in watched))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['API_HOST_PORT']}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                       max_tokens=24, stream=True, seed=3)
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert len(chunks) > 2 and text.strip()
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_prometheus_scrapes_both_workers(images, stack):
    compose, ports = stack
    wait_until(lambda: all(health_of(images, c) == "healthy" for c in containers(compose, "worker")),
               timeout=HEALTHY_TIMEOUT_S, what="two healthy workers")
    url = f"http://127.0.0.1:{ports['PROMETHEUS_HOST_PORT']}/api/v1/targets"

    def targets_up() -> dict[str, int]:
        with urllib.request.urlopen(url, timeout=5) as answer:
            active = json.load(answer)["data"]["activeTargets"]
        up: dict[str, int] = {}
        for target in active:
            if target["health"] == "up":
                up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
        return up

    wait_until(lambda: targets_up().get("worker") == 2 and targets_up().get("api") == 1, timeout=90,
               what=lambda: f"targets up: {targets_up()}")
