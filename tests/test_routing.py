"""A conversation's next turn is offered to the worker that answered its last one (shared/routing.py,
api/routing.py, the take script in worker/job_queue.py): that worker alone may take it until the
offer lapses, then anyone, in its place in line; a dead worker's offer holds nothing back; priority
order holds across offered and shared jobs; an answer leaves the note the next turn is routed by.
On fakeredis and a real redis-server.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace

from api import routing
from api.admission import Admission
from shared import keys
from shared.routing import ROUTE_BLOCK, chain
from tests.queue_jobs import MODEL, announce_worker, job_ids_of, lapse, numbered_job
from worker.job_queue import JobQueue
from worker.sequence import Sequence

HOLD_MS = 30_000  # an offer no loaded machine outlives during a test


def _worker(any_redis, worker_id: str, beating: bool = True) -> JobQueue:
    queue = JobQueue(any_redis, worker_id, MODEL)
    if beating:
        announce_worker(queue, ttl_s=60)
    return queue


def _now_ms(client) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def _push(client, i: int, offer: str = "", until_ms: int = 0, priority: int = 0) -> None:
    job = replace(numbered_job(i, priority=priority), offer=offer, offer_until=until_ms)
    client.rpush(keys.queue(MODEL, priority), job.to_json())


def test_the_chain_names_each_prefix_and_keeps_routing_keys_apart():
    turn1 = list(range(100, 140))  # 2 full blocks and a part
    turn2 = turn1 + list(range(200, 250))
    assert len(chain(turn1)) == 40 // ROUTE_BLOCK
    assert chain(turn2)[:2] == chain(turn1)  # the next turn's chain goes through the last turn's
    assert chain(turn2)[2] != chain(turn1 + [0] * 10)[2]
    assert chain(turn1, "player-1") != chain(turn1, "player-2")  # a shared prompt, two players
    assert chain(turn1[:ROUTE_BLOCK - 1]) == []


def test_an_offered_job_is_its_workers_alone_and_the_others_take_what_is_behind_it(any_redis):
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    _push(any_redis, 0, offer="holder", until_ms=_now_ms(any_redis) + HOLD_MS)
    _push(any_redis, 1)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-1"]
    assert 0 < other.offer_lapses_s <= HOLD_MS / 1000
    assert other.take(limit=4, wait_s=0, block_s=0) == []
    [job] = holder.take(limit=4, wait_s=0, block_s=0)
    assert job.id == "job-0" and job.offer == "holder"
    assert holder.offers["own"] == 1 and other.offers["other"] == 0


def test_a_lapsed_offer_or_a_dead_holder_holds_nothing_back(any_redis):
    other = _worker(any_redis, "other")
    _worker(any_redis, "holder")
    _worker(any_redis, "gone", beating=False)  # never beat, as a dead worker's key has expired
    now = _now_ms(any_redis)
    _push(any_redis, 0, offer="holder", until_ms=now - 1)  # its time is over
    _push(any_redis, 1, offer="gone", until_ms=now + HOLD_MS)  # its worker is dead
    _push(any_redis, 2)
    # The lapsed offer comes after the jobs offered to no live worker: the dead one's, the shared.
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-1", "job-2", "job-0"]
    assert other.offers["other"] == 2


def test_a_job_its_offered_worker_took_and_died_holding_is_put_back_not_taken_over(any_redis):
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    _push(any_redis, 0, offer="holder", until_ms=_now_ms(any_redis) + HOLD_MS)
    _push(any_redis, 1, offer="holder", until_ms=_now_ms(any_redis) + HOLD_MS)
    assert job_ids_of(holder.take(limit=1, wait_s=0, block_s=0)) == ["job-0"]
    lapse(any_redis, keys.heartbeat(MODEL, "holder"))
    assert other.requeue_dead_workers() == 1
    # Both go to the other worker now; only job-1 was an offer taken over: job-0's wait was the
    # dead worker's hold of it (its queue wait counts from its first queueing), which the offer's
    # wait and count leave out (worker/metrics.py).
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-0", "job-1"]
    assert other.retried == {"job-0"} and other.offers["other"] == 1


def test_a_lapsed_offer_goes_to_a_worker_that_holds_nothing_or_past_a_late_holder(any_redis):
    """A lapsed offer is taken, after that queue's jobs offered to no one else, by a worker that
    holds nothing; a busy one leaves it to its holder while the holder's heartbeat comes on time (in
    a saturated pool it would read the conversation's history again while its own turns wait:
    docs/scaling.md) and takes it once a beat is missed (a stopped holder). A less urgent queue
    waits behind it. `alone_ok` is the worker's "holds nothing"."""
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    now = _now_ms(any_redis)
    _push(any_redis, 0, offer="holder", until_ms=now - 1)  # lapsed, its holder live
    _push(any_redis, 1, offer="other", until_ms=now + HOLD_MS)  # the other's own
    _push(any_redis, 2)  # a new conversation's
    _push(any_redis, 3, priority=5)  # less urgent
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0, alone_ok=False)) == ["job-1", "job-2", "job-3"]
    assert other.offer_lapses_s is None
    _push(any_redis, 4, priority=5)
    assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0, alone_ok=True)) == ["job-0"]  # before job-4

    _push(any_redis, 5, offer="holder", until_ms=now - 1)
    # Passed over as an offer is, the takes going on behind it.
    assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0, alone_ok=False)) == ["job-4"]
    assert other.take(limit=1, wait_s=0, block_s=0, alone_ok=False) == []
    any_redis.pexpire(keys.heartbeat(MODEL, "holder"), int(other.beat_late_s * 1000) - 200)  # a beat missed
    assert job_ids_of(other.take(limit=1, wait_s=0, block_s=0, alone_ok=False)) == ["job-5"]
    assert other.offers["other"] == 2
    assert holder.take(limit=4, wait_s=0, block_s=0) == []


