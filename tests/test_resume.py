"""A requeued job resumes from the tokens already written, it is not written again: the record of
them (keys.written) as the job queue keeps it, on fakeredis and a real redis-server; a sequence
rebuilt from it; and, on a tiny model in both engines, a job stopped after k tokens, put back and
finished by a fresh engine, equal token for token to the undisturbed job.
tests/test_resume_processes.py kills a real worker mid-stream.
"""
from __future__ import annotations

import logging

import pytest
import redis
import torch
from prometheus_client import REGISTRY

from api.streaming import unsent
from shared import keys, metrics as names
from shared.protocol import Final, Job, SamplingParams, TextDelta, WorkerInfo, decode_result
from shared.settings import Settings
from tests.engines import make_engine
from tests.queue_jobs import FakeTime, MODEL, die_holding, messages_heard, push_job, push_jobs, subscribe_to
from tests.tiny_models import tiny_tokenizer
from worker import job_queue
from worker.job_queue import JobQueue
from worker.sampling import new_generator
from worker.sequence import Sequence
from worker.static_engine import StaticEngine
from worker.worker import Worker

TOKENIZER = tiny_tokenizer()
EOS = frozenset({TOKENIZER.eos_token_id})
WORDS = TOKENIZER(" brave knight walked to the café gate").input_ids


def _record(any_redis, job_id: str):
    return any_redis.get(keys.written(MODEL, job_id))


def _as_record(tokens: list[int]) -> bytes:
    return "".join(f"{t}," for t in tokens).encode()


def _taken(queue: JobQueue, count: int) -> list[Sequence]:
    jobs = queue.take(limit=count, wait_s=0, block_s=1)
    assert len(jobs) == count
    return [Sequence(job, TOKENIZER, EOS, queue.written.pop(job.id, None)) for job in jobs]


def _counting(any_redis) -> list:
    """The commands `client` sends from now on (their names); the publish script is loaded first."""
    any_redis.script_load(job_queue._PUBLISH)
    calls, execute = [], any_redis.execute_command

    def counted(*args, **kwargs):
        calls.append(args[0])
        return execute(*args, **kwargs)
    any_redis.execute_command = counted
    return calls


# The record, as the job queue keeps it

def test_a_streams_tokens_are_recorded_with_its_text_also_while_the_text_is_held_back(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    first = TOKENIZER.decode(WORDS[:1])
    # A stop string that starts with the first token's text: that text is held back, not sent.
    push_job(any_redis, Job(id="job-0", model=MODEL, prompt_ids=[5, 6, 7], timeout_s=60, stream=True,
                            params=SamplingParams(max_tokens=10, stop=[first + "zzz"])))
    [seq] = _taken(queue, 1)
    pubsub = subscribe_to(any_redis, "job-0")
    calls = _counting(any_redis)
    seq.append(WORDS[0])
    queue.publish([seq])
    assert calls == ["EVALSHA"] and messages_heard(pubsub) == []  # nothing sent, one call all the same
    assert _record(any_redis, "job-0") == _as_record(WORDS[:1])
    calls.clear()
    seq.append(WORDS[1])
    queue.publish([seq])
    assert calls == ["EVALSHA"]
    assert [m.text for _, m in messages_heard(pubsub)] == [TOKENIZER.decode(WORDS[:2])]
    assert _record(any_redis, "job-0") == _as_record(WORDS[:2])
    assert 0 < any_redis.ttl(keys.written(MODEL, "job-0")) <= job_queue.LEASE_TTL_S


def test_whole_jobs_are_recorded_once_an_interval_all_in_one_call(any_redis, monkeypatch):
    monkeypatch.setattr(job_queue, "RECORD_INTERVAL_S", 0.3)
    clock = FakeTime()  # "not due yet" holds however long a loaded machine takes before a publish
    monkeypatch.setattr(job_queue, "time", clock)
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0, 1, 2)  # not streamed (max_tokens 2)
    seqs = _taken(queue, 3)
    for seq in seqs:
        seq.append(WORDS[0])
    calls = _counting(any_redis)
    assert queue.publish(seqs) == ([], [])
    assert calls == []  # not due: no call at all
    assert not any(_record(any_redis, s.id) for s in seqs)
    clock.now += 0.29
    calls.clear()
    assert queue.publish(seqs) == ([], []) and calls == []  # still not due, just before the interval
    clock.now += 0.02
    calls.clear()
    assert queue.publish(seqs) == ([], [])
    assert calls == ["EVALSHA"]
    assert [_record(any_redis, s.id) for s in seqs] == [_as_record(WORDS[:1])] * 3
    push_jobs(any_redis, 3, stream=True)
    [stream] = _taken(queue, 1)
    stream.append(WORDS[2])
    queue.publish([stream])  # a stream's record goes at once; the whole jobs wait for their time
    assert _record(any_redis, "job-3") == _as_record(WORDS[2:3])


