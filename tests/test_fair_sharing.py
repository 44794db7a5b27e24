"""Sharing work between workers: none idles while another holds jobs it has not started, and each
model's jobs go to that model's workers.

In process: the continuous engine's `free_slots` against an engine that holds a whole backlog (it
must start just as many each step, and hold nothing unstarted), the worker loop's rounds of taking
on fakeredis, and the wake-up a worker leaves for an idle one when it leaves jobs behind.

Real processes: a private redis-server, the API, two tiny-Llama workers of which one sleeps after
every step (the tests' step_delay_s fault, worker/faults.py, as if its machine were much slower), and a tiny-GPT-2
worker, which serves another model.
"""
from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from shared import keys
from shared.protocol import Job, SamplingParams, WorkerInfo
from shared.settings import Settings
from tests.engines import make_engine
from tests.processes import logs, make_client, models_served, start, start_api, stop, wait_until
from worker.faults import as_env
from worker.job_queue import JobQueue
from worker.worker import ADMIT_ROUNDS, Worker

pytestmark = pytest.mark.timeout(300)


# In process

ENGINE = Settings(block_size=4, kv_blocks=1024, max_batch_tokens=32, batch=0)


def backlog(count: int, seed: int, lengths=(24, 24), shared_prefix: int = 0, max_tokens=(20, 20)) -> list[Job]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 390) for _ in range(shared_prefix)]
    return [Job(id=f"j{i}", model="m", timeout_s=600,
                prompt_ids=prefix + [rng.randrange(10, 390) for _ in range(rng.randint(*lengths))],
                params=SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0, ignore_eos=True))
            for i in range(count)]


def take_as_the_worker_does(engine, queue: deque) -> None:
    """Between two steps: ask free_slots, take that many, ask again, ADMIT_ROUNDS times at most."""
    for _ in range(ADMIT_ROUNDS):
        room = engine.free_slots()
        if not room or not queue:
            return
        for _ in range(min(room, len(queue))):
            engine.add(queue.popleft())


def race(loaded, settings: Settings, jobs: list[Job]) -> dict:
    """The same backlog through two engines: one holds it all from the start (as every worker did
    before free_slots counted the next step), one takes as the worker loop does now. For each: the
    steps to write it all, the jobs held unstarted summed over the steps, and the mean step at which
    a job started (when its prompt got its first chunk)."""
    engines = {"holds all": make_engine(loaded, settings), "takes": make_engine(loaded, settings)}
    for job in jobs:
        engines["holds all"].add(job)
    queue = deque(jobs)
    result = {name: dict(steps=0, held=0, started_at=0.0) for name in engines}
    unstarted = {name: {j.id for j in jobs} for name in engines}
    step = 0
    while any(e.busy for e in engines.values()) or queue:
        take_as_the_worker_does(engines["takes"], queue)
        for name, engine in engines.items():
            if not (engine.busy or name == "takes" and queue):
                continue
            engine.step()
            waiting = {r.id for r in engine.scheduler.waiting}
            left = waiting | ({j.id for j in queue} if name == "takes" else set())
            result[name]["started_at"] += step * len(unstarted[name] - left) / len(jobs)
            unstarted[name] = left
            result[name]["held"] += len(waiting)
            result[name]["steps"] = step + 1
        step += 1
        assert step < 5000
    assert engines["takes"].generated == engines["holds all"].generated
    return result


@pytest.mark.parametrize("policy", ["fifo", "prefill-first"])
def test_a_worker_takes_what_its_next_step_starts_and_as_many(tiny_llama, policy):
    """Equal prompts: the taking engine starts jobs exactly when the one holding the whole backlog
    does, and never holds one it has not started."""
    result = race(tiny_llama, replace(ENGINE, scheduler=policy), backlog(60, seed=1))
    assert result["takes"]["held"] == 0
    assert result["takes"]["steps"] == result["holds all"]["steps"]
    assert result["takes"]["started_at"] == result["holds all"]["started_at"]
    assert result["holds all"]["held"] > 20 * 60, "the backlog did wait inside the engine holding it"


def test_sixty_four_players_batch_as_before_with_the_default_budget(tiny_llama):
    """The default budget (512 tokens a step) and a crowd of 64: the same steps, the same starts."""
    result = race(tiny_llama, replace(ENGINE, max_batch_tokens=512), backlog(64, seed=2, lengths=(20, 30)))
    # Prompts of 20-30 tokens: the first guesses are off by a little, and hold a few for a step.
    assert result["takes"]["held"] <= 0.05 * result["holds all"]["held"]
    assert result["takes"]["steps"] == result["holds all"]["steps"]
    assert result["takes"]["started_at"] == result["holds all"]["started_at"]