def test_an_offer_to_a_draining_or_full_worker_holds_nothing_back(any_redis):
    """A worker that drains, or holds jobs it has not started (its heartbeat's `waiting`: full),
    would not start an offered job soon: a busy worker takes it in its place, offer or not."""
    other, full = _worker(any_redis, "other"), _worker(any_redis, "full")
    announce_worker(_worker(any_redis, "draining", beating=False), ttl_s=60, draining=True)
    info = json.loads(any_redis.get(keys.heartbeat(MODEL, "full")))
    info["stats"] = {"running": 16, "waiting": 2}
    any_redis.set(keys.heartbeat(MODEL, "full"), json.dumps(info), px=60_000)
    until = _now_ms(any_redis) + HOLD_MS
    _push(any_redis, 0, offer="draining", until_ms=until)
    _push(any_redis, 1, offer="full", until_ms=until)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0, alone_ok=False)) == ["job-0", "job-1"]
    info["stats"]["waiting"] = 0  # room again: its offers hold
    any_redis.set(keys.heartbeat(MODEL, "full"), json.dumps(info), px=60_000)
    _push(any_redis, 2, offer="full", until_ms=until)
    assert other.take(limit=4, wait_s=0, block_s=0) == []
    assert job_ids_of(full.take(limit=4, wait_s=0, block_s=0)) == ["job-2"]


def test_priority_order_holds_across_offered_and_shared_jobs(any_redis):
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    until = _now_ms(any_redis) + HOLD_MS
    _push(any_redis, 0, priority=5)
    _push(any_redis, 1, offer="holder", until_ms=until, priority=1)
    _push(any_redis, 2, priority=1)
    _push(any_redis, 3, offer="holder", until_ms=until, priority=5)
    # The holder takes its offers and the shared jobs, most urgent queue first, FIFO within one.
    assert job_ids_of(holder.take(limit=4, wait_s=0, block_s=0)) == ["job-1", "job-2", "job-0", "job-3"]
    _push(any_redis, 4, offer="holder", until_ms=until, priority=1)
    _push(any_redis, 5, priority=5)
    assert job_ids_of(other.take(limit=4, wait_s=0, block_s=0)) == ["job-5"]


def test_past_its_limit_a_worker_takes_only_its_own_offers_in_priority_order(any_redis):
    """`held` (Engine.held_slots): past the limit a worker takes the turns offered to it, from the
    queue where it reached the limit; the shared job left there wakes another worker and stops it
    from going on to a less urgent queue; a job that has cost a worker is not taken this way."""
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    until = _now_ms(any_redis) + HOLD_MS
    _push(any_redis, 0, offer="holder", until_ms=until, priority=1)
    _push(any_redis, 1, priority=1)
    _push(any_redis, 2, offer="holder", until_ms=until, priority=1)
    _push(any_redis, 3, offer="holder", until_ms=until, priority=1)
    _push(any_redis, 4, offer="holder", until_ms=until, priority=5)
    any_redis.set(keys.attempts(MODEL, "job-3"), 1)  # a worker died holding it
    assert job_ids_of(holder.take(limit=0, wait_s=0, block_s=0, held=3)) == ["job-0", "job-2"]
    assert any_redis.llen(keys.wake(MODEL)) == 1, "the shared job left behind wakes a worker"
    # job-3, left in the urgent queue, keeps the less urgent job-4 back too.
    assert job_ids_of(holder.take(limit=1, wait_s=0, block_s=0, held=3)) == ["job-1"]
    assert job_ids_of(holder.take(limit=1, wait_s=0, block_s=0, held=3)) == ["job-3", "job-4"]
    assert holder.offers["own"] == 3  # job-3's wait was its dead worker's hold, not an offer's
    assert other.take(limit=4, wait_s=0, block_s=0) == []


