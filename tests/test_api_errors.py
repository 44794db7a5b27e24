"""Every way a request can be wrong or fail, on fakeredis: a clear 4xx/5xx in OpenAI's shape, fast."""
from __future__ import annotations

import threading
import time

import pytest

from api.app import create_app
from shared import keys
from shared.protocol import Final, Job, WorkerInfo, encode_result
from shared.settings import Settings
from tests.processes import free_port
from tests.tiny_models import tiny_tokenizer
from worker import model_loader
from worker.job_queue import JobQueue

MODEL = "tiny"
CONTEXT = 64


def _register_worker(client, model=MODEL, worker_id="w1", draining=False) -> JobQueue:
    files = model_loader.tokenizer_files(tiny_tokenizer())
    queue = JobQueue(client, worker_id, model)
    queue.store_tokenizer(files)
    info = WorkerInfo(id=worker_id, model=model, context_window=CONTEXT, engine="static", batch=4,
                      device="cpu", dtype="float32", tokenizer_digest=model_loader.digest(files),
                      pid=1, host="test", started=time.time(), draining=draining)
    queue.heartbeat(info, ttl_s=60)
    return queue


@pytest.fixture
def served(fake_redis):
    queue = _register_worker(fake_redis)
    app = create_app(Settings(request_timeout=5), client=fake_redis)
    return app.test_client(), queue


def _error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL}, "prompt"),
    (_completion(model=3), "model"),
    (_completion(prompt=""), "prompt"),
    (_completion(prompt=[]), "prompt"),
    (_completion(prompt={"text": "hi"}), "prompt"),
    (_completion(max_tokens=0), "max_tokens"),
    (_completion(max_tokens="ten"), "max_tokens"),
    (_completion(max_tokens=True), "max_tokens"),
    (_completion(temperature=-0.1), "temperature"),
    (_completion(temperature="hot"), "temperature"),
    (_completion(top_p=0), "top_p"),
    (_completion(top_p=1.5), "top_p"),
    (_completion(top_k=-2), "top_k"),
    (_completion(n=0), "n"),
    (_completion(n=9), "n"),
    (_completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_completion(stop=[1]), "stop"),
    (_completion(stop=[""]), "stop"),
    (_completion(seed="x"), "seed"),
    (_completion(seed=2**70), "seed"),
    (_completion(stream="yes"), "stream"),
    (_completion(ignore_eos=1), "ignore_eos"),
    (_completion(prompt=[[1, 2], [10**6]]), "prompt"),  # token id outside the vocabulary
])
def test_bad_completion_fields_get_a_400_naming_the_field(served, body, param):
    client, _ = served
    _error(client.post("/v1/completions", json=body), 400, param=param)


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
    _error(client.post("/v1/chat/completions", json=body), 400, param=param)


@pytest.mark.parametrize("data", ["{not json", "", "[1, 2]", '"a string"'])
def test_a_body_that_is_not_a_json_object_gets_a_400(served, data):
    client, _ = served
    response = client.post("/v1/completions", data=data, content_type="application/json")
    _error(response, 400)


def test_a_prompt_that_leaves_no_room_gets_context_length_exceeded(served):
    client, queue = served
    long_prompt = " ".join(["dragon"] * CONTEXT)
    error = _error(client.post("/v1/completions", json=_completion(prompt=long_prompt)), 400,
                   code="context_length_exceeded")
    assert str(CONTEXT) in error["message"]  # says what is allowed...
    assert "tokens" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}
    _error(client.post("/v1/chat/completions", json=chat), 400, code="context_length_exceeded")
    assert queue.redis.llen(keys.queue(MODEL)) == 0  # nothing was queued


def test_max_tokens_beyond_the_room_is_cut_to_the_room(served, fake_redis):
    client, queue = served
    prompt_ids = tiny_tokenizer()("Once upon a time").input_ids
    _answer_in_background(fake_redis, queue)
    response = client.post("/v1/completions", json=_completion(max_tokens=CONTEXT))  # within the window, past the room
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json()["choices"][0]["finish_reason"] == "length"
    assert _seen_jobs[0].params.max_tokens == CONTEXT - len(prompt_ids)


def test_an_unknown_model_gets_a_404(served):
    client, _ = served
    error = _error(client.post("/v1/completions", json=_completion(model="gpt-5")), 404,
                   param="model", code="model_not_found")
    assert MODEL in error["message"]  # says what is served instead


