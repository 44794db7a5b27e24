"""Driving an engine in process, as the worker's loop does but with no Redis in between.

The in-process tests compare what engines write (together against alone, continuous against
static, a crowd against each request on its own), so they all need the same few moves: build the
continuous engine on a tiny model, add jobs at once or at the step each arrives, and step until
nothing is left. Written once here, each test file says only what it compares. A test that looks
inside the loop (a batch's size at each step, a stream published as it grows) keeps its own loop.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

from shared.protocol import Job
from shared.settings import Settings
from tests.tiny_models import tiny_tokenizer
from worker.continuous import engine as continuous
from worker.sequence import Sequence

# Small blocks and a small step budget: a few requests on a tiny model already share blocks,
# chunk their prompts and wait for room, the paths the comparisons are about.
SETTINGS = Settings(block_size=4, kv_blocks=256, max_batch_tokens=24, batch=0)


def make_engine(loaded, settings: Settings = SETTINGS):
    """The continuous engine on a tiny model (loaded by `model_loader.load`)."""
    engine = continuous.build(loaded, settings, loaded.model.state_dict(), loaded.model.config)
    assert engine is not None, "tiny GPT-2 and Llama run on the compact model code"
    return engine


def run_until_idle(engine, most_steps: Optional[int] = None) -> int:
    """Step until the engine holds nothing; the steps it took. Past `most_steps` the test fails
    rather than hangs: the engine stopped making progress."""
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        assert most_steps is None or steps < most_steps, "the engine stopped making progress"
    return steps


def write(engine, jobs: list[Job]) -> list:
    """Every job added at once, then stepped until all are written: their sequences, in order."""
    seqs = [engine.add(job) for job in jobs]
    run_until_idle(engine)
    return seqs


def write_arriving(engine, jobs: list[tuple[int, Job]], add: Optional[Callable] = None,
                   most_steps: Optional[int] = None) -> dict:
    """(arrival step, job) pairs, each job added before the step it arrives at, stepped until all
    are written: their sequences by job id. `add(engine, job)` adds one another way (a grammar)."""
    pending, seqs, step = sorted(jobs, key=lambda item: item[0]), {}, 0
    while pending or engine.busy:
        while pending and pending[0][0] <= step:
            job = pending.pop(0)[1]
            seqs[job.id] = add(engine, job) if add else engine.add(job)
        engine.step()
        step += 1
        assert most_steps is None or step < most_steps, "the engine stopped making progress"
    return seqs



class StandIn:
    """An engine for the worker loop's tests: no model, `capacity` jobs at a time, one `word`'s
    token per job per step (real Sequences, so the queue publishes real answers), counting adds."""
    name, last_batch, numerics, features = "stand-in", 0, "", ()

    def __init__(self, capacity: int = 4, word: str = " brave"):
        self.capacity = capacity
        self.tokenizer = tiny_tokenizer()
        self.token = self.tokenizer(word).input_ids[0]
        self.held: list[Sequence] = []
        self.added: Counter[str] = Counter()

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def free_slots(self) -> int:
        return self.capacity - len(self.held)

    def held_slots(self) -> int:
        return 0

    def add(self, job: Job, written=None, constraint=None) -> Sequence:
        seq = Sequence(job, self.tokenizer, frozenset({self.tokenizer.eos_token_id}), written, constraint)
        self.held.append(seq)
        self.added[job.id] += 1
        return seq

    def step(self) -> list[Sequence]:
        changed = [s for s in self.held if not s.finished]
        for seq in changed:
            seq.append(self.token)
        self.held = [s for s in self.held if not s.finished]
        self.last_batch = len(changed)
        return changed

    def sequences(self) -> list[Sequence]:
        return list(self.held)

    def reset(self) -> list[Sequence]:
        dropped, self.held = self.held, []
        return dropped

    def stats(self) -> dict:
        return {}
