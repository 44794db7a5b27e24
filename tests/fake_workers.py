"""Workers that are only their Redis keys, for the API's tests on fakeredis.

An API test needs a worker to exist (its heartbeat names the model, its context window and the
tokenizer the API counts with) and sometimes one to answer (take the job, store and publish its
final answer), but not a model. These stand in for both, so that a test of admission, limits,
errors or metrics runs in milliseconds; `tests/processes.py` starts real workers where the test
is about them.
"""
from __future__ import annotations

import threading
import time

from shared import keys
from shared.protocol import Failure, Final, Job, TextDelta, WorkerInfo, encode_result
from tests.tiny_models import tiny_tokenizer
from worker import model_loader
from worker.job_queue import JobQueue

MODEL = "tiny"
CONTEXT = 64


def register_worker(client, model=MODEL, worker_id="w1", draining=False, tokenizer=None,
                    context_window=CONTEXT, engine="static", features=None) -> JobQueue:
    """A worker that is only its Redis keys: its tokenizer (the tiny one unless given) and a heartbeat."""
    files = model_loader.tokenizer_files(tokenizer if tokenizer is not None else tiny_tokenizer())
    queue = JobQueue(client, worker_id, model)
    queue.store_tokenizer(files)
    info = WorkerInfo(id=worker_id, model=model, context_window=context_window, engine=engine, batch=4,
                      device="cpu", dtype="float32", tokenizer_digest=model_loader.digest(files),
                      pid=1, host="test", started=time.time(), draining=draining,
                      **({"features": list(features)} if features is not None else {}))
    queue.heartbeat(info, ttl_s=60)
    return queue


def openai_error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def completion_body(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


seen_jobs: list[Job] = []


# How long a stand-in worker waits for its job: the API queues it in milliseconds, but a loaded
# 2-core machine can take seconds; a stand-in that gave up sooner would fail a test for nothing.
TAKE_TIMEOUT_S = 30


def _take(client, model: str) -> bytes:
    """The next job queued for `model`, as JSON, as a stand-in worker takes it (polling: fakeredis)."""
    give_up = time.monotonic() + TAKE_TIMEOUT_S
    while time.monotonic() < give_up:
        if raw := client.lpop(keys.queue(model)):
            return raw
        time.sleep(0.01)
    raise AssertionError(f"no job for {model} was queued within {TAKE_TIMEOUT_S} s")


def next_job(client, model: str) -> Job:
    return Job.from_json(_take(client, model))


def _stream(client, model: str, job: Job, pieces: list[str]) -> None:
    """Publish `pieces` as the job's text deltas, then its final answer (also stored)."""
    channel, offset = keys.channel(model, job.id), 0
    for piece in pieces[:-1]:
        client.publish(channel, encode_result(TextDelta(piece, offset, 1)))
        offset += len(piece)
    final = encode_result(Final(text="".join(pieces), finish_reason="stop", prompt_tokens=len(job.prompt_ids),
                                completion_tokens=len(pieces)))
    client.set(keys.answer(model, job.id), final)
    client.publish(channel, final)


def answer_in_background(client, queue: JobQueue, publish: bool = True) -> None:
    """A stand-in worker: takes one job and answers it (optionally only by the stored copy)."""
    seen_jobs.clear()

    def answer():
        job = next_job(client, MODEL)
        seen_jobs.append(job)
        final = encode_result(Final(text=" and then", finish_reason="length",
                                    prompt_tokens=len(job.prompt_ids), completion_tokens=2))
        client.set(keys.answer(job.model, job.id), final)
        if publish:
            client.publish(keys.channel(job.model, job.id), final)

    threading.Thread(target=answer, daemon=True).start()


def reply_in_pieces(client, pieces: list[str], seen: list, model: str = MODEL) -> None:
    """A stand-in worker, in the background: takes one job of `model`, keeps (job, its JSON, the
    grammar it names as stored in Redis, or None) in `seen`, and streams the reply in `pieces`."""
    def work():
        raw = _take(client, model)
        job = Job.from_json(raw)
        seen.append((job, raw, client.get(keys.grammar(model, job.params.grammar)) if job.params.grammar else None))
        _stream(client, model, job, pieces)
    threading.Thread(target=work, daemon=True).start()


def reply_within_grammar(client, pieces: list[str], seen: list, llguidance_tokenizer, model: str = MODEL) -> None:
    """reply_in_pieces' worker bound, as a real one is, by the grammar its job names: before it
    writes, it matches the whole reply (its tokens, then the end of text) against the grammar
    stored in Redis (llguidance's matcher on `llguidance_tokenizer`, api.tokenizers.Tokenizer's
    .llguidance()). A reply the grammar allows is streamed; one it rejects is not written: the job
    gets a Failure (code "grammar_rejected"), so the request fails. Keeps (job, its JSON, the
    grammar, whether it allowed the reply; None without a grammar) in `seen`."""
    import llguidance

    def work():
        raw = _take(client, model)
        job = Job.from_json(raw)
        grammar = client.get(keys.grammar(model, job.params.grammar)) if job.params.grammar else None
        allowed = None
        if job.params.grammar:
            assert grammar is not None, f"the job's grammar {job.params.grammar} is not in Redis"
            matcher = llguidance.LLMatcher(llguidance_tokenizer, grammar.decode(), log_level=0)
            allowed = bool(matcher.consume_tokens(llguidance_tokenizer.tokenize_str("".join(pieces)))
                           and matcher.consume_token(llguidance_tokenizer.eos_token))
        seen.append((job, raw, grammar, allowed))
        if allowed is False:
            failure = encode_result(Failure(f"the reply {''.join(pieces)!r} breaks the job's grammar",
                                            code="grammar_rejected"))
            client.set(keys.answer(model, job.id), failure)
            client.publish(keys.channel(model, job.id), failure)
            return
        _stream(client, model, job, pieces)
    threading.Thread(target=work, daemon=True).start()
