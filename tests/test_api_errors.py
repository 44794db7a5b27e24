"""Every way a request can be wrong or fail, on fakeredis: a clear 4xx/5xx in OpenAI's shape, fast."""
from __future__ import annotations

import threading
import time

import pytest

from api.app import create_app
from shared import keys
from shared.protocol import Job
from shared.settings import Settings
from tests.fake_workers import (CONTEXT, MODEL, answer_in_background, completion_body, openai_error, register_worker,
                                seen_jobs)
from tests.processes import free_port
from tests.tiny_models import tiny_tokenizer


@pytest.fixture
def served(fake_redis):
    queue = register_worker(fake_redis)
    app = create_app(Settings(request_timeout=5), client=fake_redis)
    return app.test_client(), queue


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL}, "prompt"),
    (completion_body(model=3), "model"),
    (completion_body(prompt=""), "prompt"),
    (completion_body(prompt=[]), "prompt"),
    (completion_body(prompt={"text": "hi"}), "prompt"),
    (completion_body(max_tokens=0), "max_tokens"),
    (completion_body(max_tokens="ten"), "max_tokens"),
    (completion_body(max_tokens=True), "max_tokens"),
    (completion_body(temperature=-0.1), "temperature"),
    (completion_body(temperature="hot"), "temperature"),
    (completion_body(top_p=0), "top_p"),
    (completion_body(top_p=1.5), "top_p"),
    (completion_body(top_k=-2), "top_k"),
    (completion_body(n=0), "n"),
    (completion_body(n=9), "n"),
    (completion_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (completion_body(stop=[1]), "stop"),
    (completion_body(stop=[""]), "stop"),
    (completion_body(seed="x"), "seed"),
    (completion_body(seed=2**70), "seed"),
    (completion_body(stream="yes"), "stream"),
    (completion_body(ignore_eos=1), "ignore_eos"),
    (completion_body(prompt=[[1, 2], [10**6]]), "prompt"),  # token id outside the vocabulary
])
def test_bad_completion_fields_get_a_400_naming_the_field(served, body, param):
    client, _ = served
    openai_error(client.post("/v1/completions", json=body), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
])
def test_bad_chat_fields_get_a_400_naming_the_field(served, body, param):
    client, _ = served
    openai_error(client.post("/v1/chat/completions", json=body), 400, param=param)


@pytest.mark.parametrize("data", ["{not json", "", "[1, 2]", '"a string"'])
def test_a_body_that_is_not_a_json_object_gets_a_400(served, data):
    client, _ = served
    response = client.post("/v1/completions", data=data, content_type="application/json")
    openai_error(response, 400)


def test_a_prompt_that_leaves_no_room_gets_context_length_exceeded(served):
    client, queue = served
    long_prompt = " ".join(["dragon"] * CONTEXT)
    error = openai_error(client.post("/v1/completions", json=completion_body(prompt=long_prompt)), 400,
                         code="context_length_exceeded")
    assert str(CONTEXT) in error["message"]  # says what is allowed...
    assert "tokens" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}
    openai_error(client.post("/v1/chat/completions", json=chat), 400, code="context_length_exceeded")
    assert queue.redis.llen(keys.queue(MODEL)) == 0  # nothing was queued


def test_max_tokens_beyond_the_room_is_cut_to_the_room(served, fake_redis):
    client, queue = served
    prompt_ids = tiny_tokenizer()("Once upon a time").input_ids
    answer_in_background(fake_redis, queue)
    # within the window, past the room
    response = client.post("/v1/completions", json=completion_body(max_tokens=CONTEXT))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json()["choices"][0]["finish_reason"] == "length"
    assert seen_jobs[0].params.max_tokens == CONTEXT - len(prompt_ids)


def test_an_unknown_model_gets_a_404(served):
    client, _ = served
    error = openai_error(client.post("/v1/completions", json=completion_body(model="gpt-5")), 404,
                         param="model", code="model_not_found")
    assert MODEL in error["message"]  # says what is served instead


def test_no_live_worker_gets_a_503_at_once(fake_redis):
    client = create_app(Settings(), client=fake_redis).test_client()
    started = time.monotonic()
    openai_error(client.post("/v1/completions", json=completion_body()), 503)
    # At once: a request queued for a worker would wait its 60 s worker_grace (or the 300 s
    # request_timeout) before a 503; refused up front it takes milliseconds, under 10 s on any load.
    assert time.monotonic() - started < 10
    assert client.get("/v1/models").get_json()["data"] == []


