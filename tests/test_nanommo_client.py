"""examples/nanommo_client.py as a new user runs it, against a real stack (a private redis-server,
a tiny-model worker, two `python -m api` processes that want API keys, one of them with a rate
limit): 8 players read as a game server's log, one line per story; a wrong key, a full queue or no
service ends in one line and exit status 1, never a traceback; --help shows the defaults."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.processes import ROOT, RedisServer, free_port, get_json, start, stop, tiny_worker, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-llama"
KEY = "key-nanommo-1234567890"
LIMITED_KEY = "key-nanommo-limited-0987"  # used only on the rate-limited API: its own count
CLIENT = str(ROOT / "examples" / "nanommo_client.py")
STORY = re.compile(r"^\d\d:\d\d:\d\d \[(\w+)\] +story (\d): (\d+) tokens in \d+\.\d\d s: \S")


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("nanommo")
    server = RedisServer(str(log_dir))
    server.start()
    open_port, limited_port = free_port(), free_port()
    keys = f"{KEY},{LIMITED_KEY}"
    procs = [
        tiny_worker(tiny_model_dirs["llama"], server, log_dir, "worker", "--batch", "8"),
        start(["api", "--port", str(open_port)], log_dir, "api", REDIS_URL=server.url, API_KEYS=keys),
        start(["api", "--port", str(limited_port)], log_dir, "api-limited", REDIS_URL=server.url,
              API_KEYS=keys, RATE_LIMIT="1"),
    ]
    try:
        for port in (open_port, limited_port):
            wait_until(lambda: MODEL in get_json(f"http://127.0.0.1:{port}/health")[1].get("models", []),
                       procs, f"the API on {port} to see the worker")
        yield open_port, limited_port
    finally:
        for proc in reversed(procs):
            stop(proc)
        server.stop()


def client(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update({"OPENAI_API_KEY": key} if key else {})
    return subprocess.run([sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1"


def assert_one_clear_error(ran: subprocess.CompletedProcess, *words: str) -> None:
    shown = ran.stdout + ran.stderr
    assert ran.returncode == 1, shown
    assert "Traceback" not in shown and "after nan" not in shown, shown
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), shown


def test_eight_players_read_as_a_log_one_line_per_story(stack):
    open_port, _ = stack
    ran = client("--url", url(open_port), "--players", "8", "--turns", "1", "--max-tokens", "12", "--seed", "1",
                 key=KEY)  # seeded: a fresh draw could end a story at its first token (0 tokens)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    stories = [STORY.match(line) for line in lines[:-1]]
    assert all(stories), ran.stdout  # every line but the summary is one whole story
    told = sorted((m[1], int(m[2])) for m in stories)
    names = ["Aria", "Borin", "Cael", "Dara", "Eryk", "Fenna", "Gorm", "Hild"]
    assert told == [(name, 1) for name in names]  # one turn: the tiny model holds 128 tokens
    assert all(1 <= int(m[3]) <= 12 for m in stories)
    assert re.fullmatch(r"8 players, 8 stories from tiny-llama; first text after \d+\.\d\d s \(median\), "
                        r"0 retries, 0 players failed", lines[-1]), lines[-1]


def test_a_seed_tells_the_same_stories_again_in_a_smaller_crowd(stack):
    """--seed: each player's stories come from seeds of their own, so the same player tells the same
    story whoever else plays (the service writes a request's text whatever shares its step)."""
    open_port, _ = stack

    def stories(players: str) -> dict:
        ran = client("--url", url(open_port), "--players", players, "--turns", "1", "--max-tokens", "12",
                     "--seed", "7", key=KEY)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        # "[Name] story 1: N tokens in T s: first words": the player, the count and the words
        return {m[1]: (m[2], m[3]) for m in re.finditer(r"\[(\w+)\] +story 1: (\d+) tokens in [\d.]+ s: (.*)",
                                                          ran.stdout)}

    crowd, few = stories("8"), stories("3")
    assert len(crowd) == 8 and len(few) == 3
    assert few == {name: crowd[name] for name in few}


@pytest.mark.parametrize("model", [None, MODEL], ids=["model-asked", "model-given"])
def test_a_wrong_key_is_one_line_not_a_traceback(stack, model):
    open_port, _ = stack
    ran = client("--url", url(open_port), *(["--model", model] if model else []), key="not-the-key")
    assert_one_clear_error(ran, "refused the API key", "401", "--api-key")


def test_no_key_at_all_says_so_too(stack):
    ran = client("--url", url(stack[0]))
    assert_one_clear_error(ran, "refused the API key", "401")


def test_a_full_queue_is_one_line_not_a_traceback(stack):
    _, limited_port = stack
    # One request a minute for this key: the first player may get through, the others get 429.
    ran = client("--url", url(limited_port), "--model", MODEL, "--players", "4", "--turns", "1",
                 "--max-tokens", "4", "--retries", "0", key=LIMITED_KEY)
    assert_one_clear_error(ran, "too busy", "429", "--players")


def test_no_service_is_one_line_not_a_traceback():
    ran = client("--url", url(free_port()), key=KEY)
    assert_one_clear_error(ran, "no service at", "serve.sh")


def test_help_lists_the_defaults():
    ran = client("--help")
    assert ran.returncode == 0, ran.stderr
    for default in ("(default: http://127.0.0.1:8000/v1)", "(default: 8)", "(default: 80)", "(default: 5)"):
        assert default in " ".join(ran.stdout.split()), ran.stdout
    assert "(default: None)" not in ran.stdout
