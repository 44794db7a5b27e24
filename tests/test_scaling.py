"""python -m api.scaling: each model's queued jobs, oldest job's age, held jobs, live workers and the
suggested worker count, read from Redis (fakeredis; one test on a real redis-server, with the
API's own admission script and the worker's own take); and docs/scaling.md's scaler manifests name
the keys and metrics the code uses."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from api import scaling
from api.admission import Admission
from api.scaling import ModelLoad, Policy, read, suggest
from shared import keys
from shared import metrics as names
from shared.protocol import PRIORITY_DEFAULT, Job, SamplingParams, WorkerInfo

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


def redis_now(client) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def job(job_id: str, model: str = MODEL, priority: int = PRIORITY_DEFAULT, enqueued_at: float = 0.0) -> Job:
    return Job(id=job_id, model=model, prompt_ids=[1, 2, 3], params=SamplingParams(), timeout_s=300,
               enqueued_at=enqueued_at, priority=priority)


def announce(client, worker_id: str, model: str = MODEL, draining: bool = False, alive: bool = True,
             held: int = 0) -> None:
    """A worker as its heartbeat leaves it in Redis, holding `held` jobs."""
    client.hset(keys.WORKERS, worker_id, model)
    client.zadd(keys.MODELS, {model: redis_now(client)})
    if alive:
        info = WorkerInfo(id=worker_id, model=model, context_window=2048, engine="continuous", batch=64,
                          device="cpu", dtype="float32", tokenizer_digest="x", pid=1, host="h",
                          started=0.0, draining=draining)
        client.set(keys.heartbeat(model, worker_id), info.to_json(), ex=30)
    for i in range(held):
        client.rpush(keys.processing(model, worker_id), job(f"{worker_id}-held-{i}", model=model).to_json())


# The rule

@pytest.mark.parametrize("queued, held, age, live, expected", [
    (0, 0, 0.0, 0, 1),      # nothing to do: the minimum
    (10, 20, 0.0, 1, 1),    # 30 jobs: one worker of 32
    (10, 23, 0.0, 1, 2),    # 33: two
    (0, 64, 0.0, 2, 2),     # jobs held count, not only those waiting
    (500, 0, 0.0, 3, 10),   # bounded by the maximum
    (1, 0, 45.0, 3, 4),     # few jobs, but one waited past --max-wait: one more than live
    (1, 0, 45.0, 10, 10),   # ... within the maximum
])
def test_the_rule(queued, held, age, live, expected):
    load = ModelLoad(MODEL, queued=queued, held=held, oldest_age_s=age, workers=live)
    assert suggest(load, Policy(per_worker=32, min_workers=1, max_workers=10, max_wait_s=30)) == expected


def test_the_rule_without_an_age_limit_and_to_zero():
    load = ModelLoad(MODEL, queued=1, oldest_age_s=1000.0, workers=3)
    assert suggest(load, Policy(per_worker=8, min_workers=0, max_wait_s=0)) == 1
    assert suggest(ModelLoad(MODEL), Policy(min_workers=0)) == 0


@pytest.mark.parametrize("kwargs", [{"per_worker": 0}, {"min_workers": 3, "max_workers": 2},
                                    {"min_workers": -1}, {"max_wait_s": -1}])
def test_a_policy_that_means_nothing_is_refused(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)


# Reading Redis (fakeredis)

def test_every_priority_is_counted_and_the_oldest_head_gives_the_age(fake_redis):
    now = redis_now(fake_redis)
    # Priorities -5, 0 and 7: three lists. The oldest job is the head of the *least* urgent one.
    fake_redis.rpush(keys.queue(MODEL, -5), job("a", priority=-5, enqueued_at=now - 2).to_json())
    for i in range(3):
        fake_redis.rpush(keys.queue(MODEL, 0), job(f"b{i}", enqueued_at=now - 5 + i).to_json())
    fake_redis.rpush(keys.queue(MODEL, 7), job("c", priority=7, enqueued_at=now - 12).to_json(),
                     job("d", priority=7, enqueued_at=now - 1).to_json())
    announce(fake_redis, "w1", held=4)
    announce(fake_redis, "w2", held=2)

    _, [load] = read(fake_redis, Policy(per_worker=4, max_wait_s=0))
    assert (load.model, load.queued, load.by_priority) == (MODEL, 6, {-5: 1, 0: 3, 7: 2})
    # The 12 s old head of priority 7 (never less: time only adds to it), not the 5 s one of priority
    # 0; the upper bound is for a nonsense age, with a loaded machine's seconds to spare.
    assert 12 <= load.oldest_age_s < 60
    assert (load.held, load.workers, load.draining) == (6, 2, 0)
    assert load.suggested == 3  # ceil((6 + 6) / 4)


def test_models_apart_and_the_workers_states(fake_redis):
    now = redis_now(fake_redis)
    announce(fake_redis, "w1", held=1)
    announce(fake_redis, "w2", draining=True, held=3)  # stopping: counted apart, its jobs still held
    announce(fake_redis, "w3", alive=False, held=2)  # dead: its jobs go back to the queue, still load
    announce(fake_redis, "g1", model="gpt2-tiny")
    fake_redis.rpush(keys.queue("gpt2-tiny"), job("x", model="gpt2-tiny", enqueued_at=now).to_json())
    # A model last served two days ago is forgotten; one whose worker left an hour ago is not.
    fake_redis.zadd(keys.MODELS, {"old": now - 2 * 86400, "recent": now - 3600})

    _, loads = read(fake_redis, Policy(per_worker=2, max_wait_s=0))
    by_model = {load.model: load for load in loads}
    assert sorted(by_model) == ["SmolLM2-135M-Instruct", "gpt2-tiny", "recent"]
    smol = by_model[MODEL]
    assert (smol.queued, smol.held, smol.workers, smol.draining, smol.suggested) == (0, 6, 1, 1, 3)
    assert (by_model["gpt2-tiny"].queued, by_model["gpt2-tiny"].workers) == (1, 1)
    assert by_model["recent"].workers == 0 and by_model["recent"].suggested == 1
    assert by_model["recent"].oldest_age_s == 0.0


def test_reading_writes_nothing(fake_redis):
    announce(fake_redis, "w1", held=1)
    fake_redis.zadd(keys.MODELS, {"old": 0})
    fake_redis.rpush(keys.queue(MODEL), job("a").to_json())
    before = {k: fake_redis.dump(k) for k in fake_redis.keys("*")}
    read(fake_redis)
    assert {k: fake_redis.dump(k) for k in fake_redis.keys("*")} == before


def test_an_unstamped_or_foreign_head_has_no_age(fake_redis):
    announce(fake_redis, "w1")
    fake_redis.rpush(keys.queue(MODEL), job("a").to_json(), b"not json")
    fake_redis.rpush(keys.queue(MODEL, 3), b"not json")
    _, [load] = read(fake_redis)
    assert (load.queued, load.oldest_age_s) == (3, 0.0)


# The command

def run_main(argv, client, capsys) -> str:
    assert scaling.main(argv, client=client) == 0
    return capsys.readouterr().out


def test_the_table_json_and_the_bare_number(fake_redis, capsys):
    now = redis_now(fake_redis)
    announce(fake_redis, "w1", held=40)
    fake_redis.rpush(keys.queue(MODEL, 2), *[job(f"j{i}", enqueued_at=now - 3).to_json() for i in range(30)])

    out = run_main([], fake_redis, capsys)
    header, row = out.splitlines()
    assert header.split()[:2] == ["model", "queued"]
    assert row.split()[:3] == [MODEL, "30", "2:30"] and row.split()[-1] == "3"  # ceil(70 / 32)

    data = json.loads(run_main(["--json", "--per-worker", "10", "--max", "5"], fake_redis, capsys))
    assert data["policy"] == {"per_worker": 10, "min_workers": 1, "max_workers": 5, "max_wait_s": 30.0}
    [model] = data["models"]
    assert (model["queued"], model["held"], model["workers"], model["suggested"]) == (30, 40, 1, 5)
    # 3 s old as queued, and more as a loaded machine takes its time (60 s: a nonsense age only).
    assert model["by_priority"] == {"2": 30} and 3 <= model["oldest_age_s"] < 60

    assert run_main(["--model", MODEL, "--suggested", "--per-worker", "16"], fake_redis, capsys) == "5\n"
    # A model nobody serves yet: nothing to do, the minimum.
    assert run_main(["--model", "other", "--suggested", "--min", "0"], fake_redis, capsys) == "0\n"


def test_a_bare_number_needs_one_model(fake_redis, capsys):
    announce(fake_redis, "w1")
    announce(fake_redis, "g1", model="gpt2-tiny")
    with pytest.raises(SystemExit, match="--suggested needs one model"):
        scaling.main(["--suggested"], client=fake_redis)


def test_watch_reads_again(fake_redis, capsys):
    announce(fake_redis, "w1")
    lines = run_main(["--json", "--watch", "0.01", "--rounds", "3"], fake_redis, capsys).splitlines()
    assert len(lines) == 3
    times = [json.loads(line)["time"] for line in lines]
    assert times == sorted(times)
    tables = run_main(["--watch", "0.01", "--rounds", "2"], fake_redis, capsys)
    assert tables.count("UTC") == 2


def test_flags_that_mean_nothing_are_refused(fake_redis):
    with pytest.raises(SystemExit):
        scaling.main(["--per-worker", "0"], client=fake_redis)


def test_redis_away_once_is_an_error_watched_it_is_a_line(capsys):
    with pytest.raises(SystemExit, match="cannot read Redis at redis://:\\*\\*\\*@127.0.0.1:1/0"):
        scaling.main(["--redis-url", "redis://:secret@127.0.0.1:1/0"])
    assert scaling.main(["--redis-url", "redis://:secret@127.0.0.1:1/0", "--watch", "0.01",
                         "--rounds", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("cannot read Redis") == 2 and "secret" not in err


# A real redis-server: the API's admission script queues, the worker's take holds, the command reads

def test_a_real_queue_read_by_the_real_command(redis_server, real_redis):
    from worker.job_queue import JobQueue

    admission = Admission(real_redis, max_queue=0)
    for priority, count in ((-3, 2), (0, 5), (4, 3)):
        admission.push([job(f"p{priority}-{i}", priority=priority) for i in range(count)], cap=0)
    time.sleep(1.1)  # the jobs age, in Redis' clock
    worker = JobQueue(real_redis, "host-1", MODEL)
    info = WorkerInfo(id="host-1", model=MODEL, context_window=2048, engine="continuous", batch=64,
                      device="cpu", dtype="float32", tokenizer_digest="x", pid=1, host="host",
                      started=0.0)
    worker.heartbeat(info, ttl_s=30)
    taken = worker.take(4, wait_s=0, block_s=0)  # the most urgent first: -3's two, then two of 0's
    assert [j.priority for j in taken] == [-3, -3, 0, 0]

    out = subprocess.run([sys.executable, "-m", "api.scaling", "--json", "--per-worker", "3",
                          "--redis-url", redis_server.url], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    [model] = json.loads(out.stdout)["models"]
    assert (model["queued"], model["by_priority"], model["held"], model["workers"]) == \
        (6, {"0": 3, "4": 3}, 4, 1)
    assert 1.0 <= model["oldest_age_s"] < 30
    assert model["suggested"] == 4  # ceil((6 + 4) / 3)

    bare = subprocess.run([sys.executable, "-m", "api.scaling", "--suggested", "--model", MODEL,
                           "--per-worker", "5"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REDIS_URL": redis_server.url})
    assert (bare.returncode, bare.stdout) == (0, "2\n"), bare.stderr


# docs/scaling.md: what its manifests name is what the code names

def manifests() -> list[dict]:
    text = (ROOT / "docs" / "scaling.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def test_the_keda_manifests_name_the_real_queue_and_metrics():
    scaled = [m for m in manifests() if m.get("kind") == "ScaledObject"]
    triggers = [t for m in scaled for t in m["spec"]["triggers"]]
    lists = [t["metadata"]["listName"] for t in triggers if t["type"] == "redis"]
    assert lists and all(name in {keys.queue(MODEL, p) for p in range(-10, 11)} for name in lists)
    assert keys.queue(MODEL, PRIORITY_DEFAULT) in lists
    queries = [t["metadata"]["query"] for t in triggers if t["type"] == "prometheus"]
    known = {value for name, value in vars(names).items() if name.isupper() and isinstance(value, str)}
    assert queries and all(set(re.findall(r"storyteller_\w+", q)) <= known for q in queries)
    # The whole load (every priority, and the jobs workers hold), as python -m api.scaling counts it.
    assert any({names.QUEUE_DEPTH, names.RUNNING, names.WAITING} <= set(re.findall(r"storyteller_\w+", q))
               for q in queries)