def test_every_worker_stopping_gets_a_503_that_says_so(fake_redis):
    """Ctrl-C or `compose down`: the workers drain. A new request is told the service is stopping,
    not to start a worker (one is running, finishing what it holds)."""
    register_worker(fake_redis, draining=True)
    client = create_app(Settings(), client=fake_redis).test_client()
    response = client.post("/v1/completions", json=completion_body())
    error = openai_error(response, 503)
    assert "stopping" in error["message"] and "start one" not in error["message"]
    assert response.headers["Retry-After"]
    # With no worker at all, the 503 says to start one.
    fake_redis.flushall()
    fresh = create_app(Settings(), client=fake_redis).test_client()
    assert "start one" in openai_error(fresh.post("/v1/completions", json=completion_body()), 503)["message"]


def test_redis_down_gets_a_503_within_two_seconds():
    # Nothing listens on this port: connecting fails at once, as it does when Redis is down.
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    client = create_app(settings).test_client()
    for path, body in [("/v1/completions", completion_body()), ("/v1/chat/completions", None)]:
        started = time.monotonic()
        response = client.post(path, json=body or {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        openai_error(response, 503)
        assert "Redis" in response.get_json()["error"]["message"]
        # A refused connection fails in milliseconds; the bound tells that from a request left
        # hanging on Redis (its 300 s request_timeout), with room for a loaded 2-core machine.
        assert time.monotonic() - started < 10
    openai_error(client.get("/health"), 503)


def test_a_worker_that_dies_mid_request_gets_a_503_after_the_grace_period(fake_redis):
    register_worker(fake_redis)
    client = create_app(Settings(worker_grace=1.0, request_timeout=30), client=fake_redis).test_client()
    # The job is queued, then the worker's heartbeat disappears, as if it was killed: in that order
    # (a timer could fire before a loaded machine had queued the job, and get a 503 at once).
    def kill_once_queued():
        deadline = time.monotonic() + 30
        while not fake_redis.llen(keys.queue(MODEL)) and time.monotonic() < deadline:
            time.sleep(0.01)
        fake_redis.delete(keys.heartbeat(MODEL, "w1"))
    threading.Thread(target=kill_once_queued, daemon=True).start()
    started = time.monotonic()
    response = client.post("/v1/completions", json=completion_body())
    openai_error(response, 503)
    assert response.headers["Retry-After"].isdigit()
    # The 1 s grace was waited out (never less: load only lengthens it), and the 503 came then, not
    # at the 30 s request_timeout: 15 s leaves a loaded machine room and tells the two apart.
    assert 1.0 <= time.monotonic() - started < 15


def test_a_request_past_its_deadline_gets_a_504(fake_redis):
    register_worker(fake_redis)
    client = create_app(Settings(request_timeout=0.5), client=fake_redis).test_client()
    started = time.monotonic()
    error = openai_error(client.post("/v1/completions", json=completion_body()), 504, code="timeout")
    assert "timed out" in error["message"]
    # At the request's 0.5 s deadline, not the 300 s default: 15 s is far from both, whatever the load.
    assert time.monotonic() - started < 15
    # The abandoned job is cancelled, so a worker that takes it later will not decode it.
    [raw] = fake_redis.lrange(keys.queue(MODEL), 0, -1)
    assert fake_redis.exists(keys.cancel(MODEL, Job.from_json(raw).id))


def test_unknown_routes_and_methods_answer_in_openai_shape(served):
    client, _ = served
    openai_error(client.get("/v1/nothing"), 404)
    openai_error(client.get("/v1/completions"), 405)


def test_a_missed_final_message_is_read_from_the_stored_answer(fake_redis):
    queue = register_worker(fake_redis)
    # A 60 s deadline, far from the stored answer's lookup (every LOOK_EVERY_S, 1 s).
    client = create_app(Settings(request_timeout=60), client=fake_redis).test_client()
    answer_in_background(fake_redis, queue, publish=False)
    started = time.monotonic()
    response = client.post("/v1/completions", json=completion_body(max_tokens=2))
    assert response.status_code == 200
    body = response.get_json()
    assert body["choices"][0]["text"] == " and then"
    assert body["usage"]["completion_tokens"] == 2
    # Read at a lookup a second or so in, not found only as the 60 s deadline came: 30 s leaves a
    # loaded 2-core machine room and still tells the two apart.
    assert time.monotonic() - started < 30
