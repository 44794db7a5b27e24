"""Integration tests: a real redis-server, real `python -m worker` and `python -m api` processes, and
OpenAI's own Python client, so the whole path (HTTP -> gunicorn/Flask -> Redis -> worker -> Redis ->
HTTP) is exercised the way a game would use it.

One worker and one API serve these tests (module scope: the model loads once): plain and streamed
answers, stop strings, several choices, load, errors, a client that leaves, and jobs the worker
cannot run or that a dead worker left behind. Tests that stop or kill things (Redis down, SIGTERM, a
killed worker, a Redis restart) are in tests/test_integration_faults.py, with processes of their own.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from shared import keys
from shared.protocol import Final, Job, SamplingParams, decode_result
from tests.live_stack import client, finish_reasons, stack, stream_text  # noqa: F401 (client, stack: fixtures)
from tests.processes import MODEL, get_json, logs, wait_until

pytestmark = pytest.mark.timeout(120)

CONTEXT = 128         # the tiny models' context window
GREEDY_LONG = dict(temperature=0, max_tokens=20, extra_body={"ignore_eos": True})


def clean_piece(text: str, size: int = 3) -> str:
    """A few characters from the middle of `text`, free of U+FFFD (the junk bytes a random model
    writes), whose first occurrence is not at the very start (so the expected prefix is not empty)."""
    for start_at in range(len(text) // 3, len(text) - size):
        piece = text[start_at:start_at + size]
        if "\ufffd" not in piece and text.find(piece) > 0:
            return piece
    pytest.fail(f"no clean {size}-character piece in {text!r}")


# Plain answers

def test_health_and_models(stack, client):
    status, body = get_json(f"http://127.0.0.1:{stack.port}/health")
    assert status == 200 and body["status"] == "ok"
    assert body["workers"] >= 1 and MODEL in body["models"]
    listed = {m.id: m for m in client.models.list()}
    assert MODEL in listed
    assert listed[MODEL].model_extra["context_window"] == CONTEXT
    # The worker's numerics fingerprint: its products' kernel, the dtype, the kernels' build.
    [numerics] = listed[MODEL].model_extra["numerics"]
    assert "/float32/kernels-" in numerics, numerics


def test_completion_has_openai_shape(client):
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    assert done.id.startswith("cmpl-") and done.object == "text_completion" and done.model == MODEL
    assert len(done.choices) == 1 and done.choices[0].index == 0
    choice = done.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert 0 <= done.usage.completion_tokens <= 10

    # With end-of-text ignored the length is exact: the reason is "length", the count is max_tokens.
    long = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY_LONG)
    assert long.choices[0].finish_reason == "length"
    assert long.usage.completion_tokens == 20
    assert long.choices[0].text


def test_chat_completion_has_openai_shape(client):
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You tell stories."},
                               {"role": "user", "content": "A dragon?"}], max_tokens=12)
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    message = done.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert done.choices[0].finish_reason in ("stop", "length")
    # The chat template's special tokens are counted too: more than the 2 words.
    assert done.usage.prompt_tokens > 5 and done.usage.completion_tokens <= 12


# Streaming

@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_stream_equals_whole_answer(client, chat):
    # Greedy and the same prompt: the stream must carry exactly the text of the whole answer.
    if chat:
        create = lambda **kw: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me of the wizard"}], **GREEDY_LONG, **kw)
        whole = create().choices[0].message.content
    else:
        create = lambda **kw: client.completions.create(
            model=MODEL, prompt="Tell me of the wizard", **GREEDY_LONG, **kw)
        whole = create().choices[0].text
    text, chunks = stream_text(create(stream=True), chat)
    assert text == whole
    assert len(chunks) > 2, "the text should come in several chunks, not all at the end"
    assert finish_reasons(chunks) == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    if chat:
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"


def test_stream_include_usage(client):
    stream = client.completions.create(model=MODEL, prompt="The dragon", stream=True,
                                       stream_options={"include_usage": True}, **GREEDY_LONG)
    chunks = list(stream)
    last = chunks[-1]
    # OpenAI's shape: a last chunk with no choices and the usage of the whole request.
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 20 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 20
    assert finish_reasons(chunks) == ["length"]


# Stop strings

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_the_text(client, stream):
    prompt = "The wizard opened the book"
    full = client.completions.create(model=MODEL, prompt=prompt, **GREEDY_LONG).choices[0].text
    stop_at = clean_piece(full)
    expected = full[:full.find(stop_at)]
    if stream:
        text, chunks = stream_text(client.completions.create(model=MODEL, prompt=prompt, stop=stop_at,
                                                             stream=True, **GREEDY_LONG), chat=False)
        reasons = finish_reasons(chunks)
    else:
        choice = client.completions.create(model=MODEL, prompt=prompt, stop=[stop_at], **GREEDY_LONG).choices[0]
        text, reasons = choice.text, [choice.finish_reason]
    # Greedy writes the same tokens again, so the answer is the text before the stop string,
    # which itself must never be sent (not even the start of it, in a stream).
    assert text == expected, f"stop={stop_at!r} full={full!r}"
    assert stop_at not in text
    assert reasons == ["stop"]


# Several choices, seeds

def test_n_choices_with_seed(client):
    done = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, seed=7,
                                     max_tokens=8, temperature=1.0)
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in done.choices)
    assert done.usage.completion_tokens <= 3 * 8


def test_prompt_list_times_n(client):
    prompts = ["The dragon slept", "Hello world! Numbers"]
    done = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY_LONG)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    # Choices come prompt by prompt: 0 and 1 from the first prompt, 2 and 3 from the second.
    # Greedy makes that checkable: each pair equals its prompt's answer alone.
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY_LONG).choices[0].text for p in prompts]
    assert [c.text for c in done.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert done.usage.completion_tokens == 4 * 20


def test_seed_makes_sampling_repeatable(client):
    def write(seed):
        return client.completions.create(model=MODEL, prompt="The castle gate", seed=seed, temperature=1.0,
                                         max_tokens=30, extra_body={"ignore_eos": True}).choices[0].text
    first = write(1234)
    assert write(1234) == first
    # 30 tokens sampled at temperature 1 from ~400: two seeds agreeing everywhere would be a bug.
    assert write(4321) != first


# Load

def test_32_concurrent_clients(client):
    barrier = threading.Barrier(32)

    def one(i):
        barrier.wait(10)  # all at once, so they queue up together
        return client.completions.create(model=MODEL, prompt=f"Player {i} walks to the gate", max_tokens=8)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, range(32)))
    assert len({a.id for a in answers}) == 32
    for a in answers:
        assert a.choices[0].finish_reason in ("stop", "length")
        assert a.usage.completion_tokens <= 8


def test_more_waiting_players_than_redis_py_pools_by_default(stack):
    # 150 requests waiting at once: each holds a Redis pub/sub connection in the API, more than
    # redis-py's default pool of 100 allows (the API sizes its pool by its thread count).
    crowd = 150
    barrier = threading.Barrier(crowd)

    def one(i):
        body = json.dumps({"model": MODEL, "prompt": f"Player {i}", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{stack.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        barrier.wait(20)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return f"{exc.code}: {exc.read()[:200]!r}"

    with ThreadPoolExecutor(crowd) as pool:
        statuses = list(pool.map(one, range(crowd)))
    assert [s for s in statuses if s != 200] == []


def test_greedy_batched_equals_alone(client):
    # Prompts of different lengths: batched they are left-padded, which must not change a greedy answer.
    prompts = ["Once", "The dragon slept in the forest", "A brave knight", "Write a short story about a gate",
               "Hello", "The wizard read the spell aloud to the crowd of players", "Gold", "Potions and skeletons"]
    write = lambda p: client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=16,
                                                extra_body={"ignore_eos": True}).choices[0].text
    alone = [write(p) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def together(p):
        barrier.wait(10)
        return write(p)

    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(together, prompts))
    assert batched == alone


# Errors through the whole stack

def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert MODEL in caught.value.message  # it says which models are served


def test_prompt_longer_than_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="The dragon slept in the forest. " * 40, max_tokens=2)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "prompt"


# A client that goes away

def test_client_gone_mid_stream_cancels_its_job(stack, client):
    body = dict(model=MODEL, prompt="Once", temperature=0, max_tokens=120, ignore_eos=True)
    # How long the whole answer takes here, to know how long to watch for it below.
    began = time.monotonic()
    client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                              extra_body={"ignore_eos": True})
    whole_s = time.monotonic() - began

    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = resp.fp.readline()
    while not line.startswith(b"data: "):
        line = resp.fp.readline()
    job_id = json.loads(line[len(b"data: "):])["id"].removeprefix("cmpl-") + "-0"  # the API's job ids
    resp.close(), conn.close()  # the player closes the game mid-sentence

    # The API notices on its next write and sets the job's cancel flag...
    wait_until(lambda: stack.redis.exists(keys.cancel(MODEL, job_id)), [stack.api, stack.worker],
               "the cancel flag", timeout=30)  # returns once set: 30 s only bounds a loaded machine
    # ...the worker drops the job from its processing list...
    (worker_id,) = stack.worker_ids()
    wait_until(lambda: stack.redis.llen(keys.processing(MODEL, worker_id)) == 0, [stack.worker],
               "the processing list to empty", timeout=30)
    # ...and never finishes it: a job written to the end stores its answer, a cancelled one does not.
    time.sleep(max(1.0, 2 * whole_s))
    assert not stack.redis.exists(keys.answer(MODEL, job_id)), "the job was written to the end after the client left"


# A job the model cannot run, written by hand into the queue

def test_a_job_the_model_cannot_run_fails_alone(stack, client):
    r = stack.redis
    bad = Job(id=f"bad-{uuid.uuid4().hex}", model=MODEL, prompt_ids=[10**6],
              params=SamplingParams(max_tokens=4), timeout_s=60)
    pubsub = r.pubsub()
    pubsub.subscribe(keys.channel(MODEL, bad.id))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    try:
        r.rpush(keys.queue(MODEL), bad.to_json())
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=10)
    finally:
        pubsub.close()
    failure = decode_result(message["data"])
    assert failure.type == "error" and "token ids" in failure.message
    # The worker is still there, and serves the next request as usual.
    answer = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    assert stack.worker.poll() is None


# Recovery of a dead worker's jobs

def test_dead_workers_job_is_requeued_and_answered(stack, client, tiny_model_dirs):
    r = stack.redis
    prompt = "Once upon a time"
    ids = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])(prompt).input_ids
    job = Job(id=f"requeue-{uuid.uuid4().hex[:8]}", model=MODEL, prompt_ids=ids,
              params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), timeout_s=60)
    pubsub = r.pubsub()
    pubsub.subscribe(keys.channel(MODEL, job.id))  # first: pub/sub drops what nobody listens for
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    try:
        # A worker that died holding the job: the job in its processing list, its name registered,
        # no heartbeat. All in one transaction, so the live worker never sees one without the other.
        pipe = r.pipeline(transaction=True)
        pipe.rpush(keys.processing(MODEL, "dead-1"), job.to_json())
        pipe.hset(keys.model_workers(MODEL), "dead-1", 1)
        pipe.hset(keys.WORKERS, "dead-1", MODEL)
        pipe.execute()

        final, give_up = None, time.monotonic() + 15  # the live worker looks every heartbeat (1 s)
        while final is None and time.monotonic() < give_up:
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                result = decode_result(message["data"])
                final = result if result.type != "text" else None
        assert isinstance(final, Final), f"no answer for the requeued job\n{logs(stack.worker)}"
    finally:
        pubsub.close()
    assert final.finish_reason == "length" and final.completion_tokens == 6
    assert final.prompt_tokens == len(ids)
    # The same greedy request through the API writes the same text.
    assert final.text == client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6,
                                                   extra_body={"ignore_eos": True}).choices[0].text
    assert r.llen(keys.processing(MODEL, "dead-1")) == 0
    assert not r.hexists(keys.WORKERS, "dead-1")
    assert not r.hexists(keys.model_workers(MODEL), "dead-1")
