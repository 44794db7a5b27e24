"""The batch API on fakeredis: the routes and file store (Flask's test client), and the batch job's
runner with a stand-in for the API (order, bounded concurrency, priority, retries, cancel, resume).
The real service (API, worker, RQ worker on a redis-server) is tests/test_batch_service.py's.
"""
from __future__ import annotations

import io
import json
import threading
import time

import pytest
from rq import Queue

from api.app import create_app
from batch.job import BatchRun, Reply
from api.batch_store import BatchStore
from api.file_store import FileStore
from shared import keys
from shared.protocol import PRIORITY_MAX
from shared.settings import Settings


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    body = body or {"model": "tiny", "messages": [{"role": "user", "content": f"Tell of {custom_id}"}],
                    "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(params=["redis", "dir"])
def api(request, fake_redis, tmp_path):
    files_dir = str(tmp_path / "files") if request.param == "dir" else ""
    app = create_app(Settings(files_dir=files_dir, batch_file_limit=1), client=fake_redis)
    return app.test_client()


def upload(api, content: bytes, purpose="batch", filename="lore.jsonl"):
    data = {"file": (io.BytesIO(content), filename)}
    if purpose is not None:
        data["purpose"] = purpose
    return api.post("/v1/files", data=data, content_type="multipart/form-data")


def error(response, status: int, code=None) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()["error"]
    if code:
        assert body["code"] == code
    return body["message"]


# Files

def test_an_uploaded_file_reads_back_whole(api):
    content = jsonl(line("a"), line("b"))
    created = upload(api, content)
    assert created.status_code == 200, created.get_data(as_text=True)
    file = created.get_json()
    assert file["object"] == "file" and file["purpose"] == "batch" and file["bytes"] == len(content)
    assert file["filename"] == "lore.jsonl" and file["id"].startswith("file-")
    assert api.get(f"/v1/files/{file['id']}").get_json() == file
    assert api.get(f"/v1/files/{file['id']}/content").data == content
    assert api.delete(f"/v1/files/{file['id']}").get_json()["deleted"] is True
    error(api.get(f"/v1/files/{file['id']}/content"), 404, "file_not_found")


@pytest.mark.parametrize("content, says", [
    (jsonl(line("a"), "{not json"), "line 2: not valid JSON"),
    (jsonl("[1, 2]"), "line 1: must be a JSON object"),
    (jsonl({**line("a"), "custom_id": ""}), "line 1: 'custom_id' must be a non-empty string"),
    (jsonl(line("a"), line("b"), line("a")), "line 3: custom_id 'a' is already used on line 1"),
    (jsonl({**line("a"), "method": "GET"}), "line 1: 'method' must be \"POST\""),
    (jsonl({**line("a"), "url": "/v1/embeddings"}), "line 1: 'url' must be one of /v1/completions"),
    (jsonl({**line("a"), "body": "hi"}), "line 1: 'body' must be a JSON object"),
    (jsonl(line("a"), line("b", url="/v1/completions", model="tiny", prompt="x", stream=True)),
     "line 2: 'body.stream' must be false"),
    (jsonl(line("a"), line("b", model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0)),
     "line 2 (custom_id 'b'): 'max_tokens' must be at least 1"),
    (jsonl(line("x", url="/v1/completions", model="tiny")), "line 1 (custom_id 'x'): you must provide 'prompt'"),
    (jsonl(line("a"), "", line("b", model="tiny", messages=[], max_tokens=2)), "line 3 (custom_id 'b'): 'messages'"),
    (jsonl('{"custom_id": "\\ud800", "method": "POST"}'), "line 1: holds a lone surrogate"),
    (b"\n\n", "the file holds no requests"),
    (b'{"custom_id": "caf\xe9"}', "not UTF-8"),
])
def test_a_bad_line_is_a_400_naming_it(api, content, says):
    assert says in error(upload(api, content), 400, "invalid_file")


def test_a_file_needs_the_batch_purpose_and_a_file(api):
    assert "'purpose'" in error(upload(api, jsonl(line("a")), purpose=None), 400, "missing_required_parameter")
    assert "batch" in error(upload(api, jsonl(line("a")), purpose="fine-tune"), 400, "invalid_value")
    missing = api.post("/v1/files", data={"purpose": "batch"}, content_type="multipart/form-data")
    assert "'file'" in error(missing, 400, "missing_required_parameter")


def test_a_file_over_the_size_cap_is_refused_and_one_just_under_is_taken(api):
    big = line("a", model="tiny", messages=[{"role": "user", "content": "x" * (1024 * 1024)}])
    assert "1 MiB" in error(upload(api, jsonl(big)), 413, "file_too_large")
    under = line("a", model="tiny", messages=[{"role": "user", "content": "x" * (1024 * 1024 - 200)}])
    assert upload(api, jsonl(under)).status_code == 200


def test_unknown_ids_are_404s(api):
    error(api.get("/v1/files/file-nope"), 404, "file_not_found")
    error(api.get("/v1/files/file-nope/content"), 404, "file_not_found")
    error(api.delete("/v1/files/file-nope"), 404, "file_not_found")
    error(api.get("/v1/batches/batch_nope"), 404, "batch_not_found")
    error(api.post("/v1/batches/batch_nope/cancel"), 404, "batch_not_found")


def test_files_in_a_directory_stay_out_of_redis(fake_redis, tmp_path):
    store = FileStore(fake_redis, str(tmp_path))
    made = store.create(b"{}\n", "x.jsonl", "batch")
    assert (tmp_path / f"{made['id']}.jsonl").read_bytes() == b"{}\n"
    assert not fake_redis.exists(keys.file_content(made["id"]))
    assert store.content(made["id"]) == b"{}\n"


# Batches

def create_batch(api, content: bytes, endpoint="/v1/chat/completions", **fields):
    file = upload(api, content).get_json()
    return api.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                         "completion_window": "24h", **fields})