def test_the_answer_deletes_the_record_and_so_does_a_failure(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, 0, 1, stream=True)
    answered, failed = _taken(queue, 2)
    answered.append(WORDS[0]), failed.append(WORDS[0])
    queue.publish([answered, failed])
    assert _record(any_redis, "job-0") and _record(any_redis, "job-1")
    answered.append(WORDS[1])  # max_tokens 2: done
    assert queue.publish([answered]).finished == [answered]
    queue.fail(["job-1"], "the worker failed")
    assert not any_redis.exists(keys.written(MODEL, "job-0"), keys.written(MODEL, "job-1"))


def test_a_requeue_keeps_the_record_and_the_next_take_returns_it(any_redis):
    dead = JobQueue(any_redis, "dead", MODEL)
    push_jobs(any_redis, 0, 1, stream=True)
    seqs = _taken(dead, 2)
    seqs[0].append(WORDS[0])
    dead.publish(seqs)
    die_holding(dead, any_redis)
    alive = JobQueue(any_redis, "alive", MODEL)
    assert alive.requeue_dead_workers() == 2
    assert [j.id for j in alive.take(limit=2, wait_s=0, block_s=1)] == ["job-0", "job-1"]
    assert alive.written == {"job-0": WORDS[:1]}  # job-1 had written nothing


def test_a_job_failed_after_its_retries_loses_its_record(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL, max_attempts=0)
    push_jobs(any_redis, 0, stream=True)
    [seq] = _taken(queue, 1)
    seq.append(WORDS[0])
    queue.publish([seq])
    die_holding(queue, any_redis)
    JobQueue(any_redis, "w2", MODEL, max_attempts=0).requeue_dead_workers()
    assert any_redis.exists(keys.answer(MODEL, "job-0")) and not any_redis.exists(keys.written(MODEL, "job-0"))


def test_a_stranded_job_is_adopted_with_its_record(any_redis):
    push_jobs(any_redis, 0, stream=True)
    any_redis.set(keys.written(MODEL, "job-0"), _as_record(WORDS[:3]))
    JobQueue(any_redis, "w1", MODEL).take(limit=1, wait_s=0, block_s=0)  # a take whose reply was lost
    queue = JobQueue(any_redis, "w1", MODEL)
    assert [j.id for j in queue.adopt_stranded(set(), room=1)] == ["job-0"]
    assert queue.written == {"job-0": WORDS[:3]}


def test_a_job_whose_lease_is_lost_records_nothing(any_redis):
    first = JobQueue(any_redis, "first", MODEL)
    push_jobs(any_redis, 0, stream=True)
    [seq] = _taken(first, 1)
    any_redis.set(keys.lease(MODEL, "job-0"), "second")  # another worker holds it now
    seq.append(WORDS[0])
    assert first.publish([seq]).lost == [seq]
    assert not any_redis.exists(keys.written(MODEL, "job-0"))


