"""The continuous engine writes, for greedy decoding, exactly what each request writes alone.

Requests arrive at random steps with random prompt lengths and max_tokens, on tiny random GPT-2
and Llama models in float32; "alone" is the static engine (transformers' model) with one request.
Also with a cache small enough to force preemption, and with shared prefixes (prefix caching); and
on the families with sliding windows (Mistral, Gemma 3's local layers).
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import replace

import pytest

from shared.protocol import Job, SamplingParams
from tests.engines import SETTINGS, make_engine, write, write_arriving
from worker.static_engine import StaticEngine


def make_jobs(vocab: int, count: int, seed: int, shared_prefix: int = 0) -> list[tuple[int, Job]]:
    """(arrival step, job): prompts of 1-40 tokens, 1-30 new tokens, arrivals over ~60 steps."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    jobs = []
    for i in range(count):
        own = [rng.randrange(10, vocab) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0, ignore_eos=True)
        jobs.append((rng.randint(0, 60), Job(id=f"j{i}", model="m", prompt_ids=prefix + own,
                                             params=params, timeout_s=600)))
    return sorted(jobs, key=lambda item: item[0])


def run_continuous(engine, jobs: list[tuple[int, Job]]) -> dict[str, list[int]]:
    return {i: s.output_ids for i, s in write_arriving(engine, jobs, most_steps=10_000).items()}


def alone(loaded, jobs) -> dict[str, list[int]]:
    return {job.id: write(StaticEngine(loaded, capacity=1), [job])[0].output_ids for _, job in jobs}


def test_random_arrivals_write_what_each_writes_alone(loaded):
    jobs = make_jobs(len(loaded.tokenizer), 100, seed=1)
    engine = make_engine(loaded)
    together = run_continuous(engine, jobs)
    assert together == alone(loaded, jobs)
    assert engine.blocks.free == engine.blocks.num_blocks, "every block came back"


def test_a_small_pool_preempts_and_still_writes_the_same(loaded):
    jobs = make_jobs(len(loaded.tokenizer), 100, seed=2)
    engine = make_engine(loaded, replace(SETTINGS, kv_blocks=24, prefix_caching=False))
    together = run_continuous(engine, jobs)
    assert engine.scheduler.preempted > 0, "the pool was meant to run out"
    assert together == alone(loaded, jobs)


def test_shared_prefixes_hit_the_cache_and_write_the_same(loaded):
    jobs = make_jobs(len(loaded.tokenizer), 100, seed=3, shared_prefix=21)
    engine = make_engine(loaded)
    together = run_continuous(engine, jobs)
    assert engine.blocks.hits >= 50 * 20, "most requests found the shared prefix in the cache"
    assert together == alone(loaded, jobs)


@pytest.mark.parametrize("policy", ["fifo", "prefill-first"])
def test_both_schedulers_write_the_same(loaded, policy):
    jobs = make_jobs(len(loaded.tokenizer), 30, seed=4)
    engine = make_engine(loaded, replace(SETTINGS, scheduler=policy, max_batch_tokens=8))
    assert run_continuous(engine, jobs) == alone(loaded, jobs)


def test_a_cancelled_request_gives_its_blocks_back_at_the_next_step(loaded):
    engine = make_engine(loaded)
    jobs = make_jobs(len(loaded.tokenizer), 3, seed=5)
    seqs = [engine.add(job) for _, job in jobs]
    engine.step()
    held = engine.blocks.num_blocks - engine.blocks.free
    assert held > 0
    seqs[0].cancel()
    engine.step()
    assert seqs[0].finish_reason == "cancelled"
    assert seqs[0] not in engine.sequences()
    still_held = sum(len(r.table.blocks) for r in engine.scheduler.running)
    assert engine.blocks.num_blocks - engine.blocks.free == still_held, "its blocks went back"
    stats = engine.stats()
    assert stats["running"] == 2 and 0 < stats["kv_usage"] < 1


def test_steps_are_timed_for_the_pacer_and_slow_prompt_steps_shrink_the_prompts_share(loaded):
    """Steps that carry prompt tokens beside decodes are made 200 ms slower than the decodes' own
    (a few ms on a tiny model, tens on a busy machine): the pacer sees them stretch the streams' gap
    and cuts the prompts' share."""
    engine = make_engine(loaded, replace(SETTINGS, step_fill=20, max_stretch=2.0))
    run = engine.runner.run

    def slow_prompts(plan):
        if any(n > 1 or r.computed == 0 for r, n in plan) and len(plan) > 1:
            time.sleep(0.2)
        return run(plan)
    engine.runner.run = slow_prompts
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add(Job(id=f"s{i}", model="m", prompt_ids=[11 + i, 12, 13], params=params, timeout_s=600))
    for _ in range(5):
        engine.step()  # both decoding, alone: the streams' pace
    pacer = engine.scheduler.pacer
    assert pacer.allowed(2) == 20
    probe = copy.deepcopy(pacer)  # its pace is known: a step far slower than it cuts the share
    probe.observe(2, 20, 1000.0)
    assert probe.allowed(2) < 20
    engine.add(Job(id="long", model="m", prompt_ids=list(range(20, 80)), params=params, timeout_s=600))
    for _ in range(4):
        engine.step()
    assert pacer.allowed(2) <= 5  # the first slow step took 18 prompt tokens to ~10x the gap


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def windowed(request, tmp_path_factory, smollm2_tokenizer):
    """The families with sliding windows (tests/tiny_models.py: mistral 24, gemma3 16), loaded in float32."""
    from tests.tiny_models import save_family
    from worker.model_loader import load
    directory = save_family(request.param, str(tmp_path_factory.mktemp(request.param)), smollm2_tokenizer)
    return load(directory, dtype="float32", device="cpu")


@pytest.mark.slow  # ~60 s each on 2 busy cores: a 49k-token vocabulary, the static engine once per request
def test_sliding_windows_through_arrivals_prefix_hits_and_preemption_write_what_each_writes_alone(windowed):
    """Prompts past the windows, shared prefixes found in the cache, a pool small enough to preempt:
    each request's text is transformers' own (tests/test_families.py checks the logits)."""
    jobs = make_jobs(len(windowed.tokenizer), 16, seed=6, shared_prefix=17)
    engine = make_engine(windowed, replace(SETTINGS, kv_blocks=40))
    together = run_continuous(engine, jobs)
    assert engine.scheduler.preempted > 0 and engine.blocks.hits > 0
    assert together == alone(windowed, jobs)
