"""What the worker's queue loop needs from an engine: tensors in, tokens out, nothing about Redis.

The loop asks `free_slots()`, hands over that many jobs with `add()`, then calls `step()` until
`busy` is false. A static engine offers slots only when idle; a continuous one offers them every
step. Either way the queue code stays the same. To cancel a request the loop marks its sequence
finished (`Sequence.cancel`); the engine drops it at the next step.
"""
from __future__ import annotations

from typing import Optional, Protocol

from shared.protocol import Job
from worker.sequence import Sequence


class Engine(Protocol):
    name: str
    capacity: int  # most sequences held at once
    last_batch: int  # sequences computed by the last step (for the batch-size histogram)
    numerics: str  # the numerics fingerprint the worker announces (WorkerInfo.numerics)
    features: tuple  # of shared.protocol.FEATURES, those it honours (WorkerInfo.features)

    @property
    def busy(self) -> bool: ...

    def free_slots(self) -> int:
        """How many jobs to take now: those the next step will start, and no more; the rest stay
        in Redis for other workers (docs/serving.md, Sharing work between workers)."""
        ...

    def add(self, job: Job, written: Optional[list[int]] = None, constraint=None) -> Sequence:
        """Hold the job. `written`: the tokens an earlier attempt wrote (its record in Redis, from the
        queue): the sequence resumes after them, and they are computed as prompt. A sequence the
        record alone completes is returned finished, not held: the loop publishes it at once.
        `constraint`: the job's grammar (worker/constraint.py) when it names one. ValueError: a job
        this engine cannot write (the loop fails it alone)."""
        ...

    def step(self) -> list[Sequence]:
        """Decode one token for every running sequence; return those that changed."""
        ...

    def sequences(self) -> list[Sequence]: ...

    def reset(self) -> list[Sequence]:
        """Drop everything (after an error); return what was dropped."""
        ...

    def stats(self) -> dict:
        """What the worker's heartbeat and /metrics report of the engine: `running`, `waiting`,
        `generated` (tokens, since start); a paged cache adds `kv_usage` (0-1), `preempted` and
        `prefix_hit_blocks` (since start)."""
        ...