def test_a_record_sent_again_after_its_reply_was_lost_is_written_once(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_job(any_redis, Job(id="job-0", model=MODEL, prompt_ids=[5], params=SamplingParams(max_tokens=9),
                            timeout_s=60, stream=True))
    [seq] = _taken(queue, 1)
    script = queue._publish_script

    def reply_lost(*args, **kwargs):  # Redis runs it; the worker never hears back
        script(*args, **kwargs)
        raise redis.ConnectionError("Connection reset by peer")
    lost = {0, 2, 3}  # the steps whose publish loses its reply: the next one sends their part again
    for step, token in enumerate(WORDS[:5]):
        seq.append(token)
        queue._publish_script = reply_lost if step in lost else script
        try:
            queue.publish([seq])
        except redis.ConnectionError:
            assert step in lost
    assert _record(any_redis, "job-0") == _as_record(WORDS[:5])


def test_a_malformed_record_is_ignored_and_replaced(any_redis, caplog):
    push_jobs(any_redis, 0, stream=True)
    any_redis.set(keys.written(MODEL, "job-0"), b"12,x,")
    queue = JobQueue(any_redis, "w1", MODEL)
    with caplog.at_level(logging.WARNING):
        [seq] = _taken(queue, 1)
    assert "malformed record" in caplog.text and seq.output_ids == []
    seq.append(WORDS[0])
    queue.publish([seq])
    assert _record(any_redis, "job-0") == _as_record(WORDS[:1])


# The sequence rebuilt from a record

def _job(stream: bool = True, **params) -> Job:
    return Job(id="j", model="m", prompt_ids=TOKENIZER("Tell me").input_ids, timeout_s=60, stream=stream,
               params=SamplingParams(**{"max_tokens": 100, **params}))


def _state(seq: Sequence) -> dict:
    """Everything a sequence knows of its text (not its clocks, its generator or its record)."""
    return {k: v for k, v in vars(seq).items()
            if k not in ("generator", "first_token_at", "resumed", "recorded", "_sent")}


@pytest.mark.parametrize("stop", [[], ["gate"], ["caf"], [" kn", "é g"]])
def test_a_resumed_sequence_knows_its_text_as_the_first_attempt_did(stop):
    tokens = TOKENIZER(" brave knight walked to the café gate. The end!").input_ids
    for k in range(len(tokens) + 1):
        first = Sequence(_job(stop=stop), TOKENIZER, EOS)
        for token in tokens[:k]:
            if not first.finished:
                first.append(token)
        resumed = Sequence(_job(stop=stop), TOKENIZER, EOS, tokens[:k])
        assert _state(resumed) == _state(first), k
        assert resumed.resumed == len(first.output_ids)
        for token in tokens[k:]:  # and goes on as it would have
            if first.finished:
                break
            first.append(token), resumed.append(token)
            assert _state(resumed) == _state(first), k
        # Its first message carries all the text so far, from the start: the API sends the rest.
        delta = resumed.delta()
        assert delta is None or delta.offset == 0 and first.text.startswith(delta.text)


@pytest.mark.parametrize("temperature, draws", [(0, 0), (0.8, 6)])  # greedy tokens draw nothing
def test_a_resumed_sequence_has_made_the_draws_its_tokens_took(temperature, draws):
    resumed = Sequence(_job(temperature=temperature, seed=5), TOKENIZER, EOS, WORDS[:6])
    undisturbed = new_generator(5)
    for _ in range(draws):
        torch.rand((), generator=undisturbed)
    assert torch.rand((), generator=resumed.generator) == torch.rand((), generator=undisturbed)
    assert resumed.resumed == 6 and resumed.first_token_at == 0


# A job stopped after K tokens, put back and finished by a fresh engine

K, MAX_TOKENS = 7, 20
PARAMS = {"greedy": dict(temperature=0),
          "seeded": dict(temperature=0.8, seed=11),  # the C++ sampler's rows, where it is built
          "seeded, top-k and top-p": dict(temperature=0.9, top_p=0.9, top_k=40, seed=12)}


def _engine(kind: str, loaded):
    return make_engine(loaded) if kind == "continuous" else StaticEngine(loaded, capacity=4)


def _run(engine, seq: Sequence, queue: JobQueue = None, until: int = MAX_TOKENS) -> None:
    while not seq.finished and len(seq.output_ids) < until:
        changed = engine.step()
        if queue:
            queue.publish(changed)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_a_requeued_job_resumes_and_writes_what_it_would_have(fake_redis, monkeypatch, tiny_llama, kind, params,
                                                              stream):
    monkeypatch.setattr(job_queue, "RECORD_INTERVAL_S", 0)  # a whole job's record at every step
    job = Job(id="job-0", model=MODEL, prompt_ids=[21, 45, 33, 190, 7], timeout_s=60, stream=stream,
              params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **PARAMS[params]))
    alone = _engine(kind, tiny_llama)
    undisturbed = alone.add(job)
    _run(alone, undisturbed)
    assert len(undisturbed.output_ids) == MAX_TOKENS

    push_job(fake_redis, job)
    pubsub = subscribe_to(fake_redis, job.id)
    first = JobQueue(fake_redis, "first", MODEL)
    [taken] = first.take(limit=1, wait_s=0, block_s=1)
    engine = _engine(kind, tiny_llama)
    _run(engine, engine.add(taken), first, until=K)
    die_holding(first, fake_redis)
    second = JobQueue(fake_redis, "second", MODEL)
    assert second.requeue_dead_workers() == 1
    [again] = second.take(limit=1, wait_s=0, block_s=1)
    written = second.written.pop(again.id)
    assert len(written) == K
    fresh = _engine(kind, tiny_llama)
    resumed = fresh.add(again, written)
    assert resumed.resumed == K
    _run(fresh, resumed, second)

    assert resumed.output_ids == undisturbed.output_ids
    assert (resumed.text, resumed.finish_reason) == (undisturbed.text, undisturbed.finish_reason)
    assert fresh.generated == MAX_TOKENS - K, "the written tokens were computed as prompt, not decoded"
    # What a client hears, through the API's own rule: the text once, in order, nothing diverged.
    heard, final = "", None
    for _, message in messages_heard(pubsub):
        new = unsent(heard, message.offset if isinstance(message, TextDelta) else 0, message.text)
        assert new is not None, "retry_diverged"
        heard += new
        final = message if isinstance(message, Final) else final
    assert heard == final.text == undisturbed.text
    assert not fake_redis.exists(keys.written(MODEL, job.id))