def test_a_batch_is_created_validating_and_queued_for_rq(api, fake_redis):
    created = create_batch(api, jsonl(line("a"), line("b")), metadata={"quest": "lore"})
    assert created.status_code == 200, created.get_data(as_text=True)
    batch = created.get_json()
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600 and batch["metadata"] == {"quest": "lore"}
    assert batch["output_file_id"] is None and batch["completed_at"] is None
    queued = Queue(keys.BATCH_QUEUE, connection=fake_redis).jobs
    assert [(j.id, j.func_name, j.args) for j in queued] == [(batch["id"], "batch.job.run_batch", (batch["id"],))]
    assert api.get(f"/v1/batches/{batch['id']}").get_json() == batch


@pytest.mark.parametrize("fields, param", [
    ({"input_file_id": None}, "input_file_id"),
    ({"input_file_id": "file-nope"}, "input_file_id"),
    ({"input_file_id": "file-\ud800"}, "input_file_id"),
    ({"endpoint": "/v1/embeddings"}, "endpoint"),
    ({"endpoint": "/v1/completions"}, "endpoint"),  # the file's lines are chat requests
    ({"completion_window": "1h"}, "completion_window"),
    ({"metadata": {"a": 1}}, "metadata"),
])
def test_a_bad_batch_is_a_400_naming_the_field(api, fields, param):
    file = upload(api, jsonl(line("a"))).get_json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
    response = api.post("/v1/batches", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == param


@pytest.fixture
def redis_api(fake_redis):
    """Files in Redis, where the runner below looks for them."""
    return create_app(Settings(), client=fake_redis).test_client()


def test_cancel_before_the_job_starts_cancels_at_once_and_the_job_then_does_nothing(redis_api, fake_redis):
    api = redis_api
    batch = create_batch(api, jsonl(line("a"))).get_json()
    cancelled = api.post(f"/v1/batches/{batch['id']}/cancel").get_json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] is not None
    assert api.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200  # twice: no mistake
    sent = []
    assert runner(fake_redis, batch["id"], lambda url, body: sent.append(body)).run() == "cancelled"
    assert sent == []