@pytest.mark.parametrize("case", ["mixed lengths", "shared prefix", "small cache"])
def test_prompts_it_cannot_see_cost_it_little(tiny_llama, case):
    """Prompts of 1-60 tokens, or sharing a 40-token prefix that the cache holds, or a cache that
    fills: the guess can be off, but what is held unstarted is a sliver of what the engine holding
    everything holds, and jobs start about as early."""
    settings, jobs = ENGINE, backlog(80, seed=3, lengths=(1, 60), max_tokens=(1, 30))
    if case == "shared prefix":
        jobs = backlog(80, seed=4, lengths=(1, 20), shared_prefix=40, max_tokens=(1, 30))
    if case == "small cache":
        settings = replace(ENGINE, kv_blocks=64, prefix_caching=False)
    result = race(tiny_llama, settings, jobs)
    takes, holds_all = result["takes"], result["holds all"]
    assert takes["held"] <= 0.05 * holds_all["held"]
    assert takes["steps"] <= 1.1 * holds_all["steps"]
    assert takes["started_at"] <= 1.1 * holds_all["started_at"]


def test_a_larger_batch_than_the_step_can_compute_is_cut_to_it(tiny_llama):
    assert make_engine(tiny_llama, replace(ENGINE, batch=1000)).capacity == 32
    assert make_engine(tiny_llama, replace(ENGINE, batch=8)).capacity == 8


def _push(client, jobs: list[Job]) -> None:
    client.rpush(keys.queue("m"), *[j.to_json() for j in jobs])