@pytest.mark.parametrize("written, why", [([5] * (MAX_TOKENS + 1), "over its max_tokens"),
                                          ([5, 10 ** 6], "outside the vocabulary")])
def test_a_record_the_model_cannot_continue_is_ignored(tiny_llama, caplog, written, why):
    job = Job(id="job-0", model=MODEL, prompt_ids=[21, 45], timeout_s=60,
              params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    engine = make_engine(tiny_llama)
    with caplog.at_level(logging.WARNING):
        seq = engine.add(job, written)
    assert "writing it from the start" in caplog.text
    assert seq.resumed == 0 and seq.output_ids == [] and engine.busy


def test_a_record_that_completes_its_job_is_answered_without_a_step(fake_redis, tiny_llama):
    job = Job(id="job-0", model=MODEL, prompt_ids=[21, 45], timeout_s=60, stream=True,
              params=SamplingParams(max_tokens=4, temperature=0))
    push_job(fake_redis, job)
    fake_redis.set(keys.written(MODEL, job.id), _as_record(WORDS[:4]))
    pubsub = subscribe_to(fake_redis, job.id)
    engine = make_engine(tiny_llama)
    info = WorkerInfo(id="w1", model=MODEL, context_window=128, engine="continuous", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    worker = Worker(JobQueue(fake_redis, "w1", MODEL), engine, info, Settings())
    resumed = REGISTRY.get_sample_value(names.RESUMED_TOKENS, {"model": MODEL}) or 0
    worker.queue.sync_clock()
    worker._admit()
    assert not engine.busy and engine.generated == 0
    final = decode_result(fake_redis.get(keys.answer(MODEL, job.id)))
    assert final == Final(text=TOKENIZER.decode(WORDS[:4]), finish_reason="length", prompt_tokens=2,
                          completion_tokens=4)
    assert [m.type for _, m in messages_heard(pubsub)] == ["text", "final"]
    assert not fake_redis.exists(keys.written(MODEL, job.id), keys.processing(MODEL, "w1"))
    assert REGISTRY.get_sample_value(names.RESUMED_TOKENS, {"model": MODEL}) == resumed + 4


def test_the_admission_guess_counts_a_resumed_jobs_written_tokens_as_prompt(tiny_llama):
    """free_slots guesses what a job still in Redis will cost the next step from what those admitted
    lately cost theirs: a resumed job's written tokens are prefilled with its prompt, so they count,
    as the same tokens would in a prompt."""
    def admitted(prompt: list[int], written: list[int]):
        engine = make_engine(tiny_llama)
        engine.add(Job(id="job-0", model=MODEL, prompt_ids=prompt, timeout_s=60,
                       params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)), written)
        engine.step()  # admitted, its prompt and record computed in one chunk
        return engine.free_slots(), engine._start_cost

    resumed, as_prompt = admitted([21, 45, 33], [5] * 9), admitted([21, 45, 33] + [5] * 9, [])
    assert resumed == as_prompt and as_prompt[1] == 12
