"""API keys and the rate limit: on fakeredis through Flask's test client, then against two real
`python -m api` processes sharing one redis-server, with OpenAI's own client."""
from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
import redis

import api.__main__
from api import auth
from api.app import create_app
from shared import keys
from shared.settings import Settings
from tests.processes import RedisServer, free_port, get_json, logs, make_client, start, stop, wait_until

KEYS = "key-alpha-1234567890,key-beta-0987654321"
ALPHA, BETA = KEYS.split(",")


def _app(fake_redis, **settings):
    return create_app(Settings(**settings), client=fake_redis).test_client()


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _error(response, status: int, code: str, kind: str) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["type"]) == (code, kind)
    return error


class Clock:
    """Stands in for api.auth's `time`: a wall clock the test moves."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


# API keys

def test_without_keys_no_header_is_needed_and_nothing_is_counted(fake_redis):
    client = _app(fake_redis)
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models", headers=_bearer("anything")).status_code == 200
    assert fake_redis.keys(keys.rate("*", "*")) == []


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer   "},
    {"Authorization": f"Basic {ALPHA}"},
    {"Authorization": ALPHA},
], ids=["none", "empty", "bearer-only", "bearer-blank", "basic", "no-scheme"])
def test_a_missing_key_gets_a_401_in_openai_shape(fake_redis, headers):
    error = _error(_app(fake_redis, api_keys=KEYS).get("/v1/models", headers=headers),
                   401, "invalid_api_key", "invalid_request_error")
    assert "Authorization" in error["message"] and ALPHA not in error["message"]


@pytest.mark.parametrize("sent", ["wrong", ALPHA[:-1], ALPHA + "x", KEYS, f" {ALPHA}x "])
def test_a_wrong_key_gets_a_401_that_never_repeats_it(fake_redis, sent):
    response = _app(fake_redis, api_keys=KEYS).get("/v1/models", headers=_bearer(sent))
    error = _error(response, 401, "invalid_api_key", "invalid_request_error")
    assert sent.strip() not in response.get_data(as_text=True)
    assert error["message"] == "Incorrect API key provided."


def test_every_configured_key_is_let_in(fake_redis):
    client = _app(fake_redis, api_keys=f" {ALPHA} ,, {BETA} ")  # spaces and empty items ignored
    for key in (ALPHA, BETA):
        assert client.get("/v1/models", headers=_bearer(key)).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"bearer  {BETA} "}).status_code == 200


def test_keys_are_checked_before_the_body_and_on_every_v1_route(fake_redis):
    client = _app(fake_redis, api_keys=KEYS)
    for method, path in [("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/v1/models"), ("get", "/v1/no-such-route"), ("get", "/v1")]:
        response = getattr(client, method)(path, data="not json")
        _error(response, 401, "invalid_api_key", "invalid_request_error")
    # With the key, the same broken body reaches validation.
    response = client.post("/v1/completions", data="not json", headers=_bearer(ALPHA))
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "invalid_json"


def test_health_openapi_and_metrics_stay_open(fake_redis):
    client = _app(fake_redis, api_keys=KEYS, rate_limit=1)
    for _ in range(3):  # not counted either
        assert client.get("/health").status_code == 200
    for path in ("/openapi.json", "/metrics"):  # whether or not the route exists yet: never a 401
        assert client.get(path).status_code != 401
    assert fake_redis.keys(keys.rate("*", "*")) == []


def test_every_key_is_compared_whichever_matches(fake_redis, monkeypatch):
    compared = []

    def compare_digest(a, b):
        compared.append(b)
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    client = _app(fake_redis, api_keys=f"{ALPHA},{BETA},key-gamma")
    for sent in (ALPHA, "wrong"):
        compared.clear()
        client.get("/v1/models", headers=_bearer(sent))
        assert len(compared) == 3 and len(set(compared)) == 3  # equal-length digests, all three


def test_keys_file_lines_comments_and_blanks(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# the game servers\n{ALPHA}\n\n   \n  {BETA}  \n  # an old key, revoked\n")
    assert auth.load_keys(Settings(api_keys_file=str(path))) == [ALPHA, BETA]
    assert auth.load_keys(Settings(api_keys="k1, k2", api_keys_file=str(path))) == ["k1", "k2", ALPHA, BETA]
    assert auth.load_keys(Settings()) == []


def test_keys_from_a_file_are_let_in(fake_redis, tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# comment\n{BETA}\n")
    client = _app(fake_redis, api_keys_file=str(path))
    assert client.get("/v1/models", headers=_bearer(BETA)).status_code == 200
    _error(client.get("/v1/models", headers=_bearer("# comment")), 401, "invalid_api_key", "invalid_request_error")


def test_an_unreadable_keys_file_stops_the_api_before_it_starts(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(SystemExit, match="nope.txt"):
        api.__main__.main(["--api-keys-file", str(missing), "--port", str(free_port())])


def test_help_settings_repr_and_errors_never_show_a_key(monkeypatch, capsys):
    monkeypatch.setenv("API_KEYS", KEYS)
    with pytest.raises(SystemExit):
        Settings.parse(["--help"], api.__main__.FLAGS, "test")
    shown = capsys.readouterr().out
    assert "--api-keys" in shown and "<hidden>" in shown and ALPHA not in shown
    assert ALPHA not in repr(Settings.from_env()) and "api_keys=<hidden>" in repr(Settings.from_env())
    assert "api_keys=''" in repr(Settings())  # an empty one is not a secret


# The rate limit

def test_past_the_limit_a_key_gets_a_429_with_retry_after(fake_redis, monkeypatch):
    clock = Clock(1_000 * 60 + 45.2)  # 14.8 s left in this minute
    monkeypatch.setattr(auth, "time", clock)
    client = _app(fake_redis, api_keys=KEYS, rate_limit=3)
    for _ in range(3):
        assert client.get("/v1/models", headers=_bearer(ALPHA)).status_code == 200
    response = client.get("/v1/models", headers=_bearer(ALPHA))
    error = _error(response, 429, "rate_limit_exceeded", "rate_limit_error")
    assert response.headers["Retry-After"] == "15" and "15 s" in error["message"]
    assert ALPHA not in response.get_data(as_text=True)
    # Per key: the other key has its own count.
    assert client.get("/v1/models", headers=_bearer(BETA)).status_code == 200
    # The next minute is a new window.
    clock.now += 15
    assert client.get("/v1/models", headers=_bearer(ALPHA)).status_code == 200


def test_retry_after_is_at_least_one_second(fake_redis, monkeypatch):
    clock = Clock(2_000 * 60 + 59.95)
    monkeypatch.setattr(auth, "time", clock)
    client = _app(fake_redis, api_keys=KEYS, rate_limit=1)
    client.get("/v1/models", headers=_bearer(ALPHA))
    response = client.get("/v1/models", headers=_bearer(ALPHA))
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"


def test_the_count_is_named_by_digest_and_expires(fake_redis, monkeypatch):
    clock = Clock(3_000 * 60 + 10)
    monkeypatch.setattr(auth, "time", clock)
    client = _app(fake_redis, api_keys=KEYS, rate_limit=10)
    client.get("/v1/models", headers=_bearer(ALPHA))
    client.post("/v1/completions", data="not json", headers=_bearer(ALPHA))  # a 400 counts too
    names = [n.decode() for n in fake_redis.keys(keys.rate("*", "*"))]
    assert len(names) == 1 and names[0].endswith(":3000")
    assert ALPHA not in names[0] and ALPHA[:8] not in names[0]
    assert fake_redis.get(names[0]) == b"2"
    assert 0 < fake_redis.ttl(names[0]) <= auth.WINDOW_S


def test_without_keys_the_limit_is_per_client_address(fake_redis, monkeypatch):
    monkeypatch.setattr(auth, "time", Clock(4_000 * 60))
    client = _app(fake_redis, rate_limit=2)
    one, other = {"REMOTE_ADDR": "10.0.0.1"}, {"REMOTE_ADDR": "10.0.0.2"}
    assert [client.get("/v1/models", environ_base=one).status_code for _ in range(3)] == [200, 200, 429]
    assert client.get("/v1/models", environ_base=other).status_code == 200
    error = client.get("/v1/models", environ_base=one).get_json()["error"]
    assert "per client address" in error["message"]


def test_redis_down_during_the_count_gets_a_503_not_a_free_pass():
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    client = create_app(Settings(api_keys=KEYS, rate_limit=5), client=down).test_client()
    _error(client.get("/v1/models", headers=_bearer(ALPHA)), 503, "service_unavailable", "service_unavailable")
    # A missing key is still a 401: the key is checked before Redis is asked anything.
    _error(client.get("/v1/models"), 401, "invalid_api_key", "invalid_request_error")


# Real processes: one worker, two API processes on one redis-server

MODEL = "tiny-llama"
LIMIT = 5
GAMMA = "key-gamma-for-the-rate-test"


class Pair:
    def __init__(self, ports, procs):
        self.ports, self.procs = ports, procs


@pytest.fixture(scope="module")
def pair(tiny_model_dirs, tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis-auth")))
    server.start()
    log_dir = tmp_path_factory.mktemp("auth-logs")
    ports = [free_port(), free_port()]
    env = dict(REDIS_URL=server.url, API_KEYS=f"{KEYS},{GAMMA}", RATE_LIMIT=str(LIMIT))
    worker = start(["worker", "--model", tiny_model_dirs["llama"], "--dtype", "float32"], log_dir, "worker", **env)
    apis = [start(["api", "--port", str(port), "--threads", "8"], log_dir, f"api{i}", **env)
            for i, port in enumerate(ports)]
    procs = [worker, *apis]
    try:
        for port in ports:  # /health: open, and it lists the models with a live worker
            wait_until(lambda: MODEL in get_json(f"http://127.0.0.1:{port}/health")[1].get("models", []),
                       procs, f"API on {port} to see the worker")
        yield Pair(ports, procs)
    finally:
        for proc in reversed(procs):
            stop(proc)
        server.stop()


@pytest.mark.timeout(180)
def test_a_real_api_wants_the_key_and_answers_with_it(pair):
    port = pair.ports[0]
    status, body = get_json(f"http://127.0.0.1:{port}/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with make_client(port, api_key="not-a-key") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with make_client(port, api_key=ALPHA) as client:
        done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.prompt_tokens > 0
    everything = logs(*pair.procs)
    for key in KEYS.split(","):
        assert key not in everything


@pytest.mark.timeout(180)
def test_the_rate_limit_holds_across_two_api_processes(pair):
    # The window is the wall-clock minute: start early in one, so that all requests fall in it.
    if time.time() % 60 > 45:
        time.sleep(60.5 - time.time() % 60)
    clients = [make_client(port, api_key=GAMMA) for port in pair.ports]
    try:
        for i in range(LIMIT):  # alternating between the two processes
            assert clients[i % 2].models.list().data[0].id == MODEL
        with pytest.raises(openai.RateLimitError) as caught:
            clients[LIMIT % 2].models.list()
        retry_after = int(caught.value.response.headers["retry-after"])
        assert 1 <= retry_after <= 60 and caught.value.code == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):  # the other process counts the same window
            clients[(LIMIT + 1) % 2].models.list()
    finally:
        for client in clients:
            client.close()
    # Another key is not held back.
    with make_client(pair.ports[1], api_key=BETA) as client:
        assert client.models.list().data[0].id == MODEL
    # /health stays open however many requests the key has made.
    request = urllib.request.Request(f"http://127.0.0.1:{pair.ports[0]}/health")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert json.load(response)["status"] == "ok"