def test_an_idle_worker_takes_a_job_once_the_offer_to_another_lapses(any_redis):
    """Through the API's admission script: the offer is stamped in Redis' clock, the holder's own
    wake list gets a token, and an idle other worker blocks only until the offer lapses."""
    holder, other = _worker(any_redis, "holder"), _worker(any_redis, "other")
    wait_s = 0.3
    Admission(any_redis, max_queue=0).push([replace(numbered_job(0), offer="holder")], cap=0, offer_wait_s=wait_s)
    assert any_redis.llen(keys.worker_wake(MODEL, "holder")) == 1
    raw = any_redis.lindex(keys.queue(MODEL), 0).decode()
    assert '"offer":"holder","offer_until":' in raw and '"offer_until":0,' not in raw
    started = time.monotonic()
    [job] = other.take(limit=1, wait_s=0, block_s=5)
    waited = time.monotonic() - started
    assert job.id == "job-0" and other.offers["other"] == 1
    assert waited < 2.5, waited  # the offer's 0.3 s (and a loaded machine's slack), not the 5 s block
    assert holder.take(limit=1, wait_s=0, block_s=0) == []


def test_an_answer_leaves_the_note_the_next_turn_is_routed_by(any_redis):
    """The worker that answers a job notes its prompt's digest as its own; the next turn, whose
    prompt goes on from it, is offered to that worker; a draining or unknown worker is not."""
    holder = _worker(any_redis, "holder")
    turn1 = list(range(1000, 1040))
    own, offer = routing.plan(any_redis, MODEL, [turn1], "player-7", [])
    assert offer is None and own == [chain(turn1, "player-7")[-1]]
    job = replace(numbered_job(0), prompt_ids=turn1, route=own[0])
    any_redis.rpush(keys.queue(MODEL), job.to_json())
    [taken] = holder.take(limit=1, wait_s=0, block_s=0)
    seq = Sequence(taken, tokenizer=None, eos_ids=frozenset())
    seq.finish_reason, seq.text = "stop", "hello"  # answered
    assert holder.publish([seq]).finished == [seq]
    assert any_redis.get(keys.route_prefix(MODEL) + own[0]) == b"holder"
    assert 0 < any_redis.ttl(keys.route_prefix(MODEL) + own[0]) <= keys.ROUTE_TTL_S
    turn2 = turn1 + list(range(2000, 2030))
    infos = {w.id: w for w in _infos(any_redis)}
    assert routing.plan(any_redis, MODEL, [turn2], "player-7", list(infos.values()))[1] == "holder"
    assert routing.plan(any_redis, MODEL, [turn2], "player-8", list(infos.values()))[1] is None
    draining = [replace(w, draining=True) for w in infos.values()]
    assert routing.plan(any_redis, MODEL, [turn2], "player-7", draining)[1] is None


def _infos(client):
    from api.broker import Broker
    return Broker(client).live_workers()


def test_an_offer_lasts_the_floor_or_two_of_its_workers_steps_within_the_cap(any_redis):
    """A worker looks at the queue between steps: the offer outlasts the step its worker is in (its
    heartbeat's step_s), so that a busy worker still gets its conversation's turn, within a cap."""
    _worker(any_redis, "quick"), _worker(any_redis, "slow"), _worker(any_redis, "stuck")
    infos = []
    for w, step_s in zip(sorted(_infos(any_redis), key=lambda w: w.id), (0.01, 0.3, 60.0)):
        infos.append(replace(w, stats={**w.stats, "step_s": step_s}))  # quick, slow, stuck
    assert [routing.offer_wait(w, infos, 0.05) for w in ("quick", "slow", "stuck", "gone")] == [
        0.05, 0.6, routing.OFFER_CAP_S, 0.05]
    assert routing.offer_wait("slow", infos, 1.0) == 1.0  # --affinity-wait is the floor
