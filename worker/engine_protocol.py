"""What the worker's queue loop needs from an engine (tensors in, tokens out, nothing about Redis),
and the checks every engine makes of a job before it runs it (check_prompt, resumable).

The loop asks `free_slots()`, hands over that many jobs with `add()`, then calls `step()` until
`busy` is false. A static engine offers slots only when idle; a continuous one offers them every
step. Either way the queue code stays the same. To cancel a request the loop marks its sequence
finished (`Sequence.cancel`); the engine drops it at the next step.
"""
from __future__ import annotations

import logging
from typing import Optional, Protocol

from shared.protocol import Job
from worker.model_loader import LoadedModel
from worker.sequence import Sequence

log = logging.getLogger(__name__)


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

    def held_slots(self) -> int:
        """How many jobs offered to this worker (their conversation held in its prefix cache: only
        a new turn to compute) to take beyond free_slots, as the next step would start them."""
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


def check_prompt(prompt: list[int], loaded: LoadedModel) -> None:
    """Refuse a job the model cannot run, before it joins a batch it would break."""
    if not prompt or len(prompt) >= loaded.context_window:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model takes 1 to "
                         f"{loaded.context_window - 1}")
    if min(prompt) < 0 or max(prompt) >= loaded.vocab_size:
        raise ValueError(f"token ids must be in [0, {loaded.vocab_size})")


def resumable(written: Optional[list[int]], job: Job, loaded: LoadedModel) -> Optional[list[int]]:
    """The tokens an earlier attempt at the job wrote, if this model can continue from them; None
    if there are none, or (with a warning) if they cannot be this job's: the job starts again."""
    if not written:
        return None
    if job.params.logprobs is not None or job.params.prompt_logprobs is not None:
        # The earlier attempt's logprobs died with it: written again from the start, the same
        # tokens (greedy or seeded) with their logprobs; the API skips what its client already had.
        log.info("job %s asks for logprobs: writing it again from the start rather than resuming after "
                 "its %d written token(s)", job.id, len(written))
        return None
    if len(written) > job.params.max_tokens or min(written) < 0 or max(written) >= loaded.vocab_size:
        log.warning("job %s: ignoring its record of %d written token(s), which cannot be its own (over its "
                    "max_tokens %d, or ids outside the vocabulary): writing it from the start", job.id,
                    len(written), job.params.max_tokens)
        return None
    return written
