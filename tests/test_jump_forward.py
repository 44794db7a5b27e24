"""Forced tokens (jump-forward): where a grammar allows exactly one next token, the continuous engine
appends it without a step of its own and computes the forced run as one chunk (worker/constraint.py).

On the packaged SmolLM2 with the default settings: the same tokens and text as step by step
(--jump-forward 0), greedy and seeded, alone, in a crowd arriving at random steps with a pool small
enough to preempt, and after a resume from a record cut inside a forced run; in fewer steps; with
usage counting every token; and a request that asks for logprobs gets each token's own.
"""
from __future__ import annotations

import hashlib
import json
import random

import llguidance
import pytest

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from tests.engines import run_until_idle, write_arriving
from worker.constraint import Grammars
from worker.continuous import engine as continuous
from worker.model_loader import PACKAGED, load

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {
        "line": {"type": "string", "minLength": 1, "maxLength": 60},
        "mood": {"enum": ["grumpy", "cheerful", "wary", "sly"]},
        "gold_offered": {"type": "integer", "minimum": 0, "maximum": 500}},
     "required": ["line", "mood", "gold_offered"], "additionalProperties": False},
    {"type": "object", "properties": {
        "action": {"enum": ["strike", "parry", "flee", "cast"]}, "target": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["war", "gold", "magic"]}, "maxItems": 3}},
     "required": ["action", "target", "tags"], "additionalProperties": False},
]
TOPICS = ("the old well", "the dragon", "a cursed crown", "the harbour", "the goblin king", "a lost map")


@pytest.fixture(scope="module")
def smollm2():
    return load(PACKAGED, dtype="auto", device="cpu", transformers_model=False,  # the worker's defaults
                cache_dir=Settings().cache_dir)


@pytest.fixture(scope="module")
def grammars(smollm2):
    texts = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s), defaults={"whitespace_flexible": False})
             for s in SCHEMAS]
    store = {hashlib.sha256(t.encode()).hexdigest(): t for t in texts}
    return Grammars(smollm2.tokenizer, smollm2.vocab_size, store.get), list(store)


def _engine(loaded, **settings):
    return continuous.build(loaded, Settings(**settings), loaded.weights(), loaded.config)


def _jobs(loaded, digests, count: int, seed: int, **extra) -> list[tuple[int, Job]]:
    """(arrival step, job): NPC questions, each with one of the schemas, every other one seeded."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = loaded.tokenizer.encode(f"A player asks the innkeeper about {rng.choice(TOPICS)}. Answer as JSON.\n")
        params = SamplingParams(max_tokens=rng.randint(40, 70), temperature=0.8 if i % 2 else 0.0,
                                seed=2000 + i if i % 2 else None, grammar=digests[i % len(digests)], **extra)
        jobs.append((rng.randint(0, 10), Job(id=f"j{i}", model="m", prompt_ids=prompt, params=params,
                                             timeout_s=300, stream=i % 3 == 0)))
    return jobs


def _writer(grammars):
    def add(engine, job, written=None):
        return engine.add(job, written, grammars.constraint(job.params.grammar))
    return add


def _forced(engine) -> int:
    return engine.scheduler.forced


def test_a_crowd_writes_the_same_text_with_forced_tokens_in_fewer_steps(smollm2, grammars):
    store, digests = grammars
    add = _writer(store)
    jobs = _jobs(smollm2, digests, 16, seed=5)
    texts = {}
    for jump in (False, True):
        # A pool of 20 blocks of 16 for 16 requests of 2-6 blocks each: preemption happens.
        engine = _engine(smollm2, jump_forward=jump, kv_blocks=20)
        seqs = write_arriving(engine, jobs, add)
        texts[jump] = {i: (s.output_ids, s.text, s.finish_reason) for i, s in seqs.items()}
        if jump:
            assert engine.scheduler.preempted > 0, "the pool was meant to be short"
            assert _forced(engine) > 0
            forced_share = _forced(engine) / sum(len(s.output_ids) for s in seqs.values())
    differ = [i for i in texts[True] if texts[True][i] != texts[False][i]]
    assert not differ, f"{len(differ)} of {len(jobs)} wrote other text with forced tokens: {differ}"
    for job_id, (ids, text, reason) in texts[True].items():
        if reason == "stop":
            json.loads(text)  # a whole reply is valid JSON
    assert forced_share > 0.2, forced_share  # keys and punctuation: a real share of a JSON reply


def test_one_request_takes_fewer_steps_and_counts_every_token(smollm2, grammars):
    store, digests = grammars
    add = _writer(store)
    [(_, job)] = _jobs(smollm2, digests, 1, seed=1)
    done = {}
    for jump in (False, True):
        engine = _engine(smollm2, jump_forward=jump)
        seq = add(engine, job)
        done[jump] = (seq.output_ids, seq.text, run_until_idle(engine), seq.final().completion_tokens)
    (ids, text, slow_steps, counted), (jump_ids, jump_text, fast_steps, jump_counted) = done[False], done[True]
    assert (jump_ids, jump_text) == (ids, text)
    assert jump_counted == counted == len(ids)  # usage: every token, forced or picked
    assert fast_steps < slow_steps - 5, (fast_steps, slow_steps)


def test_a_resumed_request_goes_on_as_it_would_have(smollm2, grammars):
    """A record cut anywhere (inside a forced run too): the rest is what the whole run writes."""
    store, digests = grammars
    add = _writer(store)
    jobs = [job for _, job in _jobs(smollm2, digests, 4, seed=9)]
    engine = _engine(smollm2)
    whole = {job.id: add(engine, job) for job in jobs}
    run_until_idle(engine)
    for job in jobs:
        ids = whole[job.id].output_ids
        for cut in (3, len(ids) // 2, len(ids) - 2):
            resumed = add(engine, job, ids[:cut])
            run_until_idle(engine)
            assert (resumed.output_ids, resumed.text) == (ids, whole[job.id].text), (job.id, cut)


def test_logprobs_are_the_models_own_for_every_token(smollm2, grammars):
    """A request that asks for logprobs gets an entry per token from the model's logits: its forced
    tokens take a step each, as before; its text is the same as without logprobs."""
    store, digests = grammars
    add = _writer(store)
    [(_, plain)] = _jobs(smollm2, digests, 1, seed=2)
    asking = Job(id="lp", model="m", prompt_ids=plain.prompt_ids, timeout_s=300, stream=False,
                 params=SamplingParams(**{**vars(plain.params), "logprobs": 2}))
    engine = _engine(smollm2)
    a, b = add(engine, plain), add(engine, asking)
    run_until_idle(engine)
    assert b.output_ids == a.output_ids
    assert len(b.logprobs) == len(b.output_ids)
    assert all(entry[1] is not None and entry[1] <= 0 for entry in b.logprobs)