def test_a_finished_batch_cannot_be_cancelled(redis_api, fake_redis):
    api = redis_api
    batch = create_batch(api, jsonl(line("a"))).get_json()
    runner(fake_redis, batch["id"], answering()).run()
    assert "completed" in error(api.post(f"/v1/batches/{batch['id']}/cancel"), 409, "batch_not_cancellable")


# The batch job's runner, with a stand-in for the API

def answering(delays=None, fail=None):
    """A stand-in API: answers each request after a delay; `fail` maps a custom_id to a status."""
    def send(url, body):
        who = body["messages"][0]["content"].removeprefix("Tell of ")
        time.sleep((delays or {}).get(who, 0))
        if fail and who in fail:
            return Reply(fail[who], {"error": {"message": "no", "type": "x", "param": None, "code": None}})
        return Reply(200, {"id": f"chatcmpl-{who}", "choices": [{"message": {"content": who.upper()}}]},
                     request_id=f"chatcmpl-{who}")
    return send


def runner(client, batch_id, send, concurrency=4, **kwargs) -> BatchRun:
    return BatchRun(batch_id, BatchStore(client), FileStore(client), send, concurrency=concurrency, **kwargs)


def new_batch(client, lines) -> str:
    file = FileStore(client).create(jsonl(*lines), "in.jsonl", "batch")
    return BatchStore(client).create(file["id"], "/v1/chat/completions", "24h", len(lines), None)


def read_file(client, file_id) -> list[dict]:
    return [json.loads(x) for x in FileStore(client).content(file_id).decode().splitlines()]


def test_answers_come_out_in_input_order_with_bounded_concurrency_at_the_lowest_priority(fake_redis):
    ids = [f"r{i}" for i in range(30)]
    batch_id = new_batch(fake_redis, [line(i) for i in ids])
    in_flight, most, priorities, lock = [0], [0], set(), threading.Lock()
    stand_in = answering({i: 0.001 * (29 - n) for n, i in enumerate(ids)}, fail={"r7": 400})

    def send(url, body):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            priorities.add(body["priority"])
        try:
            return stand_in(url, body)
        finally:
            with lock:
                in_flight[0] -= 1

    assert runner(fake_redis, batch_id, send, concurrency=3).run() == "completed"
    batch = BatchStore(fake_redis).get(batch_id)
    assert batch["request_counts"] == {"total": 30, "completed": 29, "failed": 1}
    assert batch["in_progress_at"] and batch["finalizing_at"] and batch["completed_at"]
    answers = read_file(fake_redis, batch["output_file_id"])
    assert [a["custom_id"] for a in answers] == [i for i in ids if i != "r7"]
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"] == "R0"
    assert answers[0]["response"]["status_code"] == 200 and answers[0]["error"] is None
    (failed,) = read_file(fake_redis, batch["error_file_id"])
    assert failed["custom_id"] == "r7" and failed["response"]["status_code"] == 400
    assert most[0] == 3 and priorities == {PRIORITY_MAX}
    assert not fake_redis.exists(keys.batch_results(batch_id))


def test_429_and_503_are_tried_again_after_their_retry_after(fake_redis):
    batch_id = new_batch(fake_redis, [line("a"), line("b")])
    replies = {"a": [Reply(429, {}, retry_after=2), Reply(503, {}, retry_after=3)], "b": [Reply(0, {})]}
    slept = []

    def send(url, body):
        who = body["messages"][0]["content"][-1]
        return replies[who].pop(0) if replies[who] else answering()(url, body)

    clock = [1000.0]

    def sleep(seconds):  # a fake clock: the backoff is counted, not waited
        slept.append(seconds)
        clock[0] += seconds

    run = runner(fake_redis, batch_id, send, concurrency=1, sleep=sleep, clock=lambda: clock[0])
    BatchStore(fake_redis).redis.hset(keys.batch(batch_id), "expires_at", 10_000)
    assert run.run() == "completed"
    assert BatchStore(fake_redis).get(batch_id)["request_counts"]["completed"] == 2
    # a: its Retry-Afters (2 s, 3 s) in 1 s slices, looking for a cancel between them; b: a backoff.
    assert slept[:5] == [1, 1, 1, 1, 1] and len(slept) == 6 and 0.2 <= slept[5] <= 0.5


