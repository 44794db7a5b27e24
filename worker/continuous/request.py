"""A request inside the continuous engine: its Sequence (the job's tokens and text, which the
worker publishes), its place in the paged cache and its state for the scheduler."""
from __future__ import annotations

import enum
import itertools

from worker.continuous.block_manager import BlockTable
from worker.sequence import Sequence

_arrivals = itertools.count()


class Status(enum.Enum):
    PENDING = "pending"        # waiting for room in the cache (new, or set back by preemption)
    PREFILLING = "prefilling"  # its prompt is being computed, a chunk per step
    DECODING = "decoding"      # one new token per step (and the tokens a grammar forced after it)
    FINISHED = "finished"


class Request:
    def __init__(self, seq: Sequence):
        self.seq = seq
        self.arrival = next(_arrivals)  # the order of admission and of preemption (newest first)
        self.status = Status.PENDING
        self.table = BlockTable()
        # Every token whose KV the request needs: the prompt, then what it wrote. After a
        # preemption the written tokens are simply part of what is prefilled again, as are those
        # a resumed sequence took from its job's record.
        self.tokens = seq.prompt_ids + seq.output_ids
        self.computed = 0  # leading tokens whose KV is in the cache
        # Prompt logprobs need the logits of every prompt position: no prefix-cache hit may skip one.
        self.prefix_cache = seq.prompt_scores is None
        self.preemptions = 0

    @property
    def id(self) -> str:
        return self.seq.id

    @property
    def finished(self) -> bool:
        return self.seq.finished

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.computed

    def append(self, token: int, entry=None, jump_forward: bool = False) -> int:
        """The step's token, then with `jump_forward` those the grammar forces after it: all of them
        are computed in the next step, as one chunk (worker/constraint.py). Returns how many were
        forced."""
        self.seq.append(token, entry)  # entry: its logprobs, where asked (worker/logprobs.py)
        if self.seq.finished:
            return 0
        self.tokens.append(token)
        forced = 0
        for token in self.seq.take_forced() if jump_forward else ():
            forced += 1
            if not self.seq.finished:  # the last token needs no KV: nothing follows it
                self.tokens.append(token)
        return forced