def test_the_worker_loop_leaves_in_redis_what_it_would_not_start(tiny_llama, fake_redis):
    info = WorkerInfo(id="w", model="m", context_window=128, engine="continuous", batch=32, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    engine = make_engine(tiny_llama, ENGINE)
    worker = Worker(JobQueue(fake_redis, "w", "m"), engine, info, Settings(wait_ms=0))
    worker.queue.sync_clock()  # as its first heartbeat does
    _push(fake_redis, backlog(16, seed=5, max_tokens=(8, 8)))
    worker._admit()
    # 24-token prompts and 32 tokens a step: the first step starts two (the second with 8 tokens).
    assert len(engine.sequences()) == 2 and fake_redis.llen(keys.queue("m")) == 14
    assert fake_redis.llen(keys.wake("m")) == 1, "the jobs it left behind wake one idle worker"
    steps = 0
    while engine.busy or fake_redis.llen(keys.queue("m")):
        worker._step()
        assert not engine.scheduler.waiting, "everything taken started at the step after"
        worker._admit()
        steps += 1
        assert steps < 2000
    assert fake_redis.llen(keys.processing("m", "w")) == 0, "every job answered"


def test_a_busy_worker_takes_a_turn_offered_to_it_past_its_count(tiny_llama, fake_redis):
    """Engine.held_slots and the take past its limit: a worker whose next step is all a long
    prompt's by free_slots' count still takes a job the API offered it (a conversation its prefix
    cache holds), which the next step starts and prefills whole; the shared job ahead of it in
    line stays in Redis for another worker, and wakes one."""
    info = WorkerInfo(id="w", model="m", context_window=256, engine="continuous", batch=32, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="h", started=0.0)
    engine = make_engine(tiny_llama, ENGINE)
    worker = Worker(JobQueue(fake_redis, "w", "m"), engine, info, Settings(wait_ms=0))
    worker.queue.sync_clock()
    long, shared, turn = backlog(3, seed=6, lengths=(10, 10), max_tokens=(8, 8))
    long = replace(long, prompt_ids=long.prompt_ids * 10)  # 100 tokens, 32 a step
    engine.add(long)
    engine.step()
    assert engine.free_slots() == 0 and engine.held_slots() == 1
    offered = replace(turn, offer="w", offer_until=int(time.time() * 1000) + 600_000)
    _push(fake_redis, [shared, replace(offered, offer="elsewhere"), offered])
    fake_redis.delete(keys.wake("m"))
    assert worker._admit() == 1
    assert [s.id for s in engine.sequences()] == [long.id, turn.id]
    assert fake_redis.llen(keys.queue("m")) == 2 and fake_redis.llen(keys.wake("m")) == 1
    assert engine.held_slots() == 0, "one at a time: it holds one unstarted"
    engine.step()
    request = {r.id: r for r in engine.scheduler.running}
    assert request[turn.id].computed == 10 and len(request[turn.id].seq.output_ids) == 1, "its whole prompt"
    assert request[long.id].computed == 32 + 16 + 6, "half the step kept, and what the turn left"


def test_jobs_left_behind_wake_an_idle_worker(real_redis):
    """A worker that takes part of what is queued wakes another, which would otherwise sleep through
    its block (the API's push woke one worker only)."""
    busy, idle = JobQueue(real_redis, "busy", "m"), JobQueue(real_redis, "idle", "m")
    woke = []
    sleeper = threading.Thread(target=lambda: woke.extend(idle.take(limit=4, wait_s=0, block_s=30)))
    sleeper.start()
    # Blocked on the wake list now: seen by Redis, not assumed after a sleep (a loaded machine could
    # start the thread late, and it would take the jobs itself before `busy`).
    deadline = time.monotonic() + 30
    while real_redis.info("clients")["blocked_clients"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    _push(real_redis, backlog(3, seed=6))  # no wake token: as if a first idle worker had taken it
    assert len(busy.take(limit=1, wait_s=0, block_s=0)) == 1
    sleeper.join(35)
    # Woken by the token `busy` left, not by the end of its 30 s block: a round trip after the take,
    # well under 15 s even on a loaded 2-core machine.
    assert len(woke) == 2 and time.monotonic() - started < 15
    # Nothing left: no token, so an idle worker does not wake for nothing.
    assert real_redis.llen(keys.wake("m")) == 0


def test_a_worker_refuses_several_names_at_start():
    """One worker, one name: the queue of the model it loads. A list would be one name nobody uses."""
    from worker.__main__ import check
    with pytest.raises(SystemExit, match="serves one model name"):
        check(Settings(model_name="SmolLM2-135M-Instruct,gpt-4"))
    check(Settings(model_name="storyteller"))


# Real processes

LLAMA, GPT2 = "tiny-llama", "tiny-gpt2"  # each worker names its model after its directory
SLOW_STEP_S = 0.25
BEAT_S = 0.05  # the workers' heartbeat, which carries the stats the test samples
# A small token budget, so that a crowd of 24-token prompts is more than one step can start (with
# the default 512 it would take ~20 such prompts to fill one): the case where a worker could hold
# jobs that wait inside it.
WORKER_ARGS = ["--dtype", "float32", "--max-batch-tokens", "64", "--wait", "5"]
PROMPT_TOKENS, ANSWER_TOKENS = 24, 40


class Stack:
    def __init__(self, redis_server, port, procs, fast, slow, gpt2):
        self.redis = redis_server.client()
        self.port, self.procs = port, procs
        self.fast, self.slow, self.gpt2 = fast, slow, gpt2

    def beats(self) -> dict[int, dict]:
        """Each live worker's last heartbeat, by process id."""
        registered = self.redis.hgetall(keys.WORKERS)
        raws = self.redis.mget([keys.heartbeat(m.decode(), i.decode()) for i, m in registered.items()]) \
            if registered else []
        return {b["pid"]: b for b in (json.loads(r) for r in raws if r)}

    def generated(self) -> dict[int, int]:
        """Tokens each worker has written since it started, once all three are idle again."""
        def settled():
            beats = self.beats()
            return len(beats) == 3 and all(
                "generated" in b["stats"] and not b["stats"]["running"] and not b["stats"]["waiting"]
                for b in beats.values())
        wait_until(settled, self.procs, "the workers to be idle", timeout=60)
        time.sleep(3 * BEAT_S)  # a last heartbeat after the last step
        return {pid: b["stats"]["generated"] for pid, b in self.beats().items()}


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model_dirs, tmp_path_factory):
    redis_server.client().flushdb()
    log_dir = tmp_path_factory.mktemp("fair-sharing-logs")
    beat = dict(REDIS_URL=redis_server.url, HEARTBEAT_S=str(BEAT_S))
    fast = start(["worker", "--model", tiny_model_dirs["llama"], *WORKER_ARGS], log_dir, "fast", **beat)
    slow = start(["worker", "--model", tiny_model_dirs["llama"], *WORKER_ARGS], log_dir, "slow",
                 **as_env(step_delay_s=SLOW_STEP_S), **beat)
    gpt2 = start(["worker", "--model", tiny_model_dirs["gpt2"], *WORKER_ARGS], log_dir, "gpt2", **beat)
    port, api = start_api(redis_server, log_dir, "api", "--max-queue", "0")
    procs = [fast, slow, gpt2, api]
    try:
        stack = Stack(redis_server, port, procs, fast, slow, gpt2)
        wait_until(lambda: {LLAMA, GPT2} <= models_served(port) and len(stack.beats()) == 3, procs,
                   "both models and three workers", timeout=180)
        yield stack
    finally:
        for proc in procs:
            stop(proc)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 390) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def crowd(stack, requests: list[tuple[str, list[list[int]]]]) -> list:
    """Every request at once, each from its own thread, as players (or a game server batching
    several stories in one request: one job per prompt, queued together) would send them."""
    with make_client(stack.port) as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda mp: client.completions.create(
            model=mp[0], prompt=mp[1], max_tokens=ANSWER_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}), requests))


