"""The worker's loop: take jobs when the engine has room, step the engine, publish what it wrote.

It knows Redis only through JobQueue and the model only through an Engine.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Optional

import redis

from shared.protocol import WorkerInfo
from shared.settings import Settings
from worker import clock, memory
from worker.engine_protocol import Engine
from worker.faults import Faults
from worker.job_queue import LOST, JobQueue
from worker.metrics import WorkerMetrics
from worker.sequence import Sequence

log = logging.getLogger(__name__)

IDLE_BLOCK_S = 0.5  # how long an idle worker blocks on the queue before it looks at its flags again
REDIS_RETRY_S = 1.0  # pause before trying again when Redis is unreachable
# A stopping worker whose Redis stays away this long leaves anyway: its jobs stay in its processing
# list, and a live worker writes them again once Redis is back. Without this, SIGTERM never ends it.
STOPPING_REDIS_WAIT_S = 30.0
# Takes between two steps at most. The engine guesses how many jobs its next step will start before
# it sees their prompts, and is asked again with them in hand: the second answer is nearly always
# right, since the guess is learnt from the jobs before.
ADMIT_ROUNDS = 4
# A busy worker asks Redis for new jobs and for its clients' cancellations at most this often, not
# at every step: a lone player's steps are short enough that two round trips are a real share of
# each (the API, Redis and the worker share the cores; docs/serving.md). A newcomer or a
# cancellation waits this long at most.
BUSY_POLL_S = 0.02


class Worker:
    def __init__(self, queue: JobQueue, engine: Engine, info: WorkerInfo, settings: Settings, grammars=None,
                 faults: Faults = Faults()):
        """`grammars`: the worker's worker.constraint.Grammars, where its engine serves them; `faults`:
        the tests' (worker/faults.py), none in production."""
        self.queue = queue
        self.engine = engine
        self.grammars = grammars
        self.info = info
        self.settings = settings
        self.metrics = WorkerMetrics(info.model)
        # Set by SIGTERM: finish what we hold, and take no more while another worker of the model
        # takes jobs (the last ones to stop empty the queue: _admit).
        self.stopping = threading.Event()
        self._announced_draining = False  # the loop has written a heartbeat saying so
        self._beat_lock = threading.Lock()  # one heartbeat at a time: _announce
        self._unpublished: list[Sequence] = []  # finished while Redis was unreachable
        self._left = threading.Event()  # the loop has ended: the heartbeat must stop too
        # Set by the heartbeat: this worker was declared dead while cut off from Redis, and some of
        # what it holds may be other workers' now. The loop checks the leases (the engine is its own).
        self._struck_off = threading.Event()
        # Set by each heartbeat, and by a Redis error in the loop: look for jobs a take left in this
        # worker's processing list without its reply reaching it (the loop adopts them, in its thread,
        # so that what it holds and publishes cannot change under the look).
        self._stranded_due = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self.faults = faults
        self._crash_on = list(faults.crash_on_prompt) or None
        self._polled = {"take": 0.0, "cancelled": 0.0}  # when a busy worker last asked Redis (monotonic)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("stopping: finishing %d request(s), and the queued ones unless another worker of "
                     "%s takes them", len(self.engine.sequences()), self.info.model)
            # Announced, so the API sends new requests for this model elsewhere (or answers 503).
            self.info = replace(self.info, draining=True)
        self.stopping.set()

    def run(self) -> None:
        self.queue.count_start()
        self.queue.heartbeat(self.info, self.settings.heartbeat_ttl_s)
        self._heartbeat.start()
        redis_lost_since = None
        try:
            while True:
                try:
                    took = self._admit()
                    if self.engine.busy:
                        self._step()
                    elif self._unpublished:
                        self._publish([])
                    elif self.stopping.is_set() and not took:  # nothing held, nothing more to take
                        break
                    redis_lost_since = None
                except redis.RedisError as exc:
                    if self.stopping.is_set() and not self.engine.busy and not self._unpublished:
                        break  # nothing held to finish: no reason to wait for Redis
                    # Decoding goes on; what could not be published is sent once Redis is back.
                    redis_lost_since = redis_lost_since or time.monotonic()
                    if self.stopping.is_set() and time.monotonic() - redis_lost_since > STOPPING_REDIS_WAIT_S:
                        log.error("stopping, and Redis has been unreachable for %g s: leaving %d answer(s) "
                                  "unsent (their jobs stay in this worker's processing list, for another "
                                  "worker to write again)", STOPPING_REDIS_WAIT_S,
                                  len(self._unpublished) + len(self.engine.sequences()))
                        break
                    log.warning("Redis unreachable (%s): trying again in %g s", exc, REDIS_RETRY_S)
                    self._stranded_due.set()  # a take may have run without its reply reaching us
                    time.sleep(REDIS_RETRY_S)
        finally:
            self._left.set()
            self._heartbeat.join()
            try:
                if redis_lost_since is None:
                    # Stranded jobs go back to the queue now, not once another worker finds this one
                    # dead (which would count against them as a death).
                    self._adopt_stranded(room=0)
                self.queue.leave()
            except redis.RedisError as exc:  # Redis went first; our heartbeat expires on its own
                log.warning("could not sign off: %s", exc)
            log.info("worker %s stopped", self.info.id)

    def _admit(self) -> int:
        """Take the jobs the engine will start at its next step, and no more (`free_slots`): one it
        would not start stays in Redis, where a worker with room takes it, instead of waiting inside
        this one. The engine's count is a guess until it holds the jobs and sees their prompts, so
        it is asked again after each take, a few times at most. Returns how many it took.

        A stopping worker takes queued jobs only while no other worker of its model takes jobs (a
        live heartbeat, not draining): in a rolling restart it leaves the queue to the workers that
        stay, and when the whole service stops (serve.py's Ctrl-C, `docker compose down`) the last
        ones empty the queue, so that no client waits for an answer that nobody will write. It
        takes no longer than it would finish what it held: whoever stops it kills it after its stop
        timeout (serve.py: STOP_TIMEOUT_S; compose: stop_grace_period)."""
        if self._stranded_due.is_set():
            self._adopt_stranded()
        idle = not self.engine.busy
        if not idle and not self._poll_due("take"):
            return 0
        stopping = self.stopping.is_set()
        if stopping:
            if not self._announced_draining:
                # Said before it looks at the others: of two workers stopping at once, the second to
                # look then sees the first draining, and takes (neither leaves the queue to the other).
                self._announce()
                self._announced_draining = True
            if self.queue.others_taking():
                return 0
        # Idle, it blocks for a first job, then waits up to --wait for the batch to fill (over all
        # the rounds). Busy, it must not wait for Redis: it takes whatever is there, between steps.
        # Stopping, it waits for nothing: an empty queue now ends it.
        block = IDLE_BLOCK_S if idle and not stopping else 0
        fill_until = time.monotonic() + (self.settings.wait_ms / 1000 if idle and not stopping else 0)
        took = 0
        for _ in range(ADMIT_ROUNDS):
            room = self.engine.free_slots()
            # Past those, a turn of a conversation this worker holds (the API offered it here).
            held = 0 if stopping or not self.engine.busy else self.engine.held_slots()
            if not (room or held) or (self.queue.isolated and self._running_alone()):
                break
            taken = self.queue.take(room, max(0.0, fill_until - time.monotonic()), block,
                                    alone_ok=not self.engine.busy, held=held)
            self._add(taken)
            took += len(taken)
            if len(taken) < room or not room:  # the queue is empty, or only held turns were asked for
                break
            block = 0
        return took

    def _adopt_stranded(self, room: Optional[int] = None) -> None:
        """Run the jobs that a take whose reply was lost left in this worker's processing list, as
        many as the engine has room for (`room`: or that many), and put the others back in the
        queue. What it holds (also finished but unpublished) is not adopted again; the sequences of
        jobs it lost are not held (another worker's now, or leased to it again by that take)."""
        self._stranded_due.clear()
        if room is None:
            alone = self.queue.isolated and self._running_alone()
            room = 0 if self.stopping.is_set() or alone else self.engine.free_slots()
        held = {s.id for s in self.engine.sequences() + self._unpublished if s.finish_reason != LOST}
        try:
            adopted = self.queue.adopt_stranded(held, room, alone_ok=not self.engine.busy)
        except redis.RedisError:
            self._stranded_due.set()
            raise
        self._add(adopted)

    def _add(self, taken: list) -> None:
        """Hand the jobs taken to the engine, each with what an earlier attempt wrote (it resumes
        from there); those it cannot run are answered at once, as are those their record completes."""
        now = self.queue.clock.now()  # Redis' clock, as the jobs' enqueued_at: no host's own
        if taken:
            self._drop_retaken({job.id for job in taken})
        complete = []
        for job in taken:
            written = self.queue.written.pop(job.id, None)
            taken_by = self.queue.offer_taken_by(job)
            self.queue.retried.discard(job.id)
            self.metrics.taken(job, now, taken_by)
            if clock.expired(job.enqueued_at, job.timeout_s, now):  # nobody is waiting for it any more
                self.queue.fail([job.id], "the request's deadline passed before it was decoded", "timeout")
                continue
            if self._crash_on == job.prompt_ids:  # the tests' fault: die as a crashing job would make us
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                seq = self.engine.add(job, written, self._constraint(job))
            except Exception as exc:  # one bad job fails alone; the worker and its batch go on
                log.exception("job %s refused", job.id)
                self.queue.fail([job.id], f"the worker could not take this request: {exc}")
                continue
            if seq.resumed:
                log.info("job %s resumes after the %d token(s) an earlier worker wrote", job.id, seq.resumed)
                self.metrics.resumed(seq.resumed)
            if seq.finished:  # not held by the engine: nothing left to compute
                complete.append(seq)
        if complete:
            self._publish(complete)

    def _constraint(self, job):
        """The job's grammar's matcher, fetched from Redis and compiled at its first use."""
        if job.params.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError("this worker serves no grammars (structured output)")
        return self.grammars.constraint(job.params.grammar)

    def _drop_retaken(self, job_ids: set[str]) -> None:
        """A job taken that this worker holds already: it lost the job while cut off from Redis and
        took it back from the queue before noticing. The old sequence goes, unpublished: the lease
        names this worker again, so only this keeps the two from both writing to the client."""
        for seq in self.engine.sequences() + self._unpublished:
            if seq.id in job_ids and seq.finish_reason != LOST:
                seq.cancel(LOST)
                log.warning("job %s came back to this worker, which lost it while cut off from Redis: "
                            "its first try dropped, unpublished", seq.id)

    def _running_alone(self) -> bool:
        """A job on its last retry (its earlier workers died) holds this worker alone until done."""
        return any(s.id in self.queue.isolated for s in self.engine.sequences())

    def _poll_due(self, what: str) -> bool:
        """Whether a busy worker should ask Redis for `what` now (BUSY_POLL_S since it last did)."""
        now = time.monotonic()
        if now - self._polled[what] < BUSY_POLL_S:
            return False
        self._polled[what] = now
        return True

    def _step(self) -> None:
        held = self.engine.sequences()
        gone = self.queue.cancelled([s.id for s in held]) if self._poll_due("cancelled") else set()
        now = self.queue.clock.now()
        for seq in held:
            if seq.id in gone or clock.expired(seq.job.enqueued_at, seq.job.timeout_s, now):
                seq.cancel()
        try:
            changed = self.engine.step()
        except Exception as exc:  # a bad batch must not take the worker down, nor leave clients waiting
            log.exception("engine step failed")
            self.queue.fail([s.id for s in self.engine.reset()], f"the worker failed: {exc}")
            return
        self.metrics.stepped(self.engine.last_batch)
        seqs = changed + [s for s in held if s.finished and s not in changed]
        check = self._struck_off.is_set()
        if check:  # every lease it holds, also of jobs with nothing to send this step
            self._struck_off.clear()
            seqs += [s for s in held if s not in seqs]
        self._publish(seqs, check)
        if self.faults.step_delay_s:  # the tests' fault: a slower machine, for tests of sharing work
            time.sleep(self.faults.step_delay_s)

    def _publish(self, seqs: list[Sequence], check: bool = False) -> None:
        seqs, self._unpublished = self._unpublished + seqs, []
        try:
            published = self.queue.publish(seqs, check)
        except redis.RedisError:
            # Finished sequences have left the engine: keep them until their answer is out.
            self._unpublished = [s for s in seqs if s.finished]
            if check:
                self._struck_off.set()
            raise
        self.metrics.finished(published.finished)
        if published.lost:
            # Cancelled by the queue: the engine drops them at its next step. Others it holds may be
            # lost too, with nothing to send yet: the next step checks them all.
            log.warning("dropped %d job(s) without publishing: this worker was declared dead while cut "
                        "off from Redis, and their jobs went back to the queue for other workers (%s)",
                        len(published.lost), ", ".join(s.id for s in published.lost))
            if not check:
                self._struck_off.set()

    def _announce(self) -> None:
        """A heartbeat with what self.info says now. One at a time (the loop writes one when it starts
        stopping, the heartbeat thread the others): a beat read before stop() cannot land after the
        loop's, and say again that this worker takes jobs."""
        with self._beat_lock:
            # Not stored back: stop() may be setting `draining` on self.info meanwhile.
            info = replace(self.info, stats={**self.engine.stats(), "rss_mb": memory.resident_mb()})
            if self.queue.heartbeat(info, self.settings.heartbeat_ttl_s):
                log.warning("this worker was declared dead while cut off from Redis: what it holds "
                            "may be written by other workers now; checking its leases")
                self._struck_off.set()

    def _beat(self) -> None:
        while not self._left.wait(self.settings.heartbeat_s):
            self._stranded_due.set()
            try:
                memory.trim()  # what the steps freed, before the beat reports the memory
                self._announce()
                self.queue.requeue_dead_workers()
            except Exception:  # Redis away for a moment: keep trying, the loop reports its own errors
                log.exception("heartbeat failed")
