"""A scheduler with no model behind it, for the tests of who runs each step (the scheduler's and
the pacer's): requests that need no tokenizer, players already decoding, and a step whose model
is stood in for by token 1, with the scheduler's own bookkeeping after it."""
from __future__ import annotations

import time
from dataclasses import replace

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous.block_manager import BlockManager
from worker.continuous.config import EngineConfig
from worker.continuous.request import Request
from worker.continuous.scheduler import Scheduler
from worker.sequence import Sequence


class NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def request(prompt_len: int, max_tokens: int = 50, first: int = 10) -> Request:
    """A prompt of `prompt_len` ids counting up from `first`."""
    job = Job(id=f"r{time.monotonic_ns()}", model="m", prompt_ids=list(range(first, first + prompt_len)),
              params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
              timeout_s=60)
    return Request(Sequence(job, NoTokenizer(), frozenset()))


def decoding(s: Scheduler, count: int, max_tokens: int = 50) -> list[Request]:
    """`count` players whose 2-token prompts are computed: decoding from the next step on."""
    players = [request(2, max_tokens) for _ in range(count)]
    for p in players:
        s.add(p)
    run(s, s.schedule())
    return players


def run(s: Scheduler, plan):
    """A step after schedule(), the model stood in for: token 1 for each request the plan brings to
    its end. The bookkeeping is the scheduler's own, as the engine calls it (postprocess)."""
    produced = [(req, 1, None) for req, count in plan if req.computed + count == len(req.tokens)]
    return s.postprocess(plan, produced, elapsed_s=0.0)


def scheduler(policy="fifo", blocks=100, budget=16, block_size=4, margin=0, prefill_chunk=0, step_fill=0,
              prefix_caching=False):
    config = replace(EngineConfig.from_settings(Settings()), max_batch_tokens=budget, scheduler=policy,
                     prefill_chunk=prefill_chunk, step_fill=step_fill)
    return Scheduler(BlockManager(blocks, block_size, prefix_caching), config, 64, margin)