class Sampler:
    """The fast and slow workers' heartbeats, read every 20 ms while a crowd is served."""

    def __init__(self, stack):
        self.stack, self.samples, self._done = stack, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _run(self):
        while not self._done.wait(0.02):
            beats = self.stack.beats()
            fast, slow = beats.get(self.stack.fast.pid), beats.get(self.stack.slow.pid)
            if fast and slow and "running" in fast["stats"] and "running" in slow["stats"]:
                self.samples.append((time.monotonic(), fast["stats"], slow["stats"]))

    def seconds(self, condition) -> float:
        """How long `condition(fast, slow)` held: the time between consecutive samples where it did."""
        total = 0.0
        for (t0, f0, s0), (t1, f1, s1) in zip(self.samples, self.samples[1:]):
            if condition(f0, s0) and condition(f1, s1):
                total += t1 - t0
        return total


def idle(stats: dict) -> bool:
    return not stats["running"] and not stats["waiting"]


def test_the_fast_worker_never_idles_while_the_slow_one_holds_jobs_it_has_not_started(stack):
    before = stack.generated()
    requests, per_request = 12, 6
    started = time.monotonic()
    with Sampler(stack) as sampler:
        answers = crowd(stack, [(LLAMA, prompts(per_request, seed=i)) for i in range(requests)])
    wall = time.monotonic() - started
    after = stack.generated()
    fast = after[stack.fast.pid] - before[stack.fast.pid]
    slow = after[stack.slow.pid] - before[stack.slow.pid]
    jobs = requests * per_request
    assert all(a.usage.completion_tokens == per_request * ANSWER_TOKENS for a in answers)
    assert fast + slow == jobs * ANSWER_TOKENS, "every token written once, by a Llama worker"

    held_unstarted = sampler.seconds(lambda f, s: idle(f) and s["waiting"] > 0)
    held_running = sampler.seconds(lambda f, s: idle(f) and s["running"] > 0)
    most_waiting = max(s["waiting"] for _, _, s in sampler.samples)
    print(f"\n{jobs} jobs in {wall:.1f} s; tokens written: fast {fast}, slow {slow}; "
          f"{len(sampler.samples)} samples; the fast worker idle while the slow one held jobs it had "
          f"not started: {held_unstarted:.2f} s (held running ones: {held_running:.2f} s); most jobs "
          f"waiting in the slow worker at once: {most_waiting}")
    # A job the slow worker took waits at most for its next step while the fast worker has nothing
    # to do. A slow worker that took more than it could start would hold them for many of its
    # 0.25 s steps (each starts 2 of these prompts in its 64-token budget, each answer is 40 steps)
    # with the fast one idle: seconds. 4 steps' worth tells the two apart with room for a loaded
    # machine's late heartbeats (the samples' clock) and late wake-ups.
    assert held_unstarted < 4 * SLOW_STEP_S, logs(stack.slow)
    assert fast > 2 * slow


def test_each_model_s_jobs_go_to_that_model_s_workers(stack):
    before = stack.generated()
    mixed = [(LLAMA, [p]) for p in prompts(12, seed=2)] + [(GPT2, [p]) for p in prompts(12, seed=2)]
    random.Random(3).shuffle(mixed)
    answers = crowd(stack, mixed)
    after = stack.generated()
    for (model, _), answer in zip(mixed, answers):
        assert answer.model == model and answer.usage.completion_tokens == ANSWER_TOKENS
    gpt2 = after[stack.gpt2.pid] - before[stack.gpt2.pid]
    llama = sum(after[p.pid] - before[p.pid] for p in (stack.fast, stack.slow))
    assert (gpt2, llama) == (12 * ANSWER_TOKENS, 12 * ANSWER_TOKENS)
    # The same prompt, written by each model's own weights: the two answers differ.
    texts = {}
    for (model, [prompt]), answer in zip(mixed, answers):
        texts.setdefault(tuple(prompt), {})[model] = answer.choices[0].text
    assert all(t[LLAMA] != t[GPT2] for t in texts.values())
    assert not any(stack.redis.llen(q) for m in (LLAMA, GPT2) for q in keys.queues(m))