def test_no_live_worker_gets_a_503_at_once(fake_redis):
    client = create_app(Settings(), client=fake_redis).test_client()
    started = time.monotonic()
    _error(client.post("/v1/completions", json=_completion()), 503)
    assert time.monotonic() - started < 2
    assert client.get("/v1/models").get_json()["data"] == []


def test_every_worker_stopping_gets_a_503_that_says_so(fake_redis):
    """Ctrl-C or `compose down`: the workers drain. A new request is told the service is stopping,
    not to start a worker (one is running, finishing what it holds)."""
    _register_worker(fake_redis, draining=True)
    client = create_app(Settings(), client=fake_redis).test_client()
    response = client.post("/v1/completions", json=_completion())
    error = _error(response, 503)
    assert "stopping" in error["message"] and "start one" not in error["message"]
    assert response.headers["Retry-After"]
    # With no worker at all, the 503 says to start one.
    fake_redis.flushall()
    fresh = create_app(Settings(), client=fake_redis).test_client()
    assert "start one" in _error(fresh.post("/v1/completions", json=_completion()), 503)["message"]


def test_redis_down_gets_a_503_within_two_seconds():
    # Nothing listens on this port: connecting fails at once, as it does when Redis is down.
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    client = create_app(settings).test_client()
    for path, body in [("/v1/completions", _completion()), ("/v1/chat/completions", None)]:
        started = time.monotonic()
        response = client.post(path, json=body or {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        _error(response, 503)
        assert "Redis" in response.get_json()["error"]["message"]
        assert time.monotonic() - started < 2
    _error(client.get("/health"), 503)


def test_a_worker_that_dies_mid_request_gets_a_503_after_the_grace_period(fake_redis):
    _register_worker(fake_redis)
    client = create_app(Settings(worker_grace=1.0, request_timeout=30), client=fake_redis).test_client()
    # The job is queued, then the worker's heartbeat disappears, as if it was killed.
    threading.Timer(0.3, fake_redis.delete, (keys.heartbeat(MODEL, "w1"),)).start()
    started = time.monotonic()
    response = client.post("/v1/completions", json=_completion())
    _error(response, 503)
    assert response.headers["Retry-After"].isdigit()
    assert 1.0 <= time.monotonic() - started < 4


def test_a_request_past_its_deadline_gets_a_504(fake_redis):
    _register_worker(fake_redis)
    client = create_app(Settings(request_timeout=0.5), client=fake_redis).test_client()
    started = time.monotonic()
    error = _error(client.post("/v1/completions", json=_completion()), 504, code="timeout")
    assert "timed out" in error["message"]
    assert time.monotonic() - started < 3
    # The abandoned job is cancelled, so a worker that takes it later will not decode it.
    [raw] = fake_redis.lrange(keys.queue(MODEL), 0, -1)
    assert fake_redis.exists(keys.cancel(MODEL, Job.from_json(raw).id))


def test_unknown_routes_and_methods_answer_in_openai_shape(served):
    client, _ = served
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/completions"), 405)


_seen_jobs: list[Job] = []


def next_job(client, model: str, tries: int = 200) -> Job:
    """The next job queued for `model`, as a stand-in worker takes it (polling: fakeredis)."""
    for _ in range(tries):
        raw = client.lpop(keys.queue(model))
        if raw:
            return Job.from_json(raw)
        time.sleep(0.01)
    raise AssertionError(f"no job for {model} was queued")


def _answer_in_background(client, queue: JobQueue, publish: bool = True) -> None:
    """A stand-in worker: takes one job and answers it (optionally only by the stored copy)."""
    _seen_jobs.clear()

    def answer():
        job = next_job(client, MODEL)
        _seen_jobs.append(job)
        final = encode_result(Final(text=" and then", finish_reason="length",
                                    prompt_tokens=len(job.prompt_ids), completion_tokens=2))
        client.set(keys.answer(job.model, job.id), final)
        if publish:
            client.publish(keys.channel(job.model, job.id), final)

    threading.Thread(target=answer, daemon=True).start()


def test_a_missed_final_message_is_read_from_the_stored_answer(served, fake_redis):
    client, queue = served
    _answer_in_background(fake_redis, queue, publish=False)
    started = time.monotonic()
    response = client.post("/v1/completions", json=_completion(max_tokens=2))
    assert response.status_code == 200
    body = response.get_json()
    assert body["choices"][0]["text"] == " and then"
    assert body["usage"]["completion_tokens"] == 2
    assert time.monotonic() - started < 3
