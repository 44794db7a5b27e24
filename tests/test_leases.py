"""Job leases: a worker cut off from Redis past its heartbeat's life, whose jobs went to another
worker, publishes nothing for them once its link is back. On fakeredis and a real redis-server.
"""
from __future__ import annotations

from shared import keys
from shared.protocol import Final, Job, TextDelta, WorkerInfo, decode_result
from tests.queue_jobs import MODEL, die_holding, job_ids_of, messages_heard, push_jobs, subscribe_to
from tests.tiny_models import tiny_tokenizer
from worker.job_queue import LOST, JobQueue
from worker.sequence import Sequence


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(id=worker_id, model=MODEL, context_window=128, engine="continuous", batch=4,
                      device="cpu", dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)


def _write(queue: JobQueue, *tokens: int) -> list[Sequence]:
    """Take the queued jobs, and write tokens[i] tokens of the i-th (2 finish it: max_tokens=2)."""
    tokenizer = tiny_tokenizer()
    taken = queue.take(limit=len(tokens), wait_s=0, block_s=1)
    assert len(taken) == len(tokens)
    seqs = [Sequence(job, tokenizer, frozenset({tokenizer.eos_token_id})) for job in taken]
    for seq, n in zip(seqs, tokens):
        for token in tokenizer(" brave knight").input_ids[:n]:
            seq.append(token)
    return seqs


def _in_processing(any_redis, worker_id: str) -> list[str]:
    return [Job.from_json(r).id for r in any_redis.lrange(keys.processing(MODEL, worker_id), 0, -1)]


def test_a_worker_declared_dead_publishes_nothing_for_jobs_another_worker_holds(any_redis):
    first = JobQueue(any_redis, "first", MODEL)
    assert first.heartbeat(_info("first"), ttl_s=5) is False
    push_jobs(any_redis, 0, 1, stream=True)
    writing, finished = _write(first, 1, 2)  # job-0 half written, job-1 done: both have text to send
    assert finished.finished and writing.delta() is not None

    die_holding(first, any_redis)  # cut off from Redis: its heartbeat expires
    second = JobQueue(any_redis, "second", MODEL)
    assert second.requeue_dead_workers() == 2
    assert not any_redis.exists(keys.lease(MODEL, "job-0")) and not any_redis.exists(keys.lease(MODEL, "job-1"))
    pubsub = subscribe_to(any_redis, "job-0", "job-1")
    again = _write(second, 2, 2)
    assert any_redis.get(keys.lease(MODEL, "job-0")) == b"second"

    # The link is back: the first worker's step publishes nothing, removes nothing, says what it lost.
    published = first.publish([writing, finished])
    assert published.finished == [] and published.lost == [writing, finished]
    assert writing.finish_reason == finished.finish_reason == LOST  # the engine drops them
    assert messages_heard(pubsub) == []
    assert not any_redis.exists(keys.answer(MODEL, "job-0")) and not any_redis.exists(keys.answer(MODEL, "job-1"))
    assert _in_processing(any_redis, "second") == ["job-0", "job-1"]
    # Found lost once: never sent again, not even looked up.
    assert first.publish([writing, finished]) == ([], [])
    assert first.fail(["job-0"], "the engine broke") == {"job-0"}
    assert messages_heard(pubsub) == []
    # Its next heartbeat tells it that it was struck off (its registration was gone).
    assert first.heartbeat(_info("first"), ttl_s=5) is True
    assert first.heartbeat(_info("first"), ttl_s=5) is False

    # The second worker's answers go out as usual, once each.
    assert second.publish(again).finished == again
    heard = messages_heard(pubsub)
    assert [(job, m.type) for job, m in heard] == [("job-0", "text"), ("job-0", "final"),
                                                   ("job-1", "text"), ("job-1", "final")]
    assert all(isinstance(decode_result(any_redis.get(keys.answer(MODEL, j))), Final) for j in ("job-0", "job-1"))
    assert _in_processing(any_redis, "second") == []
    assert not any_redis.exists(keys.lease(MODEL, "job-0"))


def test_a_worker_back_before_anyone_put_its_jobs_back_keeps_them(any_redis):
    first = JobQueue(any_redis, "first", MODEL)
    first.heartbeat(_info("first"), ttl_s=5)
    push_jobs(any_redis, 0, stream=True)
    [seq] = _write(first, 2)
    die_holding(first, any_redis)
    # Its heartbeat comes back before any live worker looked: it was never struck off.
    assert first.heartbeat(_info("first"), ttl_s=5) is False
    assert JobQueue(any_redis, "second", MODEL).requeue_dead_workers() == 0
    assert any_redis.hexists(keys.WORKERS, "first")
    pubsub = subscribe_to(any_redis, "job-0")
    assert first.publish([seq], check=True) == ([seq], [])
    assert [m.type for _, m in messages_heard(pubsub)] == ["text", "final"]
    assert _in_processing(any_redis, "first") == []


def test_a_check_finds_lost_jobs_that_have_nothing_to_send(any_redis):
    first = JobQueue(any_redis, "first", MODEL)
    first.heartbeat(_info("first"), ttl_s=5)
    push_jobs(any_redis, 0, 1)  # not streamed: nothing is sent before the end
    quiet, other = _write(first, 1, 1)
    die_holding(first, any_redis)
    second = JobQueue(any_redis, "second", MODEL)
    assert second.requeue_dead_workers() == 2
    assert job_ids_of(second.take(limit=1, wait_s=0, block_s=1)) == ["job-0"]  # job-1 waits in the queue
    assert first.publish([quiet, other]) == ([], [])  # nothing to send: not looked at
    assert first.publish([quiet, other], check=True) == ([], [quiet, other])
    assert quiet.finish_reason == other.finish_reason == LOST


def test_a_step_costs_one_round_trip_and_a_quiet_step_none(any_redis):
    queue = JobQueue(any_redis, "w1", MODEL)
    push_jobs(any_redis, *range(4), stream=True)
    push_jobs(any_redis, 4, 5)  # not streamed
    seqs = _write(queue, 1, 1, 1, 2, 1, 2)
    queue.publish([seqs[4]], check=True)  # loads the script: a first call costs a SCRIPT LOAD too
    calls = []
    execute = any_redis.execute_command

    def counted(*args, **kwargs):
        calls.append(args[0])
        return execute(*args, **kwargs)

    any_redis.execute_command = counted
    pubsub = subscribe_to(any_redis, *[s.id for s in seqs])
    calls.clear()
    published = queue.publish(seqs)
    assert calls == ["EVALSHA"]
    assert published.finished == [seqs[3], seqs[5]] and published.lost == []
    heard = messages_heard(pubsub)
    assert sorted((job, m.type) for job, m in heard) == sorted(
        [(f"job-{i}", "text") for i in range(4)] + [("job-3", "final"), ("job-5", "final")])
    assert all(m.offset == 0 for _, m in heard if isinstance(m, TextDelta))
    calls.clear()
    assert queue.publish([seqs[4]]) == ([], [])  # a step of a job that does not stream
    assert calls == []
    assert _in_processing(any_redis, "w1") == ["job-0", "job-1", "job-2", "job-4"]
    assert {k.decode() for k in any_redis.mget([keys.lease(MODEL, s.id) for s in seqs]) if k} == {"w1"}