def test_cancel_while_running_stops_sending_and_keeps_what_was_answered(fake_redis):
    batch_id = new_batch(fake_redis, [line(f"r{i}") for i in range(20)])
    store, sent = BatchStore(fake_redis), []

    def send(url, body):
        sent.append(body)
        if len(sent) == 5:
            assert store.cancel(batch_id) == (True, "in_progress")
        return answering()(url, body)

    assert runner(fake_redis, batch_id, send, concurrency=1).run() == "cancelled"
    batch = store.get(batch_id)
    assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch["cancelled_at"]
    assert batch["request_counts"]["completed"] == len(sent) == 5
    assert [a["custom_id"] for a in read_file(fake_redis, batch["output_file_id"])] == [f"r{i}" for i in range(5)]
    unsent = read_file(fake_redis, batch["error_file_id"])
    assert [e["custom_id"] for e in unsent] == [f"r{i}" for i in range(5, 20)]
    assert {e["error"]["code"] for e in unsent} == {"batch_cancelled"}


def test_a_rerun_after_a_crash_sends_only_what_had_no_answer(fake_redis):
    batch_id = new_batch(fake_redis, [line(f"r{i}") for i in range(6)])
    crashing = {"count": 0}

    def send(url, body):
        crashing["count"] += 1
        if crashing["count"] == 4:
            raise ConnectionError("Redis went away")
        return answering()(url, body)

    with pytest.raises(ConnectionError):  # the job fails; RQ runs it again (Retry)
        runner(fake_redis, batch_id, send, concurrency=1).run()
    assert BatchStore(fake_redis).get(batch_id)["status"] == "in_progress"
    again = []
    assert runner(fake_redis, batch_id, lambda u, b: again.append(b) or answering()(u, b)).run() == "completed"
    assert len(again) == 3
    batch = BatchStore(fake_redis).get(batch_id)
    assert batch["request_counts"]["completed"] == 6
    assert [a["custom_id"] for a in read_file(fake_redis, batch["output_file_id"])] == [f"r{i}" for i in range(6)]


def test_a_batch_past_its_window_expires_and_one_whose_file_vanished_fails(fake_redis):
    expiring = new_batch(fake_redis, [line("a")])
    fake_redis.hset(keys.batch(expiring), "expires_at", int(time.time()) - 1)
    assert runner(fake_redis, expiring, answering()).run() == "expired"
    (unsent,) = read_file(fake_redis, BatchStore(fake_redis).get(expiring)["error_file_id"])
    assert unsent["error"]["code"] == "batch_expired"
    vanished = new_batch(fake_redis, [line("a")])
    FileStore(fake_redis).delete(BatchStore(fake_redis).get(vanished)["input_file_id"])
    assert runner(fake_redis, vanished, answering()).run() == "failed"
    assert "no longer exists" in BatchStore(fake_redis).get(vanished)["errors"]["data"][0]["message"]


def test_the_output_file_has_one_line_per_answer_whatever_the_text_holds(fake_redis):
    # A model's text may hold U+2028, U+0085 or a form feed: str.splitlines (and other JSONL
    # readers) break lines there, so they must not appear raw in the file.
    batch_id = new_batch(fake_redis, [line("a"), line("b")])
    odd = "lore\u2028of\x85the\x0cdeep"

    def send(url, body):
        return Reply(200, {"id": "x", "choices": [{"message": {"content": odd}}]}, request_id="x")

    assert runner(fake_redis, batch_id, send).run() == "completed"
    answers = read_file(fake_redis, BatchStore(fake_redis).get(batch_id)["output_file_id"])
    assert [a["custom_id"] for a in answers] == ["a", "b"]
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"] == odd
